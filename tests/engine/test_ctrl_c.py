"""A Ctrl-C during training stops it as a KeyboardInterrupt, wherever it lands
(examples/finetune.py's Ctrl-C test, tests/integrations/test_finetune_example.py, trained
on after one Ctrl-C in ~25, or exited 1, before these were fixed)."""
import os
import sys

import pytest

import offload
from tests.support.harness import batches, build, lm_loss, make_config


def test_saved_activations_die_without_running_python_code(tmp_path):
    """Note [credits owed by the garbage collector] (offload/activations/saver.py):
    a KeyboardInterrupt raised in Python code that a dying object runs (a
    weakref.finalize callback) is printed as "Exception ignored" and lost.
    Autograd frees saved tensors all through backward, so their death must run
    no Python code; their bytes are still credited (on the next read)."""
    (x, y), = batches(1)[0]
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path)) as engine:
        loss = lm_loss(engine(x), y)
        assert engine.activation_report()["device_bytes"] > 0
        calls = []
        sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_qualname) if event == "call" else None)
        try:
            del loss  # the graph goes, and every saved tensor with it
        finally:
            sys.setprofile(None)
        assert calls == []
        assert engine.activation_report()["device_bytes"] == 0


class _CtrlCAsWaitReturns:
    """A request whose first wait() raises KeyboardInterrupt once the transfer is
    done: where CPython runs a SIGINT's handler after the native wait returns."""

    def __init__(self, request):
        self._request, self._armed = request, True

    def done(self):
        return self._request.done()

    def wait(self):
        self._request.wait()
        if self._armed:
            self._armed = False
            raise KeyboardInterrupt("simulated Ctrl-C")


def test_ctrl_c_in_a_transfer_of_the_step_stops_it_as_a_keyboard_interrupt(tmp_path):
    """The interrupted write's handle fails with InterruptedError (an OSError);
    the step's cleanup waits on it while the KeyboardInterrupt propagates, and
    must not replace it (the example's `except KeyboardInterrupt` then missed
    it and the run exited 1). Clipping: the step is deferred, on this thread,
    as in the example; one nvme_path: parameters and state share one store."""
    (x, y), = batches(1)[0]
    engine = offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", tmp_path, clip=1.0))
    try:
        engine.backward(lm_loss(engine(x), y))
        io = engine.optimizer.states.param_store.store._io
        real_pwrite = io.pwrite
        interrupted = []

        def pwrite(tensor, path, offset=0):
            request = real_pwrite(tensor, path, offset)
            if interrupted or not os.path.basename(path).startswith("param."):
                return request
            interrupted.append(path)
            return _CtrlCAsWaitReturns(request)

        io.pwrite = pwrite
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        assert interrupted
    finally:
        engine.close()
    assert not any(tmp_path.iterdir())  # swap files and the run's directory removed
