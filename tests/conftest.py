import pytest

from offload import simd


@pytest.fixture(params=simd.available_levels())
def simd_level(request, monkeypatch):
    """Runs a test once per SIMD kernel this CPU can execute, forced by env var."""
    monkeypatch.setenv(simd.ENV_VAR, request.param)
    return request.param


import torch  # noqa: E402

# The tests run tiny tensors; one intra-op thread keeps them fast and keeps
# OpenMP's spin-waiting from stalling when another process (a spawned rank,
# a benchmark) shares these two cores. Kernel thread counts are tested with
# explicit num_threads.
torch.set_num_threads(1)
