"""engine.compile(): each block compiled at its boundary (Note [compiled blocks] in
offload/compile/blocks.py). No graph break inside a block, one graph for all
blocks, and training equal to plain PyTorch with the same blocks compiled the
same way; refusals name what to do instead."""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

import offload
from tests.support.harness import batches, build, engine_weights, lm_loss, make_config, train_engine

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)

BACKEND = "aot_eager"  # AOTAutograd's forward and backward graphs, without a compiler's minutes
LR, WD = 1e-2, 0.01


def _blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "Block"]


def _compiled_reference(model, data, backend=BACKEND):
    """Plain PyTorch, each Block's forward compiled the same way, AdamW as the engine's."""
    model = copy.deepcopy(model)
    for block in _blocks(model):
        block.forward = torch.compile(type(block).forward.__get__(block), backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    losses = []
    for per_rank in data:
        x, y = per_rank[0]
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, torch.stack(losses)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("param,optim,device", [("cpu", "cpu", "cpu"), ("nvme", "nvme", "cpu"),
                                                ("cpu", "cpu", "sim")])
def test_compiled_blocks_train_as_plain_torch_compiled_the_same_way(tmp_path, monkeypatch, param, optim, device):
    monkeypatch.setenv("OFFLOAD_DEVICE", device)
    model, data = build("tiny_gpt"), batches(4, seed=11)
    ref_model, ref_losses = _compiled_reference(model, data)
    torch._dynamo.reset()
    counters.clear()
    with offload.initialize(copy.deepcopy(model), make_config(param, optim, tmp_path)) as engine:
        engine.compile(backend=BACKEND)
        assert engine.is_compiled and len(engine.compiled_blocks) == len(_blocks(model))
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
        blocks = list(engine.compiled_blocks)
    assert dict(counters["graph_break"]) == {}, "a graph break inside a compiled block"
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph, every block
    assert all("forward" not in vars(b) for b in blocks), "close() leaves the blocks their own forward"
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_compiled_blocks_in_bf16_break_no_graph_and_stay_near_eager(tmp_path):
    model, data = build("tiny_gpt"), batches(3, seed=12)
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cfg = make_config("cpu", "cpu", tmp_path / str(compiled), precision="bf16")
        with offload.initialize(copy.deepcopy(model), cfg) as engine:
            if compiled:
                engine.compile(backend=BACKEND, modules=["Block"])
            runs[compiled] = train_engine(engine, data)
        if compiled:
            assert dict(counters["graph_break"]) == {}
    # bf16 rounding in another op order: near, not equal (torch's own compiled vs eager differ so too)
    torch.testing.assert_close(runs[True], runs[False], rtol=2e-2, atol=2e-2)


def test_compile_refuses_what_it_cannot_do(tmp_path):
    model = build("tiny_gpt")
    with offload.initialize(copy.deepcopy(model), make_config("cpu", "cpu", tmp_path / "a")) as engine:
        with pytest.raises(ValueError, match="DeepCompile"):
            engine.compile(schedule=[(0, "pass")])
        with pytest.raises(ValueError, match="no module of class 'Nope'.*Block"):
            engine.compile(modules=["Nope"])
        engine.compile(backend=BACKEND)
        with pytest.raises(RuntimeError, match="compiled already"):
            engine.compile(backend=BACKEND)
    with offload.initialize(copy.deepcopy(model), make_config("cpu", "cpu", tmp_path / "b")) as engine:
        engine.module.blocks[0].forward = engine.module.blocks[0].forward  # patched on the instance
        with pytest.raises(ValueError, match="already has a forward of its own"):
            engine.compile(backend=BACKEND)
        assert not engine.is_compiled


@pytest.mark.parametrize("param,optim,device", [("cpu", "cpu", "cpu"), ("nvme", "nvme", "sim")])
def test_checkpointed_compiled_blocks_recompute_the_same_graph(tmp_path, monkeypatch, param, optim, device):
    """The engine's checkpointing of the compiled blocks: the recomputation gathers the
    block's parameters again and reruns the same graph (no recompile), and training
    equals plain torch compiled the same way, bit for bit."""
    monkeypatch.setenv("OFFLOAD_DEVICE", device)
    model, data = build("tiny_gpt"), batches(4, seed=13)
    ref_model, ref_losses = _compiled_reference(model, data)
    torch._dynamo.reset()
    counters.clear()
    cfg = make_config(param, optim, tmp_path, extra={"activation_checkpointing": {"modules": ["Block"],
                                                                                  "profile": True}})
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        engine.compile(backend=BACKEND)
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
        recomputed = engine.activation_checkpointing.saver.timings.get("recomputations")
    assert recomputed == len(_blocks(model)) * len(data)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # recomputed, not recompiled
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("param,optim,section", [
    ("cpu", "cpu", {"modules": ["Block"], "backend": BACKEND, "fullgraph": True}),
    ("nvme", "nvme", {"enabled": True, "backend": BACKEND}),  # the blocks found: the largest ModuleList's
])
def test_the_config_compile_section_compiles_the_blocks_at_initialize(tmp_path, param, optim, section):
    model, data = build("tiny_gpt"), batches(3, seed=14)
    ref_model, ref_losses = _compiled_reference(model, data)
    torch._dynamo.reset()
    counters.clear()
    with offload.initialize(copy.deepcopy(model), make_config(param, optim, tmp_path,
                                                              extra={"compile": section})) as engine:
        assert [type(b).__name__ for b in engine.compiled_blocks] == ["Block"] * len(_blocks(model))
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
        with pytest.raises(RuntimeError, match="compiled already.*config's compile section"):
            engine.compile(backend=BACKEND)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("section,error", [
    ({"modules": ["Nope"]}, r"no module of class 'Nope' in the model \(its module classes: .*Block"),
    ({"modules": ["Block"], "backend": "no_such_backend"}, r"compile: torch\.compile\(backend='no_such_backend'.*refused"),
    ({"enabled": True, "mode": "fastest"}, r"compile: torch\.compile\(.*mode='fastest'.*refused"),
])
def test_a_compile_section_initialize_cannot_apply_fails_before_the_model_moves(tmp_path, section, error):
    model = build("tiny_gpt")
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    nvme = tmp_path / "swap"
    with pytest.raises(ValueError, match=error):
        offload.initialize(model, make_config("nvme", "nvme", nvme, extra={"compile": section}))
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0], f"{n} moved"
        torch.testing.assert_close(p.detach(), before[n][1], rtol=0, atol=0)
    assert all("forward" not in vars(m) for m in model.modules())
    assert not nvme.exists() or not [f for f in nvme.rglob("*") if f.is_file()], "files left behind"
    with offload.initialize(model, make_config("cpu", "cpu", tmp_path / "again")) as engine:  # and it can try again
        assert not engine.is_compiled
        train_engine(engine, batches(1, seed=15))


