"""Prefetch in the learned order and optimizer updates overlapped with backward
(Note [prefetch order], Note [optimizer overlap]) change nothing numerically:
every combination trains exactly like plain PyTorch, on models built to break
them: an order that changes every step, and many tiny layers whose updates
race the next forward."""
import copy
import json
import os

import pytest
import torch
from torch import nn

import offload
from tests.support.harness import batches, build, lm_loss, make_config, run_engine, run_reference

STEPS = 8
SWITCHES = {
    "prefetch+overlap": {},
    "prefetch only": {"overlap_comm": False},
    "overlap only": {"stage3_prefetch_bucket_size": 0},
    "neither": {"overlap_comm": False, "stage3_prefetch_bucket_size": 0},
}


def _config(param, optim, path, switches, **kw):
    cfg = make_config(param, optim, path, **kw)
    cfg["zero_optimization"].update(switches)
    return cfg


# The fast part: every switch, one micro-step per step, parameters and state on NVMe.
@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
@pytest.mark.parametrize("param,optim", [("nvme", "nvme"), pytest.param("cpu", "nvme", marks=pytest.mark.slow),
                                         pytest.param("nvme", "cpu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("gas", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_every_switch_matches_pytorch(tmp_path, switches, param, optim, gas):
    model = build("tiny_gpt")
    data = batches(STEPS, seed=3)
    ref_model, ref_losses = run_reference(model, data, gas=gas, clip=0.0, lr=1e-2, weight_decay=0.01)
    weights, losses, engine = run_engine(model, data, _config(param, optim, tmp_path, switches, gas=gas))
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_prefetch_and_overlap_actually_ran(tmp_path):
    """The parity above would hold trivially if nothing were read ahead or overlapped."""
    model = build("tiny_gpt")
    with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path)) as engine:
        for per_rank in batches(4, seed=1):
            x, y = per_rank[0]
            engine.backward(lm_loss(engine(x), y))
            assert engine.step_runner.in_backward.active  # updates started during that backward
            engine.step()
        stats = engine.manager.prefetch.stats
        timeline = engine.timeline()
    assert stats["prefetched"] > 0 and stats["hits"] > 0 and stats["diverged_passes"] == 0
    assert stats["retained"] > 0  # the last layers kept from forward to backward
    kinds = {s["kind"] for s in timeline["spans"]}
    assert {"forward", "backward", "read", "write", "optimizer"} <= kinds
    threads = {s["thread"] for s in timeline["spans"] if s["kind"] == "optimizer"}
    assert threads == {"offload-host"}


def test_clipping_defers_updates_and_stays_exact(tmp_path):
    """Clipping needs the global norm before any update: the step is deferred
    (reads still streamed) and equals torch.nn.utils.clip_grad_norm_ + AdamW."""
    model = build("tiny_gpt")
    data = batches(STEPS, seed=5)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.05, lr=1e-2, weight_decay=0.01)
    weights, losses, _ = run_engine(model, data, make_config("nvme", "nvme", tmp_path, clip=0.05))
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


class Shuffled(nn.Module):
    """Its layers run in a different order every step (and some steps skip one):
    a learned prefetch order is wrong every time."""

    def __init__(self, n=6, width=33):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.head = nn.Linear(width, 5)
        self.order = list(range(n))

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return self.head(x)


def test_a_model_whose_order_changes_every_step_trains_exactly(tmp_path):
    torch.manual_seed(0)
    model = Shuffled()
    gen = torch.Generator().manual_seed(1)
    orders = [torch.randperm(6, generator=gen).tolist()[: 6 - (i % 2)] for i in range(10)]
    data = [(torch.randn(4, 33, generator=gen), torch.randint(0, 5, (4,), generator=gen)) for _ in orders]

    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    ref_losses = []
    for order, (x, y) in zip(orders, data):
        ref.order = order
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.detach())

    cfg = make_config("nvme", "nvme", tmp_path)
    with offload.initialize(model, cfg) as engine:
        losses = []
        for order, (x, y) in zip(orders, data):
            model.order = order
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        assert engine.manager.prefetch.stats["diverged_passes"] > 0  # it did diverge, and went on
        weights = engine.full_state_dict(master=True)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


class ManyTiny(nn.Module):
    """Forty 3x3 layers: updates finish in microseconds, so a forward that read
    a stale or half-written value would show at once."""

    def __init__(self, n=40):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.sin(layer(x))
        return x


