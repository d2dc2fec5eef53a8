"""The device layer (Note [device layer]): the simulated device behaves as a CUDA
device does where ordering is concerned, and bites when a wait is missing."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

from offload import device
from offload.device.cpu import CpuDevice
from offload.device.sim import SimDevice
from offload.device.sim_memory import HostDeviceMixError, StreamOrderError, plain

N = 1024  # float32: 4 KB per copy


def gbps_for(seconds: float, numel: int = N, element_size: int = 4) -> float:
    """The bandwidth at which a copy of `numel` elements takes `seconds` (jitter aside)."""
    return numel * element_size / seconds / 1e9


def to_device(layer, values, name, stream=None):
    stage = layer.pinned(values.numel(), values.dtype, f"{name}-stage")
    stage.copy_(values)
    buf = layer.alloc(values.numel(), values.dtype, name)
    layer.current_stream().wait_event(layer.copy(buf, stage, stream))
    return buf


def to_host(layer, buf):
    """A plain host tensor with `buf`'s values, through a pinned buffer and a waited copy."""
    out = layer.pinned(buf.numel(), buf.dtype, "readback")
    layer.copy(out, buf).synchronize()
    return plain(out).clone()


@pytest.mark.parametrize("dtype, poisoned", [
    (torch.float32, lambda t: torch.isnan(t).all()),
    (torch.int32, lambda t: (t.view(torch.uint8) == 0xA5).all()),
])
def test_a_copy_destination_holds_poison_until_its_event_completes(make_sim, dtype, poisoned):
    layer = make_sim(gbps=gbps_for(0.5), check_order=False)  # unchecked: let us look
    values = torch.arange(N).to(dtype)
    stage = layer.pinned(N, dtype, "stage")
    stage.copy_(values)
    buf = layer.alloc(N, dtype, "w0")
    done = layer.copy(buf, stage, layer.stream("h2d"))
    assert not done.query()
    assert poisoned(plain(buf))
    done.synchronize()
    assert done.query()
    assert_close(plain(buf), values, rtol=0, atol=0)


def test_copies_on_one_stream_run_in_the_order_enqueued(make_sim):
    layer = make_sim(gbps=gbps_for(0.02), jitter_s=0.02, seed=1)
    stream = layer.stream("copy")
    a, b = torch.arange(N, dtype=torch.float32), -torch.arange(N, dtype=torch.float32)
    stage_a, stage_b = layer.pinned(N, torch.float32, "a"), layer.pinned(N, torch.float32, "b")
    stage_a.copy_(a)
    stage_b.copy_(b)
    buf = layer.alloc(N, torch.float32, "buf")
    out_a, out_b = layer.pinned(N, torch.float32, "out_a"), layer.pinned(N, torch.float32, "out_b")
    layer.copy(buf, stage_a, stream)
    layer.copy(out_a, buf, stream)   # same stream: after the copy into buf, no wait needed
    layer.copy(buf, stage_b, stream)  # and after the read of buf before it
    layer.copy(out_b, buf, stream).synchronize()
    assert_close(plain(out_a), a, rtol=0, atol=0)
    assert_close(plain(out_b), b, rtol=0, atol=0)
    spans = layer.schedule
    assert all(later.started >= earlier.finished for earlier, later in zip(spans, spans[1:]))


@pytest.mark.parametrize("how", ["wait_event", "wait_stream"])
def test_a_stream_waits_for_another(make_sim, how):
    layer = make_sim(gbps=gbps_for(0.1))
    h2d, d2h = layer.stream("h2d"), layer.stream("d2h")
    values = torch.arange(N, dtype=torch.float32)
    stage = layer.pinned(N, torch.float32, "stage")
    stage.copy_(values)
    buf = layer.alloc(N, torch.float32, "buf")
    arrived = layer.copy(buf, stage, h2d)
    if how == "wait_event":
        d2h.wait_event(arrived)
    else:
        d2h.wait_stream(h2d)
    out = layer.pinned(N, torch.float32, "out")
    layer.copy(out, buf, d2h).synchronize()
    assert_close(plain(out), values, rtol=0, atol=0)
    first, second = layer.schedule
    assert second.started >= first.finished


def test_synchronize_waits_for_every_stream(make_sim):
    layer = make_sim(gbps=gbps_for(0.05))
    values = torch.arange(N, dtype=torch.float32)
    outs, events = [], []
    for i in range(3):
        stage = layer.pinned(N, torch.float32, f"stage{i}")
        stage.copy_(values + i)
        buf = layer.alloc(N, torch.float32, f"buf{i}")
        events.append(layer.copy(buf, stage, layer.stream(f"s{i}")))
        outs.append(buf)
    layer.synchronize()
    assert all(e.query() for e in events)
    for i, buf in enumerate(outs):
        assert (buf - float(i)).sum().item() == values.sum().item()  # device compute, no wait raised


