"""offload.ops.adam_step against torch.optim.Adam/AdamW, bit for bit.

Every test that exercises the kernel runs once per SIMD path this CPU has
(the simd_level fixture forces each with OFFLOAD_SIMD). Sizes straddle the
vector widths (8, 16), the thread split and the split update's blocks so
tails and chunk edges are hit.

The reference is torch's default CPU AdamW/Adam itself (single-tensor path),
compared with rtol=0, atol=0, on whatever CPU and MKL path this is: the
square root is chosen by probing torch.sqrt (Note [bitwise torch order],
csrc/adam/adam_kernels.h), so every level equals torch itself, and so does
the split update around torch.sqrt (the sqrt_mode fixture runs both). The
fused kernel with each sqrt it can compute is also checked, forced, against
torch with that same sqrt in place of torch's. tests/optim/test_cpu_adam.py runs
the comparison again in fresh interpreters under MKL's other code paths
(MKL_ENABLE_INSTRUCTIONS), where torch's sqrt is one no kernel computes in
registers.
"""
import struct
import threading

import numpy as np
import pytest
import torch

from offload import _native, simd
from offload.ops import adam, adam_step
from tests.ops.adam_reference import (HP, SPLIT_BLOCK, assert_bitwise, grads_for, mkl_in_torch, needs_native, run_ours,
                                   torch_reference)

SIZES = [1, 7, 15, 16, 17, 31, 33, SPLIT_BLOCK + 17, 1_000_003]
OPTIMIZERS = [(True, 0.01), (True, 0.0), (False, 0.0), (False, 0.1)]
_REFERENCES: dict = {}




def _cached_reference(n, adamw_mode, weight_decay, beta1, steps, sqrt=None):
    """torch's result, computed once per case and shared by the SIMD levels."""
    key = (n, adamw_mode, weight_decay, beta1, steps, sqrt)
    if key not in _REFERENCES:
        p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
        grads = grads_for(n, steps=steps)
        ref = torch_reference(p0, grads, adamw_mode=adamw_mode, weight_decay=weight_decay,
                               beta1=beta1, schedule=True, sqrt=sqrt)
        _REFERENCES[key] = (p0, grads, ref)
    return _REFERENCES[key]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw_mode,weight_decay", OPTIMIZERS,
                         ids=["adamw-wd", "adamw", "adam", "adam-l2"])
def test_bitwise_equal_to_torch(simd_level, sqrt_mode, n, adamw_mode, weight_decay):
    """50 steps (fewer for the large sizes), the lr changing every step."""
    steps = 50 if n < 1000 else 6
    p0, grads, ref = _cached_reference(n, adamw_mode, weight_decay, HP["beta1"], steps)
    ours = run_ours(p0, grads, adamw_mode=adamw_mode, weight_decay=weight_decay, schedule=True)
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("n", [17, 33])
def test_bitwise_lerp_with_a_large_weight(simd_level, sqrt_mode, n):
    """beta1 < 0.5: torch's lerp takes its other form, end - (end - self) * (1 - w)."""
    p0, grads, ref = _cached_reference(n, True, 0.01, 0.3, 50)
    ours = run_ours(p0, grads, adamw_mode=True, weight_decay=0.01, beta1=0.3, schedule=True)
    assert_bitwise(ours, ref)


def _level_sqrt_pairs():
    return [(level, source) for level in simd.available_levels() for source in adam.kernel_sqrts(level)]