class LateWrites:
    """Stands in for the AsyncIO of the optimizer's parameter store: a write
    reaches the disk only when someone waits for it, the latest moment
    asynchronous I/O allows. This disk finishes a small write in microseconds,
    so without this a missing wait would go unseen. `reading(io)` wraps the
    compute thread's AsyncIO: a read of a file whose new value has not landed
    is recorded in `stale_reads`."""

    def __init__(self, io):
        self._io = io
        self.pending: dict[str, int] = {}  # path -> writes submitted, not landed
        self.deferred = 0
        self.stale_reads: list[str] = []

    def __getattr__(self, name):  # everything but pwrite is the real AsyncIO's
        return getattr(self._io, name)

    def pwrite(self, tensor, path, offset=0):
        path = os.fspath(path)
        self.pending[path] = self.pending.get(path, 0) + 1
        self.deferred += 1
        return _LateWrite(self, tensor, path, offset)

    def reading(self, io):
        late = self

        class CheckedReads:
            def __getattr__(self, name):
                return getattr(io, name)

            def pread(self, tensor, path, offset=0):
                if late.pending.get(os.fspath(path)):
                    late.stale_reads.append(os.path.basename(path))
                return io.pread(tensor, path, offset)

        return CheckedReads()


class _LateWrite:
    """A request as the swap store sees one (done, wait); the write starts at the first wait."""

    def __init__(self, late: LateWrites, tensor, path: str, offset: int):
        self._late, self._write = late, (tensor, path, offset)  # the tensor stays lent until written
        self._request = None

    def done(self) -> bool:
        return self._request is not None and self._request.done()

    def wait(self) -> None:
        if self._write is not None:
            tensor, path, offset = self._write
            self._write = None
            try:
                self._request = self._late._io.pwrite(tensor, path, offset)
                self._request.wait()
            finally:
                self._late.pending[path] -= 1
        self._request.wait()  # raises the write's error again, as a Request does


def _train_tiny_with_late_writes(cfg, data):
    torch.manual_seed(0)
    model = ManyTiny()
    with offload.initialize(model, cfg) as engine:
        writer = engine.optimizer.states.param_store.store  # the optimizer's own (Note [one store per thread])
        reader = engine.shards[0].ctx.param_store.store  # the compute thread's
        assert writer is not reader
        late = writer._io = LateWrites(writer._io)
        reader._io = late.reading(reader._io)
        losses = []
        for x in data:
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        return torch.stack(losses), engine.full_state_dict(master=True), engine.manager.prefetch.stats, late


@pytest.mark.parametrize("optim", ["nvme", pytest.param("cpu", marks=pytest.mark.slow)],
                         ids=["overlapped update", "deferred update"])
def test_many_tiny_layers_never_read_a_stale_value(tmp_path, optim):
    """Parameters on NVMe, read ahead, with every new value's write landing as
    late as it may (LateWrites): the next forward must wait for them, on demand
    and in its reads ahead alike. Equal to plain PyTorch with the same Adam
    kernel (offload.optim.CPUAdam, equal to torch.optim.AdamW element by
    element: tests/optim/test_cpu_adam.py), bit for bit: this model amplifies any
    difference ~10x per step, so one stale read shows. With NVMe optimizer
    state the updates overlap backward (Note [optimizer overlap]); the state
    has its own directory, so the parameter writes have their own store and
    nothing else waits for them (a shared store finishes them in order before
    the state's writes). Without the wait the forward after each step reads
    the last value written: layer 0's weight, on demand (overlapped: backward
    ends there), or the last layer's bias, read ahead (deferred)."""
    from offload.optim import CPUAdam

    gen = torch.Generator().manual_seed(2)
    data = [torch.randn(2, 3, generator=gen) for _ in range(8)]
    cfg = make_config("nvme", optim, tmp_path / "params", lr=5e-2, weight_decay=0.0)
    if optim == "nvme":
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "optimizer")

    torch.manual_seed(0)
    ref = ManyTiny()
    opt = CPUAdam(ref.parameters(), lr=5e-2, weight_decay=0.0)
    ref_losses = []
    for x in data:
        loss = ref(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.detach())

    losses, weights, prefetch, late = _train_tiny_with_late_writes(cfg, data)
    assert late.deferred >= len(data) * len(weights)  # every new value was written late
    assert prefetch["prefetched"] > 0 and prefetch["hits"] > 0  # the reads ahead ran, and were used
    assert late.stale_reads == []
    torch.testing.assert_close(losses, torch.stack(ref_losses), rtol=0, atol=0)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_forward_before_step_is_refused_while_updates_run(tmp_path):
    model = build("tiny_gpt")
    (x, y), = batches(1)[0]
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path)) as engine:
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(RuntimeError, match=r"engine.step\(\) must follow engine.backward\(\)"):
            engine(x)
        with pytest.raises(RuntimeError, match="backward\\(\\) called again before engine.step\\(\\)"):
            engine.backward(lm_loss(torch.zeros(3, 7, 37, requires_grad=True), y))
        with pytest.raises(RuntimeError, match=r"engine.step\(\) must follow engine.backward\(\)"):
            model(x)  # the user's own module: the same check
        engine.step()
        engine(x)  # fine again