def test_reading_a_copy_destination_before_waiting_raises_naming_it(make_sim):
    layer = make_sim(gbps=gbps_for(0.05))
    stage = layer.pinned(N, torch.float32, "stage")
    stage.fill_(1.0)
    buf = layer.alloc(N, torch.float32, "layer0.weight")
    layer.copy(buf, stage, layer.stream("h2d"))
    with pytest.raises(StreamOrderError, match=r"'layer0\.weight' read by compute \(mul\).*copy #0"):
        buf * 2
    layer.synchronize()


@pytest.mark.parametrize("check_order", [True, False])
def test_freeing_a_buffer_under_an_in_flight_copy_raises_naming_it(make_sim, check_order):
    layer = make_sim(gbps=gbps_for(0.3), check_order=check_order)
    stage = layer.pinned(N, torch.float32, "stage")
    stage.fill_(1.0)
    buf = layer.alloc(N, torch.float32, "layer3.bias")
    layer.copy(buf, stage, layer.stream("h2d"))
    with pytest.raises(StreamOrderError, match=r"'layer3\.bias' freed while 1 copy\(ies\) in flight"):
        layer.free(buf)
    with pytest.raises(StreamOrderError, match=r"'stage' freed while 1 copy"):
        layer.free(stage)
    layer.synchronize()
    layer.free(buf)
    with pytest.raises(StreamOrderError, match=r"'layer3\.bias' used by compute .* after it was freed"):
        buf + 1


def test_refilling_a_staging_buffer_a_copy_still_reads_raises_naming_it(make_sim):
    layer = make_sim(gbps=gbps_for(0.05))
    stage = layer.pinned(N, torch.float32, "staging[0]")
    stage.fill_(1.0)
    buf = layer.alloc(N, torch.float32, "buf")
    sent = layer.copy(buf, stage, layer.stream("h2d"))
    with pytest.raises(StreamOrderError, match=r"'staging\[0\]' written by compute \(fill_\) on the host"):
        stage.fill_(2.0)
    sent.synchronize()
    stage.fill_(2.0)  # now it is the host's again


def test_device_memory_does_not_mix_with_host_tensors(make_sim):
    layer = make_sim()
    buf = to_device(layer, torch.ones(N), "w")
    with pytest.raises(HostDeviceMixError, match="add mixes device buffer 'w' with a host tensor"):
        buf + torch.ones(N)
    with pytest.raises(HostDeviceMixError, match=r"cpu\(\) on device buffer 'w'"):
        buf.cpu()
    with pytest.raises(HostDeviceMixError, match="copy_ mixes device buffer 'w'"):
        buf.copy_(torch.ones(N))
    assert_close(to_host(layer, buf * 2 + torch.tensor(1.0)), torch.full((N,), 3.0), rtol=0, atol=0)


def test_the_jitter_is_seeded(make_sim):
    def schedule(seed):
        layer = make_sim(seed=seed, gbps=gbps_for(0.001), jitter_s=0.002)
        stream = layer.stream("copy")
        stage = layer.pinned(N, torch.float32, "stage")
        stage.zero_()
        for i in range(5):
            layer.copy(layer.alloc(N, torch.float32, f"b{i}"), stage, stream)
        layer.synchronize()
        return [(s.stream, s.nbytes, s.modeled_s) for s in layer.schedule]

    assert schedule(7) == schedule(7)
    assert schedule(7) != schedule(8)


def test_the_cpu_layer_is_synchronous():
    layer = CpuDevice()
    stream = layer.stream("copy")
    src = torch.arange(N, dtype=torch.float32)
    dst = layer.alloc(N, torch.float32, "w")
    done = layer.copy(dst, src, stream)
    assert done.query()
    assert_close(dst, src, rtol=0, atol=0)
    assert type(dst) is torch.Tensor and dst.device == layer.device
    assert layer.counters.copies == 1 and layer.counters.bytes_copied == N * 4


def test_copies_are_counted_by_the_way_they_cross_the_bus(make_sim):
    layer = make_sim(gbps=gbps_for(0.001))
    values = torch.arange(N, dtype=torch.float32)
    buf = to_device(layer, values, "w")  # up: 4 KB
    twin = layer.alloc(N, torch.float32, "twin")
    layer.copy(twin, buf).synchronize()  # within the device: neither way
    assert_close(to_host(layer, twin), values, rtol=0, atol=0)  # down: 4 KB
    c = layer.counters
    assert (c.copies, c.bytes_copied, c.bytes_to_device, c.bytes_to_host) == (3, 3 * N * 4, N * 4, N * 4)


