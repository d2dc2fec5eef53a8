"""The sim device's modeled compute (Note [sim modeled compute]): with a rate set,
each op on device memory takes its FLOPs (or bytes) over that rate, slept on the
calling thread with the host's cores free; the results stay bit for bit those
without the model, and with no rate nothing changes."""
import copy
import time

import pytest
import torch
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

import offload
from offload import device
from tests.device.conftest import dispatch_modes
from offload.device.sim_compute import ComputeRate
from offload.device.sim_memory import StreamOrderError, plain

from tests.support.harness import batches, build, lm_loss, make_config, train_engine

M, K, N = 67, 129, 95  # odd sizes: nothing lines up with a SIMD width or a block


def tflops_for(seconds: float, flops: int) -> float:
    """The rate at which `flops` take `seconds`."""
    return flops / seconds / 1e12


@pytest.fixture(autouse=True)
def _no_rate_from_the_environment(monkeypatch):
    """A user's OFFLOAD_SIM_TFLOPS or OFFLOAD_SIM_DEVICE_GBPS changes no test here."""
    monkeypatch.delenv(device.ENV_SIM_TFLOPS, raising=False)
    monkeypatch.delenv(device.ENV_SIM_DEVICE_GBPS, raising=False)


def on_device(layer, *tensors):
    """Device buffers of the layer holding `tensors`' values (as the engine's adopt makes them)."""
    return [layer.adopt(t.clone(), f"t{i}") for i, t in enumerate(tensors)]


# (op, its operands' shapes, its FLOPs): torch.utils.flop_counter's formulas.
OPS = {
    "mm": (torch.mm, [(M, K), (K, N)], 2 * M * K * N),
    "addmm": (torch.addmm, [(M, N), (M, K), (K, N)], 2 * M * K * N),
    "bmm": (torch.bmm, [(3, M, K), (3, K, N)], 2 * 3 * M * K * N),
    "baddbmm": (torch.baddbmm, [(3, M, N), (3, M, K), (3, K, N)], 2 * 3 * M * K * N),
}


@pytest.mark.parametrize("op", OPS)
def test_a_matmul_takes_its_flops_over_the_rate_and_the_counter_says_so(make_sim, op):
    fn, shapes, flops = OPS[op]
    modeled = 0.2
    layer = make_sim(compute=ComputeRate(tflops=tflops_for(modeled, flops)))
    gen = torch.Generator().manual_seed(0)
    on_host = [torch.randn(s, generator=gen) for s in shapes]
    operands = on_device(layer, *on_host)
    start = time.perf_counter()
    out = fn(*operands)
    layer.synchronize()  # the host queued it; the device is done once synchronized
    took = time.perf_counter() - start
    assert took >= modeled
    assert layer.modeled_compute_s == pytest.approx(modeled, rel=1e-12)
    counters = layer.reset_modeled_compute()
    assert (counters.ops, counters.flops, counters.bytes) == (1, flops, 0)
    assert layer.modeled_compute_s == 0.0 and layer.compute.counters.ops == 0
    assert_close(plain(out), fn(*on_host), rtol=0, atol=0)


def test_memory_bound_ops_take_their_bytes_over_the_device_bandwidth(make_sim):
    numel, modeled = 1 << 16, 0.1
    nbytes = 3 * numel * 4  # a + b: two operands read, one result written
    layer = make_sim(compute=ComputeRate(tflops=1.0, device_gbps=nbytes / modeled / 1e9))
    a, b = on_device(layer, torch.ones(numel), torch.full((numel,), 2.0))
    start = time.perf_counter()
    c = a + b
    layer.synchronize()
    assert time.perf_counter() - start >= modeled
    assert layer.compute.counters.bytes == nbytes
    assert layer.modeled_compute_s == pytest.approx(modeled, rel=1e-12)
    a.add_(b)  # in place: reads a and b, writes a
    assert layer.compute.counters.bytes == 2 * nbytes
    assert_close(plain(c), torch.full((numel,), 3.0), rtol=0, atol=0)


