"""The gradient staging ring (Note [gradient staging ring]): pieces cut to each size,
handed out after the newest and wrapping to the start where the oldest has gone; a
piece released out of turn frees its bytes once those before it are free too."""
import threading

import pytest

from offload.aio.memory import ALIGN
from offload.transfers.staging_ring import StagingRing


def _offset(ring, piece):
    return piece.data_ptr() - ring._base


def test_pieces_follow_each_other_and_wrap_to_the_start():
    ring = StagingRing(4 * ALIGN, pin=False, what="test ring")
    a, b, c = ring.acquire(ALIGN), ring.acquire(2 * ALIGN), ring.acquire(1)
    assert [_offset(ring, p) for p in (a, b, c)] == [0, ALIGN, 3 * ALIGN]
    assert ring.in_use_bytes == 4 * ALIGN
    ring.release(a)
    d = ring.acquire(ALIGN)  # the room the oldest left, at the start
    assert _offset(ring, d) == 0
    ring.release(b)
    ring.release(c)
    ring.release(d)
    assert ring.in_use_bytes == 0 and ring.peak_in_use_bytes == 4 * ALIGN
    assert _offset(ring, ring.acquire(4 * ALIGN)) == 0  # empty: the whole slab again


def test_a_piece_released_out_of_turn_frees_nothing_before_the_oldest():
    ring = StagingRing(3 * ALIGN, pin=False, what="test ring")
    a, b, c = (ring.acquire(ALIGN) for _ in range(3))
    ring.release(c)
    ring.release(b)  # newest first, as head first after backward takes them
    with pytest.raises(TimeoutError, match="test ring: no room for 4096 bytes came free"):
        ring.acquire(ALIGN, timeout=0.05)  # a still holds the start
    ring.release(a)
    assert _offset(ring, ring.acquire(3 * ALIGN)) == 0


def test_a_waiting_acquire_gets_the_room_another_thread_releases():
    ring = StagingRing(2 * ALIGN, pin=False, what="test ring")
    first = ring.acquire(2 * ALIGN)
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(ALIGN, timeout=10)))
    waiter.start()
    ring.release(first)
    waiter.join(10)
    assert got and _offset(ring, got[0]) == 0


def test_requests_it_cannot_serve_are_errors():
    ring = StagingRing(ALIGN, pin=False, what="test ring")
    with pytest.raises(ValueError, match="exceeds its 4096 bytes"):
        ring.acquire(ALIGN + 1)
    piece = ring.acquire(1)
    with pytest.raises(ValueError, match="did not hand out"):
        ring.release(piece[ALIGN // 2:])
    ring.release(piece)
    ring.close()
    with pytest.raises(RuntimeError, match="closed"):
        ring.acquire(1)


def test_the_slab_is_charged_to_the_ledger_and_credited_at_close():
    class Ledger:
        held = 0

        def charge(self, n, what):
            self.held += n

        def credit(self, n):
            self.held -= n

    ledger = Ledger()
    ring = StagingRing(ALIGN + 1, pin=False, ledger=ledger, what="test ring")
    assert ledger.held == 2 * ALIGN  # rounded up to the alignment
    ring.close()
    ring.close()
    assert ledger.held == 0