@needs_native
@pytest.mark.parametrize("level,source", _level_sqrt_pairs())
@pytest.mark.parametrize("n", [1, 17, 33, 4099])
@pytest.mark.parametrize("adamw_mode,weight_decay", [(True, 0.01), (False, 0.1)], ids=["adamw-wd", "adam-l2"])
def test_each_fused_sqrt_equals_torch_with_that_sqrt(monkeypatch, level, source, n, adamw_mode,
                                                     weight_decay):
    """Every fused kernel, whichever sqrt the probe picks on this CPU: forced,
    it equals torch's update with the kernel's own sqrt in place of torch's."""
    monkeypatch.setenv(simd.ENV_VAR, level)
    monkeypatch.setenv(adam.SQRT_ENV_VAR, source)
    assert adam.sqrt_source() == source
    p0, grads, ref = _cached_reference(n, adamw_mode, weight_decay, HP["beta1"], 50, (source, level))
    ours = run_ours(p0, grads, adamw_mode=adamw_mode, weight_decay=weight_decay, schedule=True)
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 17, 4099])
def test_low_precision_grad_is_widened_exactly(simd_level, sqrt_mode, grad_dtype, n):
    p0 = torch.randn(n)
    grads = grads_for(n, dtype=grad_dtype)
    ref = torch_reference(p0, grads, adamw_mode=True, weight_decay=0.01)
    ours = run_ours(p0, grads, adamw_mode=True, weight_decay=0.01)
    assert_bitwise(ours, ref)


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 1023, 100_003])
def test_fused_out_equals_torch_rounding(simd_level, sqrt_mode, out_dtype, n):
    p0 = torch.randn(n) * 3
    out = torch.empty(n, dtype=out_dtype)
    grads = grads_for(n, steps=3)
    p, _, _ = run_ours(p0, grads, adamw_mode=True, weight_decay=0.01, out=out)
    assert torch.equal(_bits(out), _bits(p.to(out_dtype)))


def _f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


SPECIAL_BITS = [
    0x00000000, 0x80000000,            # +-0
    0x00000001, 0x807FFFFF, 0x00400000,  # fp32 denormals (bf16 keeps them)
    0x3F808000, 0x3F818000,            # bf16 ties: round to even down, then up
    0x3F808001, 0x3F807FFF,            # just above / below a bf16 tie
    0x7F7FFFFF, 0xFF7FFFFF,            # fp32 max: rounds to bf16 inf
    0x477FF000, 0x477FEFFF,            # fp16 overflow boundary (65520 rounds to inf)
    0x33000000, 0x33000001,            # fp16 smallest-denormal tie
    0x7F800000, 0xFF800000,            # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF,  # NaNs, signalling and payloads
]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 5, 16])
def test_fused_out_special_values_bit_exact(simd_level, out_dtype, offset):
    """lr=0 and a zero gradient leave the master as is; out must be its rounding."""
    values = torch.tensor([_f32(b) for b in SPECIAL_BITS], dtype=torch.float32)
    # Placed at an offset so special values land in vector bodies and tails.
    master = torch.cat([torch.ones(offset), values, torch.ones(3)])
    n = master.numel()
    out = torch.empty(n, dtype=out_dtype)
    m, v = torch.zeros(n), torch.zeros(n)
    adam_step(master, torch.zeros(n), m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999,
              eps=1e-8, weight_decay=0.0, out=out)
    expected = master.to(out_dtype)
    mismatch = (_bits(out) != _bits(expected)).nonzero().flatten().tolist()
    assert not mismatch, [
        (hex(struct.unpack("<I", struct.pack("<f", master[i].item()))[0]),
         hex(_bits(out)[i].item() & 0xFFFF), hex(_bits(expected)[i].item() & 0xFFFF))
        for i in mismatch
    ]