def test_without_device_gbps_memory_bound_ops_take_the_hosts_time(make_sim):
    layer = make_sim(compute=ComputeRate(tflops=1e-6))
    a, = on_device(layer, torch.ones(1 << 16))
    (a * 2).relu_().sum()
    counters = layer.compute.counters
    assert counters.ops == 3 and counters.flops == 0 and counters.modeled_s == 0.0


def tiny_model(layer, gen):
    """Two linear layers (no bias), their weights device buffers lent to compute as the
    engine lends a gathered parameter; returns (buffers, lent weights). Keep the buffers:
    a lent alias is device memory while its buffer lives, as the engine's shards keep theirs."""
    shapes = [(K, N), (N, 31)]
    buffers = on_device(layer, *(torch.randn(s, generator=gen) / 10 for s in shapes))
    return buffers, [layer.lend(b, write=False).requires_grad_() for b in buffers]


def forward_backward(weights, x):
    x = x.clone().requires_grad_()
    # silu: its backward has a composite kernel beside its CPU one, with other rounding
    loss = torch.nn.functional.silu(torch.tanh(x @ weights[0])).relu() @ weights[1]
    loss.square().mean().backward()
    return [loss.detach(), x.grad] + [w.grad for w in weights]


def test_a_tiny_models_forward_and_backward_cost_its_matmul_flops(make_sim):
    rate = 1e-4  # TFLOP/s: about 0.1 s of modeled compute
    layer = make_sim(compute=ComputeRate(tflops=rate))
    gen = torch.Generator().manual_seed(1)
    buffers, weights = tiny_model(layer, gen)
    x = torch.randn(M, K, generator=gen)  # the model's input, on the host as a user's batch is
    forward = 2 * M * K * N + 2 * M * N * 31
    start = time.perf_counter()
    forward_backward(weights, x)
    layer.synchronize()
    took = time.perf_counter() - start
    # Backward: for each mm, one for the gradient of its input and one for its weight's.
    flops = forward + 2 * forward
    assert layer.compute.counters.flops == flops
    assert layer.modeled_compute_s == pytest.approx(flops / (rate * 1e12), rel=1e-9)
    assert took >= layer.modeled_compute_s


def test_under_inference_mode_a_composite_op_is_timed_by_its_parts(make_sim):
    layer = make_sim(compute=ComputeRate(tflops=1e-3))
    gen = torch.Generator().manual_seed(3)
    x, w, bias = (torch.randn(s, generator=gen) for s in [(M, K), (N, K), (N,)])
    on = on_device(layer, x, w, bias)
    with torch.inference_mode():
        out = torch.nn.functional.linear(*on)  # reaches the mode whole: no autograd key
    assert layer.compute.counters.flops == 2 * M * K * N
    assert_close(plain(out), torch.nn.functional.linear(x, w, bias), rtol=0, atol=0)


def test_results_are_bit_for_bit_those_without_the_model(make_sim):
    def run(compute):
        layer = make_sim(compute=compute)
        gen = torch.Generator().manual_seed(2)
        buffers, weights = tiny_model(layer, gen)
        out = forward_backward(weights, torch.randn(M, K, generator=gen))
        return [plain(t).clone() for t in out], layer

    modeled, modeled_layer = run(ComputeRate(tflops=1e-3, device_gbps=1.0))
    unmodeled, unmodeled_layer = run(None)
    assert modeled_layer.modeled_compute_s > 0 and unmodeled_layer.modeled_compute_s == 0.0
    for a, b in zip(modeled, unmodeled, strict=True):
        assert_close(a, b, rtol=0, atol=0)


def test_the_host_is_idle_while_compute_is_modeled(make_sim):
    modeled = 0.4
    fn, shapes, flops = OPS["mm"]
    layer = make_sim(compute=ComputeRate(tflops=tflops_for(modeled / 4, flops)))
    operands = on_device(layer, *(torch.randn(s) for s in shapes))
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(4):
        fn(*operands)
    layer.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= modeled
    assert cpu < 0.25 * wall, f"the process used {cpu:.3f} s of CPU in {wall:.3f} s of modeled compute"


