"""The host worker: one daemon thread on which the engine's host-side step work runs.

Note [the host worker]
Beside a device with memory of its own, the work a step does on the host
runs on one thread, in the order it was submitted: each gradient's
device-to-host copy is waited for and added into its partition there
(Note [copy streams] in offload/transfers/device_copies.py), and, when the
update overlaps backward, the shard's Adam update follows at once on the same
thread (Note [optimizer overlap] in offload/step/updates.py). So autograd's
thread only queues copies and records, never waits for one, and a shard's
update never runs before its gradient is in. The Adam kernel itself fans out
over the cores the compute thread does not need (Note [optimizer threads] in
offload/simd.py).

Not a ThreadPoolExecutor: its threads are joined at interpreter exit, and a
Ctrl-C landing while it starts a thread can leave one unknown to it, waiting
forever, so the process never exits. A daemon thread never holds the exit up
(its swap files are scratch, removed by close or left to the OS).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class HostWorker:
    """One daemon thread running submitted calls in order."""

    def __init__(self, name: str = "offload-host"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def on_worker(self) -> bool:
        """Whether the caller is this worker's thread (a call made from a call it runs)."""
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            del call  # nothing lent to a call (a gathered master's view) outlives it
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                    future.set_exception(exc)
            del fn, args

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()