@pytest.mark.parametrize("n", [5, 40])
def test_nan_and_inf_gradients_propagate_as_in_torch(simd_level, sqrt_mode, n):
    p0 = torch.randn(n)
    grads = grads_for(n, steps=4)
    grads[1][0] = float("nan")
    grads[2][n - 1] = float("inf")
    grads[3][n // 2] = -float("inf")
    ref = torch_reference(p0, grads, adamw_mode=True, weight_decay=0.1)
    ours = run_ours(p0, grads, adamw_mode=True, weight_decay=0.1)
    assert_bitwise(ours, ref, equal_nan=True)
    assert ours[0].isnan().sum() >= 3  # the poisoned elements really are NaN


def _across_the_fast_path_boundary():
    scales = torch.logspace(-60, 15, 48, base=10.0)  # g^2 * (1 - beta2) spans ~1e-123 .. 1e27
    row = torch.cat([scales, torch.zeros(8), torch.full((8,), 2.0 ** -48.5)])
    grads = []
    for step in range(4):
        g = row[torch.randperm(row.numel(), generator=torch.Generator().manual_seed(step))]
        grads.append(torch.cat([g, torch.ones(64) * (step + 1) * 1e-3]))  # and all-normal vectors
    return torch.randn(grads[0].numel()), grads


def test_second_moment_over_its_whole_range_bit_exact(simd_level, sqrt_mode):
    """v from 0 through subnormal, tiny and huge, mixed within a vector and
    alone in others, equals torch on the path the probe picks and the split."""
    p0, grads = _across_the_fast_path_boundary()
    ref = torch_reference(p0, grads, adamw_mode=True, weight_decay=0.1)
    ours = run_ours(p0, grads, adamw_mode=True, weight_decay=0.1)
    assert_bitwise(ours, ref)
    v = ours[2]
    assert (v == 0).any() and ((v > 0) & (v < 2.0 ** -100)).any() and (v > 2.0 ** -100).any()


@needs_native
@pytest.mark.skipif("avx512" not in simd.available_levels(), reason="no AVX-512 on this CPU")
def test_mkl_avx512_shortcut_equals_its_general_sequence(monkeypatch):
    """The AVX-512 kernel's MKL sqrt takes a shorter sequence for vectors whose
    v lies in [2^-100, inf) and the general one otherwise (denom_as_torch); the
    reference's sqrt is the general one alone (sqrt_as_torch), on any CPU."""
    monkeypatch.setenv(simd.ENV_VAR, "avx512")
    monkeypatch.setenv(adam.SQRT_ENV_VAR, "mkl-avx512")
    p0, grads = _across_the_fast_path_boundary()
    ref = torch_reference(p0, grads, adamw_mode=True, weight_decay=0.1, sqrt=("mkl-avx512", "avx512"))
    assert_bitwise(run_ours(p0, grads, adamw_mode=True, weight_decay=0.1), ref)


@pytest.mark.parametrize("n", [1, 33, 70_001])
def test_without_bias_correction_matches_closed_form(simd_level, n):
    p0 = torch.randn(n, dtype=torch.float64)
    grads = grads_for(n, steps=5)
    p, m, v = p0.clone(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for g in grads:
        g = g.double()
        p = p * (1 - HP["lr"] * 0.05)
        m = HP["beta1"] * m + (1 - HP["beta1"]) * g
        v = HP["beta2"] * v + (1 - HP["beta2"]) * g * g
        p = p - HP["lr"] * m / (v.sqrt() + HP["eps"])
    ours = run_ours(p0.float(), grads, adamw_mode=True, weight_decay=0.05, bias_correction=False)
    torch.testing.assert_close(ours[0], p.float())
    torch.testing.assert_close(ours[1], m.float())
    torch.testing.assert_close(ours[2], v.float())


@pytest.mark.parametrize("level", [lvl for lvl in simd.available_levels() if lvl != "scalar"])
@pytest.mark.parametrize("source", ["ieee", "torch"], ids=["fused-ieee", "split"])
def test_simd_kernel_agrees_with_scalar_reference(level, source, monkeypatch):
    """The same pass with the same sqrt: bit for bit, the bf16 copy included."""
    monkeypatch.setenv(adam.SQRT_ENV_VAR, source)
    n = 100_003
    p0 = torch.randn(n)
    grads = grads_for(n, steps=5, dtype=torch.bfloat16)
    out_s, out_v = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    monkeypatch.setenv(simd.ENV_VAR, "scalar")
    scalar = run_ours(p0, grads, adamw_mode=True, weight_decay=0.1, out=out_s)
    monkeypatch.setenv(simd.ENV_VAR, level)
    vector = run_ours(p0, grads, adamw_mode=True, weight_decay=0.1, out=out_v)
    assert_bitwise(vector, scalar)
    assert torch.equal(_bits(out_v), _bits(out_s))


def test_thread_count_does_not_change_results(simd_level, sqrt_mode):
    n = 1_000_003
    p0 = torch.randn(n)
    grads = grads_for(n, steps=3)
    results = [run_ours(p0, grads, adamw_mode=True, weight_decay=0.1, num_threads=t)
               for t in (1, 2, 3, 7)]
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            assert torch.equal(a, b)


def test_concurrent_callers_each_get_correct_results():
    """Two Python threads share the native pool; neither may corrupt the other."""
    n = 300_017
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    grads = [grads_for(n, steps=5, seed=s) for s in (0, 1)]
    expected = [run_ours(p, g, adamw_mode=True, weight_decay=0.1) for p, g in zip(inputs, grads)]
    results = [None, None]

    def work(i):
        results[i] = run_ours(inputs[i], grads[i], adamw_mode=True, weight_decay=0.1)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 33, 1031])
