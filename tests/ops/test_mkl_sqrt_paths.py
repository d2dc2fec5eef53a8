"""MKL's square roots, path by path (Note [MKL's square roots] in
csrc/adam/adam_mkl_sqrt.h): torch.sqrt under MKL_ENABLE_INSTRUCTIONS=AVX2 and
SSE4_2 (fresh processes: MKL reads it once) equals the kernels' mkl-avx2 and
mkl-sse square roots on every probe input, and the probe picks them, in the
AVX2 and the AVX-512 kernel; an AMD EPYC's torch.sqrt (2.15M inputs in
../shared/data) is the SSE4.2 sequence seeded by AMD's RSQRTPS."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from offload import simd
from offload.ops import adam

needs_native = pytest.mark.skipif(adam._native.native is None, reason="the native extension is not built")
AMD_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "torch-sqrt-amd-epyc-zen5.npz"
AMD_SEEDS = Path(__file__).with_name("data") / "amd_epyc_zen5_rsqrtps_table.npy"

_PROBE = """
import json
from offload import simd
from offload.ops import adam
levels = [l for l in ("avx2", "avx512") if l in simd.available_levels()]
print(json.dumps({l: {"mismatches": {s: adam.probe_mismatches(s, l) for s in adam.kernel_sqrts(l)},
                      "chosen": adam.sqrt_source(l)} for l in levels}))
"""


@needs_native
@pytest.mark.skipif("avx2" not in simd.available_levels(), reason="the MKL sequences need the avx2 kernel")
@pytest.mark.parametrize("mkl_path", ["AVX2", "SSE4_2"])
def test_each_mkl_path_is_a_kernel_square_root_and_the_probe_picks_it(mkl_path):
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": mkl_path}
    env.pop(adam.SQRT_ENV_VAR, None)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for level, seen in json.loads(out.stdout.strip().splitlines()[-1]).items():
        # torch's root is one of the kernel's: the path's own, or (where MKL declines the
        # path on this CPU: AVX2 on an AMD EPYC runs MKL's SSE4.2 sequence) another of MKL's.
        # (mkl-vml, MKL's own vsSqrt per block, computes the same roots and may match too.)
        matching = [s for s, count in seen["mismatches"].items() if count == 0]
        assert seen["chosen"] in matching and seen["chosen"] in mkl_sources(mkl_path), (level, seen)
        assert seen["mismatches"]["ieee"] > 0, (level, seen)  # the probe can tell them apart


def mkl_sources(mkl_path: str) -> tuple[str, ...]:
    """The kernel square roots torch.sqrt may equal under MKL_ENABLE_INSTRUCTIONS=mkl_path:
    the path's own, and below AVX2 only SSE4.2's. MKL picks its path from the CPU as well as
    the variable: on an AMD EPYC (AVX2, no AVX-512 in its VM) it ran the SSE4.2 sequence
    under AVX2 (694,736 probe inputs differed from the AVX2 sequence, none from SSE4.2's),
    so which one a CPU gets is asked of MKL (the probe), never assumed from the vendor."""
    return ("mkl-avx2", "mkl-sse") if mkl_path == "AVX2" else ("mkl-sse",)


def _sse_sequence(x: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """MKL's SSE4.2 steps in float32, each product and sum rounded on its own."""
    f = np.float32
    half = f(0.5)
    s = x * seed
    h = seed * half
    e = half - s * h
    s1 = s * e + s
    h1 = e * h + h
    return (x - s1 * s1) * h1 + s1


def _amd_seed(x: np.ndarray) -> np.ndarray:
    """AMD Zen 5's RSQRTPS of positive normal x: a table by the exponent's parity
    and the top 12 mantissa bits, scaled by the exponent (rebuilt from the data file)."""
    table = np.load(AMD_SEEDS).astype(np.float32)
    u = x.view(np.uint32)
    e = ((u >> 23) & 0xFF).astype(np.int64) - 127
    parity = e & 1
    k = (e - parity) // 2
    entry = table[parity, (u >> 11) & 0xFFF].view(np.uint32).astype(np.int64)
    return (entry - k * (1 << 23)).astype(np.uint32).view(np.float32)


@pytest.mark.skipif(not AMD_DATA.exists(), reason=f"{AMD_DATA.name}, torch.sqrt measured on an AMD EPYC (Zen 5), "
                    "is shared data beside the checkout (../shared/data), not part of a clone; its seed table "
                    "is Zen 5's, so another CPU's torch.sqrt cannot stand in for it")
def test_an_amd_epycs_torch_sqrt_is_the_sse_sequence_with_its_seed():
    data = np.load(AMD_DATA)
    x = data["inputs"].view(np.float32)
    correct = np.sqrt(x.astype(np.float64)).astype(np.float32)  # correctly rounded for float32 inputs
    bits = data["inputs"].astype(np.int64)
    vector = ((bits + 0x7F800000) & 0xFFFFFFFF).astype(np.uint32).view(np.int32) <= np.int32(-0x1001000)
    with np.errstate(all="ignore"):
        got = correct.copy()
        got[vector] = _sse_sequence(x[vector], _amd_seed(x[vector]))
    diff = got.view(np.int32).astype(np.int64) - correct.view(np.int32).astype(np.int64)
    np.testing.assert_array_equal(diff, data["diff_ulps"].astype(np.int64))
    assert 0.16 < float((diff != 0).mean()) < 0.18  # the 16.7% the file describes


_UPDATE = """
import json, os, torch
from offload import simd
from offload.ops import adam
from tests.ops.adam_reference import grads_for, run_ours, torch_reference
results = {}
p0 = torch.randn(40_003, generator=torch.Generator().manual_seed(7))
grads = grads_for(40_003, steps=6, seed=3)
for level in [l for l in ("avx2", "avx512") if l in simd.available_levels()]:
    os.environ[simd.ENV_VAR] = level
    ref = torch_reference(p0, grads, adamw_mode=True, weight_decay=0.01)
    for threads in (1, 2):
        ours = run_ours(p0, grads, adamw_mode=True, weight_decay=0.01, num_threads=threads)
        results[f"{level}/{threads}"] = [adam.sqrt_source(level),
                                         sum(int((a != b).sum()) for a, b in zip(ours, ref))]
print(json.dumps(results))
"""


@needs_native
@pytest.mark.skipif("avx2" not in simd.available_levels(), reason="the MKL sequences need the avx2 kernel")
@pytest.mark.parametrize("mkl_path", ["AVX2", "SSE4_2"])
def test_the_whole_update_equals_torchs_adamw_under_each_mkl_path(mkl_path):
    """Every SIMD level that can compute the path's root, one thread and two: bit for bit."""
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": mkl_path}
    env.pop(adam.SQRT_ENV_VAR, None)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _UPDATE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results and all(chosen in mkl_sources(mkl_path) and differ == 0
                           for chosen, differ in results.values()), results