def test_layer_selection_from_the_environment(monkeypatch):
    monkeypatch.delenv(device.ENV_DEVICE, raising=False)
    assert device.selected_name() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv(device.ENV_DEVICE, "sim")
    monkeypatch.setenv(device.ENV_SIM_SEED, "3")
    monkeypatch.setenv(device.ENV_SIM_GBPS, "12.5")
    layer = device.from_env()
    try:
        assert isinstance(layer, SimDevice) and (layer.seed, layer.gbps) == (3, 12.5)
    finally:
        layer.close()
    monkeypatch.setenv(device.ENV_SIM_GBPS, "0")
    with pytest.raises(ValueError, match=r"OFFLOAD_SIM_GBPS='0': expected a number of GB/s > 0"):
        device.from_env()
    monkeypatch.setenv(device.ENV_DEVICE, "gpu")
    with pytest.raises(ValueError, match=r"OFFLOAD_DEVICE='gpu': expected one of cuda, sim, cpu"):
        device.from_env()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_layer_without_cuda_raises_clearly(monkeypatch):
    monkeypatch.setenv(device.ENV_DEVICE, "cuda")
    with pytest.raises(RuntimeError, match=r"OFFLOAD_DEVICE=cuda: CUDA is not available here .*OFFLOAD_DEVICE=sim"):
        device.from_env()


@pytest.mark.parametrize("env, expected", [
    ({"OFFLOAD_DEVICE": "sim", "OFFLOAD_SIM_SEED": "4", "OFFLOAD_SIM_GBPS": "10"}, r"^sim \(seed 4, 10 GB/s"),
    ({"OFFLOAD_DEVICE": "cpu"}, r"^cpu$"),
])
def test_offload_report_names_the_device_layer(env, expected):
    proc = subprocess.run([sys.executable, "-m", "offload", "report", "--json"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, **env))
    assert proc.returncode == 0, proc.stderr
    assert re.search(expected, json.loads(proc.stdout)["device_layer"])


# -- the simulator bites: a pipeline correct with its waits, wrong without any one --

WAITS = {
    "compute-waits-h2d": "the default stream waits the H2D copy before compute reads its input",
    "d2h-waits-compute": "the copy stream waits the compute before the D2H copy reads its output",
    "host-waits-d2h": "the host waits the D2H copy before it reads the pinned result",
}


def pipeline(layer, batches, skip=None):
    """H2D on a copy stream, compute on the default stream, D2H on the copy stream."""
    copy_stream, compute = layer.stream("copy"), layer.current_stream()
    stage = layer.pinned(N, torch.float32, "stage")
    x = layer.alloc(N, torch.float32, "x")
    result = layer.pinned(N, torch.float32, "result")
    outs = []
    for batch in batches:
        stage.copy_(batch)  # the host's write: ordered before what it enqueues next
        arrived = layer.copy(x, stage, copy_stream)
        if skip != "compute-waits-h2d":
            compute.wait_event(arrived)
        y = x * 2 + torch.tensor(1.0)
        computed = layer.event()
        computed.record(compute)
        if skip != "d2h-waits-compute":
            copy_stream.wait_event(computed)
        left = layer.copy(result, y, copy_stream)
        if skip != "host-waits-d2h":
            left.synchronize()
        outs.append(result.clone())  # host compute on a pinned buffer: a plain tensor
    layer.synchronize()
    return outs


BATCHES = [torch.randn(N, generator=torch.Generator().manual_seed(i)) for i in range(2)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_pipeline_is_exact_with_every_wait_under_jitter(make_sim, seed):
    layer = make_sim(seed=seed, gbps=gbps_for(0.01), jitter_s=0.02)
    for out, batch in zip(pipeline(layer, BATCHES), BATCHES):
        assert_close(out, batch * 2 + 1, rtol=0, atol=0)


@pytest.mark.parametrize("skip", list(WAITS))
def test_the_pipeline_raises_without_any_one_wait(make_sim, skip):
    layer = make_sim(gbps=gbps_for(0.05), jitter_s=0.01)
    with pytest.raises(StreamOrderError, match=r"buffer '(x|computed device tensor|result)'"):
        pipeline(layer, BATCHES, skip=skip)
    layer.synchronize()


@pytest.mark.parametrize("skip", ["compute-waits-h2d", "host-waits-d2h"])
def test_without_a_wait_the_numbers_are_poison(make_sim, skip):
    # With the order checks off, a read that outruns its copy sees the poison.
    # (Skipping d2h-waits-compute gives right numbers here, because the sim's
    # compute has finished before the caller can enqueue anything; only the
    # order check, above, catches that one.)
    layer = make_sim(gbps=gbps_for(0.1), check_order=False)
    outs = pipeline(layer, BATCHES[:1], skip=skip)
    assert torch.isnan(outs[0]).all()