@pytest.mark.parametrize("adamw_mode,weight_decay", OPTIMIZERS,
                         ids=["adamw-wd", "adamw", "adam", "adam-l2"])
def test_pure_pytorch_fallback_matches_torch(monkeypatch, n, adamw_mode, weight_decay):
    """torch's own ops in torch's order: bit for bit whatever this CPU's sqrt."""
    monkeypatch.setattr(_native, "native", None)
    monkeypatch.setattr(_native, "_warned", set())
    p0 = torch.randn(n)
    grads = grads_for(n, steps=50)
    out = torch.empty(n, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="pure-PyTorch fallback"):
        ours = run_ours(p0, grads, adamw_mode=adamw_mode, weight_decay=weight_decay, out=out,
                         schedule=True)
    ref = torch_reference(p0, grads, adamw_mode=adamw_mode, weight_decay=weight_decay,
                           schedule=True)
    assert_bitwise(ours, ref)
    assert torch.equal(out, ours[0].to(torch.bfloat16))


@pytest.mark.parametrize("num_threads", [1, 3])
def test_empty_tensors_are_a_no_op(simd_level, sqrt_mode, num_threads):
    """Zero elements: no error on any path or thread split, and no byte written
    (each tensor is an empty view inside a larger one whose values are checked)."""
    bufs = [torch.full((16,), 7.0) for _ in range(4)]
    out_buf = torch.full((16,), 7.0, dtype=torch.bfloat16)
    master, grad, m, v = (b[5:5] for b in bufs)
    adam_step(master, grad, m, v, step=1, weight_decay=0.1, out=out_buf[5:5], num_threads=num_threads, **HP)
    for b in bufs + [out_buf]:
        assert torch.equal(b, torch.full_like(b, 7.0))


# ---- bad input: each names the argument and what was expected ------------

def _args(n=8):
    return [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)]


def _call(args, **overrides):
    kw = dict(step=1, weight_decay=0.0, **HP)
    kw.update(overrides)
    adam_step(*args, **kw)


@pytest.mark.parametrize("index,name", [(0, "master"), (1, "grad"), (2, "exp_avg"), (3, "exp_avg_sq")])
def test_rejects_non_tensor(index, name):
    args = _args()
    args[index] = [0.0] * 8
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
        _call(args)


@pytest.mark.parametrize("index,name,dtype", [
    (0, "master", torch.float16), (1, "grad", torch.float64), (1, "grad", torch.int32),
    (2, "exp_avg", torch.bfloat16), (3, "exp_avg_sq", torch.float64),
])
def test_rejects_wrong_dtype(index, name, dtype):
    args = _args()
    args[index] = args[index].to(dtype)
    with pytest.raises(TypeError, match=f"{name} must have dtype .*got {str(dtype)[6:]}"):
        _call(args)


def test_rejects_non_cpu_tensor():
    args = _args()
    args[1] = torch.zeros(8, device="meta")
    with pytest.raises(ValueError, match="grad must be a CPU tensor, got device meta"):
        _call(args)


def test_rejects_non_contiguous():
    args = _args()
    args[2] = torch.zeros(16)[::2]
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        _call(args)


def test_rejects_size_mismatch():
    args = _args()
    args[3] = torch.zeros(9)
    with pytest.raises(ValueError, match="exp_avg_sq has 9 elements but master has 8"):
        _call(args)


