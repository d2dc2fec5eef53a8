"""The Notes (`Note [name]` in the code, cited by name elsewhere) stay true to the code:
every citation names a Note that exists, and every backticked name inside a Note's
text is a name the code still has."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_GLOBS = ("offload/**/*.py", "csrc/**/*.cpp", "csrc/**/*.h", "tests/**/*.py", "benchmarks/**/*.py",
              "examples/**/*.py", "setup.py")
DOC_GLOBS = ("docs/**/*.md", "*.md")
# Backticked names in Notes that are other projects' (the code does not have them).
OTHER_PROJECTS = {"last_batch_iteration": "DeepSpeed's schedulers' step counter (Note [DeepSpeed step offset])"}

DEFINITION = re.compile(r'^([ \t]*)(#|//|\*|-|""")?[ \t]*Note \[([^\]]+)\]', re.M)
CITATION = re.compile(r"Note \[([^\]]+)\]")
TICKED = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?:\([^`]*\))?`")


def files(globs, root=ROOT) -> dict[Path, str]:
    """The texts of the files `globs` match under root; this file's examples left out."""
    return {p: p.read_text() for g in globs for p in root.glob(g) if p.is_file() and p != Path(__file__).resolve()}


def normal(name: str) -> str:
    """A Note's name as cited across a line break (comment markers, string quotes, indent)."""
    return re.sub(r"\s+", " ", re.sub(r'"\s*\n\s*"|\n\s*(?:#|//|\*)?\s*', " ", name)).strip()


def note_bodies(texts: dict[Path, str]) -> list[tuple[Path, str, int, int]]:
    """(file, name, first line, end line) of each Note's text: a comment block's
    lines, or a docstring's up to its end or the next Note."""
    out = []
    for path, text in texts.items():
        lines = text.split("\n")
        for i, line in enumerate(lines):
            m = DEFINITION.match(line)
            if not m:
                continue
            marker, j = m.group(2), i + 1
            while j < len(lines):
                s = lines[j].strip()
                if marker in ("#", "//"):
                    if not s.startswith(marker):
                        break
                elif '"""' in s or re.match(r"(#|//)?\s*Note \[", s):
                    break
                j += 1
            out.append((path, normal(m.group(3)), i, j))
    return out


def unresolved_citations(texts: dict[Path, str]) -> list[tuple[str, str]]:
    defined = {normal(m.group(3)) for t in texts.values() for m in DEFINITION.finditer(t)}
    return sorted({(str(p), normal(m.group(1))) for p, t in texts.items() for m in CITATION.finditer(t)
                   if normal(m.group(1)) not in defined})


def unknown_names(code: dict[Path, str]) -> list[tuple[str, str, str]]:
    """Backticked names in Notes whose last part appears nowhere in the code outside Notes."""
    bodies = note_bodies(code)
    masked = {p: t.split("\n") for p, t in code.items()}
    for path, _, i, j in bodies:
        for k in range(i, j):
            masked[path][k] = ""
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", "\n".join("\n".join(v) for v in masked.values())))
    out = []
    for path, name, i, j in bodies:
        for m in TICKED.finditer("\n".join(code[path].split("\n")[i:j])):
            last = m.group(1).split(".")[-1]
            if last not in words and last not in OTHER_PROJECTS:
                out.append((str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), name, m.group(1)))
    return out


def test_every_note_cited_exists():
    texts = {**files(CODE_GLOBS), **files(DOC_GLOBS)}
    assert len({n for _, n, _, _ in note_bodies(files(CODE_GLOBS))}) > 60  # the walk found the Notes
    assert unresolved_citations(texts) == []


def test_every_backticked_name_in_a_note_is_in_the_code():
    assert unknown_names(files(CODE_GLOBS)) == []


def test_a_stale_citation_and_a_stale_name_are_found(tmp_path):
    (tmp_path / "a.py").write_text('"""Note [kept]\nUpdated by `update_shard` and `start_deferred`.\n"""\n'
                                   "def update_shard():\n    pass  # Note [kept], Note [gone]\n")
    texts = files(["*.py"], root=tmp_path)
    assert unresolved_citations(texts) == [(str(tmp_path / "a.py"), "gone")]
    assert [n for _, _, n in unknown_names(texts)] == ["start_deferred"]