def test_a_copy_on_a_side_stream_hides_behind_modeled_compute(make_sim):
    """The point of the model: the default stream waiting a copy waits only for what the
    compute queued before it did not cover (Note [hidden transfer time])."""
    seconds, fn, (a_shape, b_shape), flops = 0.3, *OPS["mm"]
    numel = 1 << 12
    layer = make_sim(gbps=numel * 4 / seconds / 1e9,
                     compute=ComputeRate(tflops=tflops_for(seconds / 4, flops)))
    a, b = on_device(layer, torch.randn(a_shape), torch.randn(b_shape))
    stage = layer.pinned(numel, torch.float32, "stage")
    stage.fill_(1.0)
    buf = layer.alloc(numel, torch.float32, "w")
    h2d = layer.stream("h2d")
    h2d.wait_stream(layer.current_stream())  # the buffer's memory may be compute's until then
    start = time.perf_counter()
    arrived = layer.copy(buf, stage, h2d)
    for _ in range(4):
        fn(a, b)
    layer.current_stream().wait_event(arrived)
    (buf * 2).sum()
    took = time.perf_counter() - start
    assert seconds <= took < 1.6 * seconds, "the copy and the compute did not overlap"
    blocked = sum(end - begin for begin, end, _ in layer.blocked)
    assert blocked < 0.5 * seconds


def test_the_stream_order_is_still_checked(make_sim):
    layer = make_sim(gbps=4096 * 4 / 0.05 / 1e9, compute=ComputeRate(tflops=1e-6))
    stage = layer.pinned(4096, torch.float32, "stage")
    stage.fill_(1.0)
    buf = layer.alloc(4096, torch.float32, "layer0.weight")
    layer.copy(buf, stage, layer.stream("h2d"))
    with pytest.raises(StreamOrderError, match=r"'layer0\.weight' read by compute \(mul\)"):
        buf * 2
    layer.synchronize()
    assert layer.compute.counters.ops == 0  # the copy is not compute: its bandwidth times it


def test_modeling_is_off_by_default(make_sim, monkeypatch):
    modes = dispatch_modes()
    layer = make_sim()
    assert layer.compute is None and dispatch_modes() == modes
    a, b = on_device(layer, torch.randn(M, K), torch.randn(K, N))
    a @ b
    assert layer.modeled_compute_s == 0.0 and layer.reset_modeled_compute().ops == 0
    assert "compute" not in layer.describe()
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    for unset in (None, "0", " "):
        if unset is None:
            monkeypatch.delenv(device.ENV_SIM_TFLOPS, raising=False)
        else:
            monkeypatch.setenv(device.ENV_SIM_TFLOPS, unset)
        built = device.from_env()
        try:
            assert built.compute is None and dispatch_modes() == modes
        finally:
            built.close()