def test_timeline_and_chrome_trace(tmp_path):
    model = build("tiny_gpt")
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path / "swap")) as engine:
        assert engine.timeline()["spans"] == []  # no complete step yet
        for per_rank in batches(2, seed=1):
            x, y = per_rank[0]
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        tl = engine.timeline()
        engine.export_chrome_trace(tmp_path / "trace.json")
    assert tl["wall_s"] > 0 and tl["seconds"]["forward"] > 0 and tl["seconds"]["backward"] > 0
    for span in tl["spans"]:
        # A span belongs to the step it ends in: one begun just before the step's start (a
        # read or an update running on from the step before) may start before 0, by as
        # much as a loaded machine delays the boundary, so no tolerance on its start.
        assert span["seconds"] >= 0 and span["start_s"] + span["seconds"] >= 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(tl["spans"])
    assert {e["cat"] for e in complete} >= {"forward", "backward", "read", "write", "optimizer"}


def test_logging_keys_log_the_step_and_its_breakdown(tmp_path, caplog):
    model = build("tiny_gpt")
    cfg = make_config("nvme", "nvme", tmp_path, extra={"steps_per_print": 2, "wall_clock_breakdown": True})
    with caplog.at_level("INFO", logger="offload"), offload.initialize(model, cfg) as engine:
        for per_rank in batches(4, seed=1):
            x, y = per_rank[0]
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "offload"]
    assert [m.split(":")[0] for m in lines if m.startswith("step") and "lr" in m] == ["step 2", "step 4"]
    took = [m for m in lines if " took " in m]
    assert len(took) == 2 and all("forward" in m and "optimizer" in m and "wait" in m for m in took)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_parameter_the_reads_ahead_passed_is_not_read_again(tmp_path, monkeypatch, compiled):
    """Note [reads ahead passed a gathered parameter]: at the turn from forward to
    backward the reads ahead pass the last block while it is still gathered; released
    then, it was read a second time, on demand, as backward began. Kept instead, no
    parameter is read twice in a step (a wide head makes the largest parameter, so the
    bucket reaches past the whole turn)."""
    from offload.partition.shard import Residency, Shard
    from tests.support.models import TinyGPT

    reads = []
    prefetch = Shard.prefetch

    def recorded(shard):
        if shard.residency is Residency.RELEASED and shard.reads_ahead:
            reads.append(shard.name)
        prefetch(shard)

    monkeypatch.setattr(Shard, "prefetch", recorded)
    torch.manual_seed(0)
    model = TinyGPT(vocab=1000)
    gen = torch.Generator().manual_seed(2)
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path)) as engine:
        if compiled:
            torch._dynamo.reset()
            engine.compile(backend="aot_eager")
        for _ in range(3):  # the last one in the order the first two taught
            reads.clear()
            missed = engine.manager.prefetch.stats["missed"]
            tokens = torch.randint(0, 1000, (3, 9), generator=gen)
            engine.backward(nn.functional.cross_entropy(engine(tokens).flatten(0, 1), tokens.flatten()))
            engine.step()
        missed = engine.manager.prefetch.stats["missed"] - missed
    twice = sorted({n for n in reads if reads.count(n) > 1})
    assert not twice, f"read again in one step: {twice}"
    assert missed == 1  # the pass's first parameter, before any order applies