def test_rejects_bad_out():
    with pytest.raises(TypeError, match="out must have dtype bfloat16 or float16, got float32"):
        _call(_args(), out=torch.zeros(8))
    with pytest.raises(ValueError, match="out has 7 elements"):
        _call(_args(), out=torch.zeros(7, dtype=torch.bfloat16))


@pytest.mark.parametrize("overrides,pattern", [
    (dict(step=0), "step must be an int >= 1"),
    (dict(step=1.5), "step must be an int >= 1"),
    (dict(lr=-1.0), r"lr must be in \[0.0, inf\)"),
    (dict(lr=float("nan")), "lr must be in"),
    (dict(beta1=1.0), r"beta1 must be in \[0.0, 1.0\)"),
    (dict(beta2=-0.1), "beta2 must be in"),
    (dict(eps=-1e-8), "eps must be in"),
    (dict(weight_decay=-0.1), "weight_decay must be in"),
    (dict(lr="0.1"), "lr must be a real number, got str"),
])
def test_rejects_bad_hyperparameters(overrides, pattern):
    args = _args()
    before = [a.clone() for a in args]
    with pytest.raises((ValueError, TypeError), match=pattern):
        _call(args, **overrides)
    for a, b in zip(args, before):  # nothing was touched
        assert torch.equal(a, b)


def test_bad_simd_override_is_an_error(monkeypatch):
    monkeypatch.setenv(simd.ENV_VAR, "sse9")
    with pytest.raises(ValueError, match="OFFLOAD_SIMD='sse9' is not a SIMD level"):
        _call(_args())


def test_simd_override_above_the_cpu_is_an_error(monkeypatch):
    monkeypatch.setattr(simd, "detected_level", lambda: "avx2")
    monkeypatch.setenv(simd.ENV_VAR, "avx512")
    with pytest.raises(ValueError, match="supports at most 'avx2'"):
        _call(_args())


def test_num_threads_must_be_positive():
    with pytest.raises(ValueError, match="num_threads must be a positive int"):
        _call(_args(), num_threads=0)


@needs_native
def test_native_kernel_refuses_unknown_names():
    update = _native.native.adam.update
    args = [0, 0, "float32", 0, 0, 0, "", 0, 1.0, 1.0, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.0, True,
            False, "scalar", 1, "fused", "ieee", 0]
    for index, bad, pattern in [(18, "avx1024", "unknown SIMD level 'avx1024'"),
                                (2, "int8", "unsupported element type 'int8'"),
                                (20, "twice", "unknown Adam pass 'twice'"),
                                (21, "mkl-sse4", "unknown square root 'mkl-sse4'")]:
        with pytest.raises(ValueError, match=pattern):
            update(*args[:index], bad, *args[index + 1:])
    for sqrt in ("mkl-avx512", "mkl-avx2", "mkl-sse"):
        with pytest.raises(ValueError, match=f"the scalar kernel cannot compute the {sqrt} square root"):
            update(*args[:21], sqrt, 0)
    with pytest.raises(ValueError, match="unknown square root 'torch'"):  # torch's is Python's to call
        update(*args[:21], "torch", 0)
    with pytest.raises(ValueError, match="apply pass needs root"):
        update(*args[:7], 8, *args[8:20], "apply", "ieee", 0)


# ---- the square root: which one, and why (Note [bitwise torch order]) -----

@needs_native
@pytest.mark.parametrize("level", simd.available_levels())
def test_sqrt_source_is_a_kernel_sqrt_only_where_it_equals_torch(monkeypatch, level):
    """auto picks a kernel sqrt exactly when it equals torch.sqrt on every probe
    input, else the split update; an IEEE pick is checked against numpy's sqrt
    too, so the verdict does not rest on the kernel alone."""
    monkeypatch.delenv(adam.SQRT_ENV_VAR, raising=False)
    monkeypatch.setenv(simd.ENV_VAR, level)
    source = adam.sqrt_source()
    mismatches = {s: adam.probe_mismatches(s, level) for s in adam.kernel_sqrts(level)}
    matching = [s for s, count in mismatches.items() if count == 0]  # fastest first
    assert source == (matching[0] if matching else "torch"), mismatches
    x = adam.probe_inputs()
    torch_is_ieee = torch.equal(x.sqrt(), torch.from_numpy(np.sqrt(x.numpy())))
    assert (mismatches["ieee"] == 0) == torch_is_ieee
    assert source in adam.describe_sqrt_source()


