"""One asynchronous transfer of a SwapStore (SwapHandle) and its pieces in flight."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass
class _Piece:
    """One transfer in flight: the request, its pool buffer, and what to do after."""

    handle: "SwapHandle"
    request: object
    buffer: torch.Tensor | None  # a pool buffer, or None for a lent tensor
    after: Callable[[], None] | None


class SwapHandle:
    """An asynchronous swap_out or swap_in. wait() returns None for swap_out
    and the tensor for swap_in, and raises the transfer's error, if any."""

    def __init__(self, store, op: str, key: str, path: Path):  # store: the SwapStore that runs it
        self.op, self.key, self.path = op, key, path
        self._store = store
        self._pieces_left = 0
        self._open = True  # pieces still being added; not complete even at zero left
        self._error: BaseException | None = None
        self._interrupt: BaseException | None = None  # the Ctrl-C that failed it, if one did
        self._result = None
        self._finished = False
        self._finish: Callable[[], object] | None = None
        self._t0 = time.perf_counter()
        self._source = None  # swap_out in place, lent: (meta, tensor), kept if the write fails

    def done(self) -> bool:
        return self._finished or all(p.request.done() for p in self._store._queue if p.handle is self)

    def wait(self):
        if not self._finished:
            self._store._finish_through(self)
        self._raise_error()
        return self._result

    def _raise_error(self) -> None:
        if self._error is None:
            return
        if self._interrupt is not None and sys.exc_info()[1] is self._interrupt:
            # Waited on by cleanup (a finally) while the Ctrl-C that failed it
            # propagates: that interrupt goes on; an InterruptedError, an
            # OSError, would replace it and turn the Ctrl-C into an I/O error.
            raise self._interrupt
        raise self._error