def test_the_environment_sets_the_rate(monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    monkeypatch.setenv(device.ENV_SIM_TFLOPS, "312")
    monkeypatch.setenv(device.ENV_SIM_DEVICE_GBPS, "2000")
    modes = dispatch_modes()
    layer = device.from_env()
    try:
        assert layer.compute.rate == ComputeRate(tflops=312.0, device_gbps=2000.0)
        assert "compute modeled at 312 TFLOP/s, device memory 2000 GB/s" in layer.describe()
    finally:
        layer.close()
    assert dispatch_modes() == modes


@pytest.mark.parametrize("env, match", [
    ({"OFFLOAD_SIM_TFLOPS": "fast"}, r"OFFLOAD_SIM_TFLOPS='fast': expected a number of TFLOP/s >= 0"),
    ({"OFFLOAD_SIM_TFLOPS": "-1"}, r"OFFLOAD_SIM_TFLOPS='-1'"),
    ({"OFFLOAD_SIM_TFLOPS": "inf"}, r"tflops=inf; expected a finite number"),
    ({"OFFLOAD_SIM_DEVICE_GBPS": "900"}, r"OFFLOAD_SIM_DEVICE_GBPS\) without tflops \(OFFLOAD_SIM_TFLOPS\)"),
])
def test_a_bad_rate_is_refused_naming_it(monkeypatch, env, match):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    modes = dispatch_modes()
    with pytest.raises(ValueError, match=match):
        device.from_env()
    assert dispatch_modes() == modes


def test_the_engine_on_the_sim_costs_the_models_flops_and_trains_bit_for_bit(tmp_path, monkeypatch):
    """The engine's own compute-stream ops (gathers, casts, gradient hand-over) move bytes
    only, so the modeled FLOPs are the model's: FlopCounterMode's on plain PyTorch."""
    model, data = build("tiny_gpt"), batches(3, seed=3)
    reference = copy.deepcopy(model)
    with FlopCounterMode(display=False) as flop_counter:
        for per_rank in data:
            x, y = per_rank[0]
            lm_loss(reference(x), y).backward()
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")

    def train(tflops):
        monkeypatch.setenv(device.ENV_SIM_TFLOPS, str(tflops))
        with offload.initialize(copy.deepcopy(model), make_config("cpu", "cpu", tmp_path)) as engine:
            start = time.perf_counter()
            losses = train_engine(engine, data)
            engine.device_layer.synchronize()
            walls.append(time.perf_counter() - start)
            return losses, engine.device_layer.reset_modeled_compute()

    walls = []

    rate = 2e-5  # TFLOP/s: about 0.3 s of modeled compute for the three steps
    modes = dispatch_modes()
    modeled_losses, counters = train(rate)
    assert dispatch_modes() == modes, "the engine's close left the sim's mode behind"
    losses, unmodeled = train(0)
    assert counters.flops == flop_counter.get_total_flops() > 0
    assert counters.modeled_s == pytest.approx(counters.flops / (rate * 1e12), rel=1e-9)
    assert walls[0] >= counters.modeled_s  # the host runs tiny_gpt's matmuls faster: it waited
    assert unmodeled.ops == 0
    assert_close(modeled_losses, losses, rtol=0, atol=0)


def test_the_host_runs_ahead_and_its_own_work_hides_under_modeled_compute(make_sim):
    """As a GPU's host queues kernels: host work between ops overlaps the modeled
    device time, and the host waits only where it observes the device."""
    flops, count, host_work_s = 2 * 64 * 64 * 64, 20, 0.002
    layer = make_sim(compute=ComputeRate(tflops=tflops_for(0.01, flops)))  # 10 ms an op
    a, b = on_device(layer, torch.randn(64, 64), torch.randn(64, 64))
    start = time.perf_counter()
    for _ in range(count):
        torch.mm(a, b)
        time.sleep(host_work_s)  # the host's own work between ops
    issued = time.perf_counter() - start
    layer.synchronize()
    took = time.perf_counter() - start
    modeled = layer.modeled_compute_s
    assert modeled == pytest.approx(count * 0.01, rel=1e-9)
    assert issued < 0.6 * modeled  # the host did not wait for each op
    assert modeled <= took < modeled + 0.5 * count * host_work_s  # most of the host's work hid


def test_poison_off_still_catches_a_missing_wait_and_skips_the_fill(monkeypatch):
    """OFFLOAD_SIM_POISON=0 (for timing): no NaN fill, the stream-order check still raises."""
    from offload.device.sim_memory import StreamOrderError

    import offload.device.sim as sim_module

    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    monkeypatch.setenv("OFFLOAD_SIM_POISON", "0")
    filled = []
    monkeypatch.setattr(sim_module, "poison", filled.append)  # fresh memory may hold anything: count the fills
    layer = device.from_env()
    try:
        assert layer.poison_memory is False
        buf = layer.alloc(1024, torch.float32, "w")
        stage = layer.pinned(1024, torch.float32, "stage")
        stage.fill_(1.0)
        h2d = layer.stream("h2d")
        h2d.wait_stream(layer.current_stream())
        layer.copy(buf, stage, h2d)
        with pytest.raises(StreamOrderError):
            (buf * 2).sum()  # read before waiting the copy's event
        assert filled == []  # neither the allocation nor the copy's destination was filled
    finally:
        layer.close()
    monkeypatch.setenv("OFFLOAD_SIM_POISON", "no")
    with pytest.raises(ValueError, match="OFFLOAD_SIM_POISON"):
        device.from_env()
