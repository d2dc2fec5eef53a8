import pytest

from offload import simd


@pytest.fixture(params=simd.available_levels())
def simd_level(request, monkeypatch):
    """Runs a test once per SIMD kernel this CPU can execute, forced by env var."""
    monkeypatch.setenv(simd.ENV_VAR, request.param)
    return request.param
