"""How much transfer time was hidden behind compute (Note [hidden transfer time]):
the interval arithmetic on hand-made intervals, and the sim's record of the
waits that blocked the host."""
import threading
import time

import pytest
import torch

from offload.device import hidden_time
from offload.device.sim import CopySpan, SimDevice


# -- intervals ----------------------------------------------------------------

def test_union_merges_overlapping_nested_and_touching_intervals_in_any_order():
    assert hidden_time.union([(5, 6), (0, 2), (1, 3), (1.5, 1.7), (3, 4)]) == [(0, 4), (5, 6)]


def test_union_of_nothing_and_of_empty_intervals_is_empty():
    assert hidden_time.union([]) == []
    assert hidden_time.union([(1, 1), (2, 2)]) == []
    assert hidden_time.length([]) == 0


def test_an_interval_that_ends_before_it_starts_is_refused():
    with pytest.raises(ValueError, match=r"interval \(2, 1\) ends before it starts"):
        hidden_time.union([(0, 1), (2, 1)])


def test_union_reads_only_start_and_end_of_longer_records():
    assert hidden_time.union([(0, 1, "MainThread"), (0.5, 2, "other")]) == [(0, 2)]


def test_intersect_of_two_sets_of_intervals():
    a = [(0, 4), (6, 10)]
    b = [(1, 2), (3, 7), (9, 12)]
    assert hidden_time.intersect(a, b) == [(1, 2), (3, 4), (6, 7), (9, 10)]
    assert hidden_time.intersect(a, []) == []
    assert hidden_time.intersect([], b) == []


def test_two_copies_at_once_count_once_and_only_blocked_time_is_exposed():
    # Copies busy over [0, 4] (two overlap on [1, 2]); compute blocked [3, 5].
    figures = hidden_time.hidden([(0, 2), (1, 2), (2.5, 4)], [(3, 5)])
    assert figures["busy_s"] == pytest.approx(3.5)
    assert figures["exposed_s"] == pytest.approx(1.0)
    assert figures["hidden_s"] == pytest.approx(2.5)
    assert figures["hidden_fraction"] == pytest.approx(1 - 1.0 / 3.5)


@pytest.mark.parametrize("blocked, fraction", [([], 1.0), ([(10, 11)], 1.0), ([(-1, 20)], 0.0)])
def test_all_hidden_and_all_exposed(blocked, fraction):
    assert hidden_time.hidden([(0, 1), (2, 3)], blocked)["hidden_fraction"] == fraction


def test_nothing_transferred_has_no_hidden_fraction():
    figures = hidden_time.hidden([], [(0, 1)])
    assert figures == {"busy_s": 0, "exposed_s": 0, "hidden_s": 0, "hidden_fraction": None}


def test_a_window_clips_the_transfers_to_it():
    figures = hidden_time.hidden([(-2, 1), (3, 9)], [(0, 0.5)], window=(0, 4))
    assert figures["busy_s"] == pytest.approx(2.0)  # [0, 1] and [3, 4]
    assert figures["exposed_s"] == pytest.approx(0.5)


def _span(index, stream, started, finished, nbytes=100):
    return CopySpan(index, stream, "stage", "x", nbytes, 0.25, started, finished)


def test_copy_overlap_counts_only_the_compute_threads_waits_and_default_stream_copies_whole():
    schedule = [
        _span(0, "h2d", 10.0, 11.0),          # hidden: nobody waits meanwhile
        _span(1, "h2d", 11.0, 12.0),          # the compute thread waits [11.5, 12]
        _span(2, "d2h", 12.0, 13.0),          # only the optimizer thread waits on it
        _span(3, "default", 13.0, 13.5),      # on the compute thread: exposed whole
        _span(4, "h2d", 13.5, None, 50),      # in flight at the window's end
        _span(5, "h2d", 2.0, 3.0),            # before the window
        _span(6, "h2d", None, None),          # not started
        _span(7, "h2d", 9.5, 10.5),           # from before the window: counts from its start
    ]
    blocked = [(11.5, 12.0, "MainThread"), (12.0, 13.0, "optimizer"), (13.75, 14.5, "MainThread")]
    figures = hidden_time.copy_overlap(schedule, blocked, window=(10.0, 14.0), thread="MainThread")
    assert figures["busy_s"] == pytest.approx(4.0)
    assert figures["exposed_s"] == pytest.approx(1.25)
    assert figures["hidden_fraction"] == pytest.approx(1 - 1.25 / 4)
    assert figures["compute_blocked_s"] == pytest.approx(1.25)
    assert figures["compute_blocked"] == [(1.5, 2.0), (3.0, 3.5), (3.75, 4.0)]
    assert figures["modeled_s"] == pytest.approx(6 * 0.25)
    assert figures["copies"] == 6 and figures["bytes"] == 550 and figures["step_s"] == 4.0
    assert [(c["stream"], c["start_s"], c["end_s"]) for c in figures["timeline"]] == [
        ("h2d", 0.0, 1.0), ("h2d", 1.0, 2.0), ("d2h", 2.0, 3.0), ("default", 3.0, 3.5), ("h2d", 3.5, None),
        ("h2d", -0.5, 0.5)]