def test_probe_spans_every_binade_and_the_edges():
    x = adam.probe_inputs()
    bits = x.view(torch.int32)
    assert (bits >= 0).all() and x.numel() > 2_000_000
    assert torch.equal(torch.unique(bits >> 23), torch.arange(256, dtype=torch.int32))
    for value in (0.0, float("inf"), 2.0 ** -149, 2.0 ** -126, torch.finfo(torch.float32).max):
        assert (x == value).any(), value


@pytest.mark.slow
@pytest.mark.parametrize("t", [25, 26])
def test_hard_significands_are_the_nearest_to_a_midpoint(t):
    """Hensel's shortcut finds what a search over every significand finds."""
    count = 4096
    x = torch.arange(1 << 23, 1 << 24, dtype=torch.int64)
    target = x << t
    root = torch.from_numpy(np.floor(np.sqrt(target.double().numpy())).astype(np.int64))
    odd_below = root - (root + 1) % 2  # the odd midpoints either side of the root
    distance = torch.minimum((target - odd_below ** 2).abs(), (target - (odd_below + 2) ** 2).abs())
    worst_kept = distance.topk(count, largest=False).values.max()
    ours = adam._hard_significands(t, count)
    assert ours.unique().numel() == count
    assert distance[ours - (1 << 23)].max() == worst_kept
    assert set((distance < worst_kept).nonzero().flatten().add(1 << 23).tolist()) <= set(ours.tolist())


def test_sqrt_override_is_validated(monkeypatch):
    monkeypatch.setenv(adam.SQRT_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="OFFLOAD_ADAM_SQRT='fast' is not a square-root source; "
                                         "expected one of auto, ieee, mkl-avx512, mkl-avx2, mkl-sse, mkl-vml, torch"):
        _call(_args())
    assert "error: OFFLOAD_ADAM_SQRT='fast'" in adam.describe_sqrt_source()
    monkeypatch.setenv(adam.SQRT_ENV_VAR, " Torch ")
    assert adam.sqrt_source() == "torch"
    assert adam.describe_sqrt_source() == "torch (OFFLOAD_ADAM_SQRT=torch)"


@needs_native
def test_mkl_sqrt_override_needs_the_avx512_kernel(monkeypatch):
    monkeypatch.setenv(simd.ENV_VAR, "scalar")
    monkeypatch.setenv(adam.SQRT_ENV_VAR, "mkl-avx512")
    args = _args()
    with pytest.raises(ValueError, match="OFFLOAD_ADAM_SQRT='mkl-avx512' needs the avx512 kernel; "
                                         "the SIMD level in use is 'scalar'"):
        _call(args)


@needs_native
def test_mkl_vml_sqrt_is_torchs_own_where_torch_has_mkl():
    """Where this torch exports MKL's vsSqrt, the kernels bind it at every
    level, and it is torch.sqrt on every probe input whatever MKL's path."""
    if not mkl_in_torch():
        pytest.skip("this torch has no MKL")
    for level in simd.available_levels():
        assert "mkl-vml" in adam.kernel_sqrts(level)
        assert adam.probe_mismatches("mkl-vml", level) == 0