@pytest.mark.parametrize("how", ["config", "engine.compile"])
def test_a_compiled_blocks_parameters_are_all_read_before_the_block_starts(tmp_path, monkeypatch, how):
    """Note [blocks as the unit of prefetch]: a compiled block takes every parameter
    under it at once, so with parameters on NVMe the prefetcher reads the next block
    whole, from the previous one's start; sized by the largest parameter, as in eager,
    the last of a block's reads would only start when the block itself did."""
    from offload.partition.shard import Residency, Shard

    events = []
    prefetch = Shard.prefetch

    def recorded(shard):
        if shard.residency is Residency.RELEASED and shard.reads_ahead:
            events.append(("read", shard.name))
        prefetch(shard)

    monkeypatch.setattr(Shard, "prefetch", recorded)
    extra = {"compile": {"modules": ["Block"], "backend": BACKEND}} if how == "config" else None
    model, data = build("tiny_gpt"), batches(3, seed=16)
    with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path, extra=extra)) as engine:
        if how == "engine.compile":
            engine.compile(backend=BACKEND)
        block_of = {id(b): i for i, b in enumerate(engine.compiled_blocks)}
        for b in engine.compiled_blocks:
            b.register_forward_pre_hook(lambda m, args: events.append(("block", block_of[id(m)])))
        unit = sum(p.numel() for p in engine.compiled_blocks[0].parameters())
        assert engine.manager.prefetch.bucket_elems >= unit  # sized by the block
        for i, per_rank in enumerate(data):
            if i == len(data) - 1:
                events.clear()  # the last step: its order learned from the ones before
            x, y = per_rank[0]
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    starts = {n: i for i, (kind, n) in enumerate(events) if kind == "block"}
    assert sorted(starts) == list(range(len(_blocks(model))))
    for k, at in starts.items():
        names = [f"blocks.{k}.{n}" for n, p in model.blocks[k].named_parameters() if p.numel() > 1]
        first_reads = {}
        for i, (kind, n) in enumerate(events):
            if kind == "read" and n in names:
                first_reads.setdefault(n, i)
        late = [n for n in names if first_reads.get(n, -1) > at]
        assert not late, f"block {k}: {late} read only once the block had started"


def test_blocks_gathered_whole_are_checked_against_the_device_budget(tmp_path):
    """A device budget with room for eager's working set but not for a block gathered
    whole: the config's compile section is refused at initialize, engine.compile()
    before any block changes; both name the budget."""
    model = build("tiny_gpt")
    budget = {"memory": {"device_budget": 50_000}}  # eager reserves 38,016 bytes; whole blocks 63,000
    section = {"compile": {"modules": ["Block"], "backend": BACKEND}}
    with pytest.raises(MemoryError, match=r"working set.*memory\.device_budget is 50000"):
        offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path / "a", extra={**budget, **section}))
    with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path / "b", extra=budget)) as engine:
        with pytest.raises(MemoryError, match=r"compile: a block gathers .* past memory\.device_budget"):
            engine.compile(backend=BACKEND)
        assert not engine.is_compiled and all("forward" not in vars(m) for m in engine.module.modules())
        engine.compile(backend=BACKEND, modules=["Linear"])  # smaller modules fit: nothing to resize
        assert len(engine.compiled_blocks) == 8