def test_read_overlap_from_a_timeline_step():
    step = {"wall_s": 4.0, "spans": [
        {"kind": "read", "start_s": -1.0, "seconds": 2.0, "thread": "nvme"},  # from the step before
        {"kind": "read", "start_s": 2.0, "seconds": 1.0, "thread": "nvme"},
        {"kind": "wait", "start_s": 2.5, "seconds": 0.5, "thread": "compute"},
        {"kind": "wait", "start_s": 0.0, "seconds": 1.0, "thread": "optimizer"},  # not compute
        {"kind": "forward", "start_s": 0.0, "seconds": 2.5, "thread": "compute"},
    ]}
    figures = hidden_time.read_overlap(step)
    assert figures["reads"] == 2
    assert figures["busy_s"] == pytest.approx(2.0)
    assert figures["exposed_s"] == pytest.approx(0.5)
    assert figures["hidden_fraction"] == pytest.approx(0.75)


def test_read_overlap_of_a_step_without_reads():
    assert hidden_time.read_overlap({"wall_s": 1.0, "spans": []})["hidden_fraction"] is None


# -- the sim's record of blocked waits ------------------------------------------

N = 1 << 18  # float32: 1 MB per copy
COPY_S = 0.05


@pytest.fixture
def sim():
    layer = SimDevice(gbps=N * 4 / COPY_S / 1e9, jitter_s=0.0)
    yield layer
    layer.close()


def _h2d(layer, stream):
    stage = layer.pinned(N, torch.float32, "stage")
    stage.fill_(1.0)
    x = layer.alloc(N, torch.float32, "x")
    return layer.copy(x, stage, stream)


def _step(layer, work_s):
    """Enqueue a copy, compute for work_s, then wait the copy on the default stream."""
    t0 = time.perf_counter()
    arrived = _h2d(layer, layer.stream("h2d"))
    time.sleep(work_s)  # compute that does not need the copy
    layer.current_stream().wait_event(arrived)
    t1 = time.perf_counter()
    return hidden_time.copy_overlap(layer.schedule, layer.blocked, (t0, t1), threading.current_thread().name)


def test_a_copy_waited_at_once_is_exposed(sim):
    figures = _step(sim, work_s=0.0)
    assert figures["copies"] == 1 and figures["bytes"] == N * 4
    assert figures["busy_s"] >= COPY_S
    assert figures["hidden_fraction"] < 0.2
    assert len(sim.blocked) == 1 and sim.blocked[0][2] == threading.current_thread().name


def test_a_copy_behind_longer_compute_is_hidden_and_its_wait_not_recorded(sim):
    figures = _step(sim, work_s=3 * COPY_S)
    assert figures["hidden_fraction"] == 1.0
    assert sim.blocked == []  # the event had completed: the wait did not block


@pytest.mark.parametrize("how", ["event", "stream", "layer"])
def test_each_synchronize_records_the_blocking_of_its_thread(sim, how):
    stream = sim.stream("d2h")
    done = _h2d(sim, stream)
    waiter = threading.Thread(name="optimizer", target={
        "event": done.synchronize, "stream": stream.synchronize, "layer": sim.synchronize}[how])
    waiter.start()
    waiter.join()
    assert [who for _, _, who in sim.blocked] == ["optimizer"]
    start, end, _ = sim.blocked[0]
    assert end - start >= COPY_S * 0.5
