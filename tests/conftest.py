"""What every test shares: the device layer it runs on, the SIMD levels.

# Note [the device a test runs on]
The suite says which device it tests, never the machine: an autouse fixture
sets OFFLOAD_DEVICE for every test (and so for the ranks and scripts it
spawns, which inherit the environment), so a machine with a GPU, or a user's
OFFLOAD_DEVICE, changes nothing.
- By default every test runs on the `cpu` layer.
- Tests marked `any_device` (the engine's parity matrix, Hugging Face models,
  activation checkpointing, save and exact resume, Trainer) run on the layer
  OFFLOAD_TEST_DEVICE names (cpu, the default; sim; cuda), with their inputs,
  models and references on `test_device()`. Run them on the sim:
      OFFLOAD_TEST_DEVICE=sim python -m pytest -m any_device
  and on a GPU, under PyTorch's stream sanitizer:
      OFFLOAD_TEST_DEVICE=cuda TORCH_CUDA_SANITIZER=1 python -m pytest -m "any_device or cuda"
- A test that sets OFFLOAD_DEVICE itself (monkeypatch.setenv) wins over both.
Fixtures of module or session scope run before a test's own and so on cpu.
Every engine a test builds is checked at teardown to be on the layer that
test asked for, with every shard on that same layer (`_engines_on_the_layer_asked_for`).
"""
import os
import weakref

import pytest
import torch

from offload import simd
import offload.device
from tests.support.layer_under_test import TEST_DEVICE_ENV, test_layer

def pytest_configure(config):
    layer = test_layer()
    if layer == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"{TEST_DEVICE_ENV}=cuda: torch {torch.__version__} finds no GPU here; "
                                f"use {TEST_DEVICE_ENV}=sim for the simulated device")
    # The session's default, for what runs outside a test's own fixture (module- and
    # session-scoped fixtures, collection): the cpu layer, whatever the environment says.
    os.environ[offload.device.ENV_DEVICE] = "cpu"


# Note [torch releases in CI]: the modules that lean on autograd's internals
# (saved-tensor hooks, checkpoint recomputation, grad hooks, collectives' names)
# and the user paths through them mark themselves `torch_release`
# (`pytestmark`), so a renamed or new module keeps or gets its mark where it is
# read. CI runs them (`-m torch_release`) on every release in
# offload/requirements.py TORCH_TESTED besides the README's 2.13.0, each in a
# venv of its own (.ci/run).


def pytest_report_header(config):
    return (f"device layer: cpu for every test; {test_layer()} for the any_device ones "
            f"({TEST_DEVICE_ENV}); torch {torch.__version__}")


@pytest.fixture(autouse=True)
def _device_layer(request, monkeypatch):
    """Note [the device a test runs on]: pins OFFLOAD_DEVICE, then checks each engine built."""
    layer = test_layer() if request.node.get_closest_marker("any_device") else "cpu"
    monkeypatch.setenv(offload.device.ENV_DEVICE, layer)
    from offload.engine.engine import Engine

    built = []
    original = Engine.__init__

    def recording_init(self, *args, **kwargs):
        asked = os.environ.get(offload.device.ENV_DEVICE)
        original(self, *args, **kwargs)
        built.append((weakref.ref(self), asked, self.device_layer.name, self.device,
                      {id(s.ctx.layer) for s in self.shards}, id(self.device_layer)))

    monkeypatch.setattr(Engine, "__init__", recording_init)
    yield layer
    _engines_on_the_layer_asked_for(built)


def _engines_on_the_layer_asked_for(built) -> None:
    for _, asked, got, device, shard_layers, layer_id in built:
        assert got == asked, f"an engine asked for layer {asked!r} (OFFLOAD_DEVICE) and runs on {got!r}"
        expected = torch.device("cuda") if got == "cuda" else torch.device("cpu")
        assert device.type == expected.type, f"layer {got} computes on {device}"
        assert shard_layers <= {layer_id}, "a shard is on another device layer than its engine's"


@pytest.fixture(params=simd.available_levels())
def simd_level(request, monkeypatch):
    """Runs a test once per SIMD kernel this CPU can execute, forced by env var."""
    monkeypatch.setenv(simd.ENV_VAR, request.param)
    return request.param


# The tests run tiny tensors; one intra-op thread keeps them fast and keeps
# OpenMP's spin-waiting from stalling when another process (a spawned rank,
# a benchmark) shares these two cores. Kernel thread counts are tested with
# explicit num_threads.
torch.set_num_threads(1)


@pytest.fixture(params=["auto", "torch"], ids=["sqrt-auto", "sqrt-split"])
def sqrt_mode(request, monkeypatch):
    """The square root as the probe picks it here, and the split update around
    torch.sqrt forced (the last resort, where no kernel sqrt is torch's): the Adam
    kernel tests' (tests/ops/test_adam_kernel.py, tests/optim/test_cpu_adam.py)."""
    from offload.ops import adam
    from tests.ops.adam_reference import SPLIT_BLOCK

    monkeypatch.setenv(adam.SQRT_ENV_VAR, request.param)
    monkeypatch.setattr(adam, "SPLIT_BLOCK", SPLIT_BLOCK)
    return request.param
