"""Fixtures of the device-layer tests."""
import pytest
import torch

from offload.device.sim import SimDevice


def dispatch_modes() -> int:
    """How many dispatch modes this thread has entered (a layer that models compute adds one
    until it is closed). Counted, not asserted empty: a layer some earlier test failed to
    close may have left its own (idle) mode."""
    return torch._C._len_torch_dispatch_stack()


@pytest.fixture
def make_sim():
    """make(**SimDevice arguments): a sim layer with no jitter unless given, closed after the test."""
    layers = []

    def make(**kwargs):
        kwargs.setdefault("jitter_s", 0.0)
        layer = SimDevice(**kwargs)
        layers.append(layer)
        return layer

    modes = dispatch_modes()
    yield make
    for layer in reversed(layers):  # last built, first closed: each leaves the dispatch stack
        layer.close()
    assert dispatch_modes() == modes, "a sim layer left its mode behind"
