"""The layer and device the `any_device` tests run on (Note [the device a test
runs on] in tests/conftest.py): `from tests.support.layer_under_test import test_device`."""
import os

import pytest
import torch

TEST_DEVICE_ENV = "OFFLOAD_TEST_DEVICE"
_TEST_LAYERS = ("cpu", "sim", "cuda")


def test_layer() -> str:
    """The layer OFFLOAD_TEST_DEVICE names for the `any_device` tests (default cpu)."""
    value = os.environ.get(TEST_DEVICE_ENV, "").strip().lower() or "cpu"
    if value not in _TEST_LAYERS:
        raise pytest.UsageError(f"{TEST_DEVICE_ENV}={os.environ[TEST_DEVICE_ENV]!r}: expected one of "
                                f"{', '.join(_TEST_LAYERS)} (unset: cpu)")
    return value


def test_device() -> torch.device:
    """Where an `any_device` test puts its inputs, models and references: the
    device the engine computes on for test_layer() (the sim computes on the host)."""
    return torch.device("cuda", 0) if test_layer() == "cuda" else torch.device("cpu")


test_layer.__test__ = test_device.__test__ = False  # helpers, not tests


def exact() -> dict:
    """assert_close's tolerance for "equal to plain PyTorch": bit for bit where
    the reference's optimizer runs on the host as the engine's does (cpu, sim);
    on a GPU the reference's AdamW is CUDA's (other fma contractions than the
    host kernel's), so the two agree to fp32 rounding, not bit for bit."""
    return {"rtol": 1e-5, "atol": 1e-6} if test_layer() == "cuda" else {"rtol": 0, "atol": 0}