def test_detected_level_is_reported(monkeypatch):
    """The levels that can be forced run from scalar up to the detected one, and
    with no override (or 'auto') the kernels use the detected one."""
    detected = simd.detected_level()
    assert detected in simd.LEVELS
    assert simd.available_levels() == list(simd.LEVELS[: simd.LEVELS.index(detected) + 1])
    assert simd.available_levels()[0] == "scalar"
    monkeypatch.delenv(simd.ENV_VAR, raising=False)
    assert simd.selected_level() == detected
    monkeypatch.setenv(simd.ENV_VAR, " Auto ")
    assert simd.selected_level() == detected


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 15, 4096, 4097, SPLIT_BLOCK + 17, 1_000_003])
def test_the_sum_of_grad_squares_comes_with_the_update_and_changes_none_of_it(simd_level, sqrt_mode,
                                                                            grad_dtype, n):
    """sum_grad_squares (Note [global gradient norm]): the kernel's sum of the
    gradient's squares equals torch's to fp32 rounding, on every level, sqrt path
    and thread count; the update itself stays bit for bit what it is without it."""
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
    expected = float(torch.linalg.vector_norm(grad.float(), dtype=torch.float64)) ** 2
    plain, summed = [], []
    for threads in (1, 3):
        for record, want in ((plain, False), (summed, True)):
            state = [p0.clone(), torch.zeros(n), torch.zeros(n)]
            out = torch.empty(n, dtype=torch.bfloat16)
            got = adam_step(*state[:1], grad, *state[1:], step=3, lr=1e-3, beta1=0.9, beta2=0.999,
                            eps=1e-8, weight_decay=0.1, out=out, num_threads=threads,
                            sum_grad_squares=want)
            if want:
                assert got == pytest.approx(expected, rel=1e-5)
            else:
                assert got is None
            record.append(state + [out])
    for a, b in zip(plain, summed):
        for x, y in zip(a, b):
            assert torch.equal(_bits(x), _bits(y))


def test_the_sum_of_grad_squares_without_the_extension(monkeypatch):
    monkeypatch.setattr(_native, "native", None)
    monkeypatch.setattr(_native, "_warned", set())
    grad = torch.randn(1031)
    with pytest.warns(RuntimeWarning, match="pure-PyTorch fallback"):
        got = adam_step(torch.randn(1031), grad, torch.zeros(1031), torch.zeros(1031), step=1, lr=1e-3,
                        beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, sum_grad_squares=True)
    assert got == pytest.approx(float(grad.double().square().sum()), rel=1e-5)


def test_the_report_says_which_adamw_the_host_update_equals(monkeypatch):
    """Note [which AdamW the host update equals]: torch's on this CPU, bit for bit, with
    the square root chosen by the probe (or torch's own); CUDA's to fp32 rounding. A
    forced kernel square root is bit for bit only where it equals torch.sqrt, said so."""
    from offload.report import collect

    monkeypatch.delenv(adam.SQRT_ENV_VAR, raising=False)
    line = collect()["adam_equals"]
    assert line.startswith("torch.optim.AdamW on this CPU, bit for bit; CUDA's AdamW to fp32 rounding"), line
    monkeypatch.setenv(adam.SQRT_ENV_VAR, "ieee")
    assert "where the ieee square root (OFFLOAD_ADAM_SQRT) equals torch.sqrt" in adam.describe_reference()
    monkeypatch.setenv(adam.SQRT_ENV_VAR, "torch")
    assert adam.describe_reference().startswith("torch.optim.AdamW on this CPU, bit for bit")


@pytest.mark.parametrize("n", [65_536 * 3 + 17, 1_000_003])
def test_the_sum_of_grad_squares_is_the_same_value_on_any_number_of_threads(simd_level, n):
    """Note [chunks taken in turn]: chunks of fixed bounds, taken by whichever thread
    is free, their sums added in chunk order: bit for bit the same norm term on 1, 2, 3
    and 8 threads, and the same update."""
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * 3
    sums, states = [], []
    for threads in (1, 2, 3, 8):
        state = [p0.clone(), torch.zeros(n), torch.zeros(n)]
        sums.append(adam_step(state[0], grad, state[1], state[2], step=2, lr=1e-3, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.1, num_threads=threads, sum_grad_squares=True))
        states.append(state)
    assert len(set(sums)) == 1, sums
    for state in states[1:]:
        for x, y in zip(states[0], state):
            assert torch.equal(_bits(x), _bits(y))
