"""The package's modules: none longer than 500 lines, and no import circle among
them or among its folders, every import counted, those inside functions and under
TYPE_CHECKING too (a lazy import that closes a circle is still a circle a reader has
to hold in mind)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "offload"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(name: str, path: Path, known: dict) -> set[str]:
    """The package's modules that `name` imports, anywhere in its source."""
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - (node.level - 1)] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name and target.startswith("offload"):
                out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    known = modules()
    assert len(known) > 50  # the walk found the package
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert graph["offload.engine.entry"] >= {"offload.engine.create", "offload.optim.param_groups"}
    assert circles(graph) == []


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen folder by folder (offload.partition, offload.activations, ...;
    a module at the package's top is a folder of its own)."""
    def folder(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        out.setdefault(folder(name), set()).update(folder(t) for t in targets if folder(t) != folder(name))
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, set())
    return out


def test_no_folder_imports_one_that_imports_it_back():
    """The folders are layers: memory accounting (offload/accounting.py) on the ground
    floor; the activations and the parameter runtime import neither the other, and
    compiling by blocks, above both, drives them; none in a circle with another."""
    known = modules()
    folders = folder_graph({name: imported(name, path, known) for name, path in known.items()})
    assert "offload.partition" not in folders["offload.activations"]
    assert "offload.activations" not in folders["offload.partition"]
    assert {"offload.partition", "offload.activations"} <= folders["offload.compile"]
    assert circles(folders) == []


# The folders (and top-level modules) by layer, the ground floor first: each imports only
# from its own layer or those below (docs/ARCHITECTURE.md, "Layers").
LAYERS = (
    ("offload", "offload.tiers", "offload.timeline", "offload.host_worker", "offload.requirements",
     "offload.device", "offload._native"),  # the root package imports nothing eagerly
    ("offload.accounting", "offload.simd", "offload.torch_release", "offload.aio", "offload.placement",
     "offload.config", "offload.schedulers", "offload.ops"),  # memory accounting, I/O, config
    ("offload.activations", "offload.node"),
    ("offload.transfers",),  # copy streams, the staging ring, NVMe homes, collectives
    ("offload.partition",),  # shards and their runtime
    ("offload.compile",),  # compiling by blocks: drives the runtime and the activations
    ("offload.process_memory", "offload.optim"),  # the update's arithmetic and state
    ("offload.step",),  # the step and its one owner
    ("offload.checkpoint_io",),
    ("offload.engine",),  # construction
    ("offload.deepspeed", "offload.sizing", "offload.report", "offload.cli", "offload.__main__"),
)


def upward(folders: dict[str, set[str]]) -> list[tuple[str, str]]:
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    return sorted((a, b) for a, targets in folders.items() for b in targets if layer[b] > layer[a])


def test_no_folder_imports_one_above_it():
    known = modules()
    folders = folder_graph({name: imported(name, path, known) for name, path in known.items()})
    assert set(folders) == {name for names in LAYERS for name in names}, "a folder missing from LAYERS"
    assert upward(folders) == []
    folders["offload.optim"] = folders["offload.optim"] | {"offload.step"}  # planted: found
    assert upward(folders) == [("offload.optim", "offload.step")]


def test_a_planted_folder_circle_is_found():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    graph["offload.partition.manager"] = graph["offload.partition.manager"] | {"offload.compile.blocks"}
    assert ["offload.compile", "offload.partition"] in circles(folder_graph(graph))


@pytest.mark.parametrize("planted", [("offload.partition.shard", "offload.step.updates")])
def test_a_planted_circle_is_found(planted):
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    a, b = planted
    graph[a] = graph[a] | {b}
    assert any(set(planted) <= set(c) for c in circles(graph))


def test_no_module_is_longer_than_a_reader_holds_in_one_sitting():
    """500 lines at most per module of the package (split by responsibility beyond that)."""
    longest = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: n for name, n in longest.items() if n > 500} == {}
