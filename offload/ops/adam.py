"""`adam_step`: the fused CPU Adam/AdamW update used by the offload optimizer.

One call updates fp32 master weights and moments in place from a fp32, bf16 or
fp16 gradient and, optionally, writes the updated weights rounded to bf16 or
fp16 into `out` in the same pass (what an offload step must send back to the
device). Arguments are checked here, so the native kernel (csrc/adam/) only
ever sees valid contiguous CPU buffers of matching sizes.

The result equals torch.optim.Adam/AdamW bit for bit on any CPU: the square
root is the one op whose bits vary, and `sqrt_source()` decides once per
process, by probing torch.sqrt, which sqrt the fused kernel can take as
torch's here (IEEE, MKL's AVX-512 sequence, or MKL's vsSqrt called per block),
or that the update must be split around torch.sqrt itself (Note [bitwise
torch order], csrc/adam/adam_kernels.h).
"""
from __future__ import annotations

import functools
import math
import numbers
import os

import torch

from offload import _native, simd

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

SQRT_ENV_VAR = "OFFLOAD_ADAM_SQRT"
# What OFFLOAD_ADAM_SQRT accepts: auto (probe, the default), a kernel sqrt to
# force into the fused pass (exact only where it is torch's), or torch (the
# split update, exact everywhere).
SQRT_CHOICES = ("auto", "ieee", "mkl-avx512", "mkl-avx2", "mkl-sse", "mkl-vml", "torch")
# Elements per block of the split update (the last resort, for a torch whose
# sqrt is neither a kernel's nor MKL's vsSqrt): 4 MiB of scratch; smaller
# blocks pay a torch.sqrt launch (an OpenMP team) each, more than cache saves.
SPLIT_BLOCK = 1 << 20


def _check_tensor(name: str, t, dtypes: tuple[torch.dtype, ...], numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {expected}, got {str(t.dtype).replace('torch.', '')}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())})")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but master has {numel}")


def _check_scalar(name: str, value, low: float, high: float | None = None, *, low_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    bad_low = value <= low if low_open else value < low
    if math.isnan(value) or bad_low or (high is not None and value >= high):
        bound = f"({low}, " if low_open else f"[{low}, "
        bound += f"{high})" if high is not None else "inf)"
        raise ValueError(f"{name} must be in {bound}, got {value}")
    return value


def kernel_sqrts(level: str) -> tuple[str, ...]:
    """The square roots the fused kernel can compute at SIMD `level`, fastest
    first: in registers (IEEE; MKL's AVX-512, AVX2 and SSE4.2 sequences, Note
    [MKL's square roots] in csrc/adam/adam_mkl_sqrt.h), then MKL's vsSqrt
    called per block, where torch's MKL exports it."""
    in_registers = {"avx512": ("ieee", "mkl-avx512", "mkl-avx2", "mkl-sse"),
                    "avx2": ("ieee", "mkl-avx2", "mkl-sse")}.get(level, ("ieee",))
    return in_registers + (("mkl-vml",) if _vml_bound() else ())


@functools.lru_cache(maxsize=1)
def _vml_bound() -> bool:
    """Binds the native kernels to MKL's vsSqrt inside torch's own library
    (libtorch_cpu links MKL statically), if this torch has it."""
    if _native.native is None or not torch.backends.mkl.is_available():
        return False
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    return os.path.exists(library) and bool(_native.native.adam.bind_vml_sqrt(library))


def _requested_sqrt() -> str:
    raw = os.environ.get(SQRT_ENV_VAR, "auto")
    requested = raw.strip().lower() or "auto"
    if requested not in SQRT_CHOICES:
        raise ValueError(f"{SQRT_ENV_VAR}={raw!r} is not a square-root source; expected one of "
                         f"{', '.join(SQRT_CHOICES)}")
    return requested


def sqrt_source(level: str | None = None) -> str:
    """Which square root adam_step uses at SIMD `level` (default: the level in
    use): one the fused kernel computes ('ieee', 'mkl-avx512', 'mkl-avx2', 'mkl-sse',
    'mkl-vml'; the
    first of kernel_sqrts(level) that equals torch.sqrt on every probe input)
    or 'torch' (the update split around torch.sqrt; also the pure-PyTorch
    path). OFFLOAD_ADAM_SQRT overrides the probe; a forced kernel sqrt that is
    not torch's gives results within 1 ulp per sqrt of torch's, not equal."""
    requested = _requested_sqrt()
    level = simd.selected_level() if level is None else level
    if _native.native is None or requested == "torch":
        return "torch"
    if requested == "auto":
        return _probed_source(level)
    if requested not in kernel_sqrts(level):
        need = {"mkl-avx512": "the avx512 kernel", "mkl-avx2": "the avx2 or avx512 kernel",
                "mkl-sse": "the avx2 or avx512 kernel"}.get(
                    requested, "MKL's vsSqrt in torch's library, which this torch does not export")
        raise ValueError(f"{SQRT_ENV_VAR}={requested!r} needs {need}; the SIMD level in use is "
                         f"{level!r}, whose kernel computes {', '.join(kernel_sqrts(level))}")
    return requested


def describe_sqrt_source() -> str:
    """One line for `offload report`: the source in use and how it was chosen."""
    try:
        source, requested = sqrt_source(), _requested_sqrt()
    except ValueError as exc:
        return f"error: {exc}"
    if requested != "auto":
        return f"{source} ({SQRT_ENV_VAR}={requested})"
    if _native.native is None:
        return "torch (pure-PyTorch path)"
    how = "fused: equals torch.sqrt" if source != "torch" else "split: no kernel sqrt equals torch.sqrt"
    return f"{source} ({how} on all {PROBE_SIZE:,} probe inputs)"


def describe_reference() -> str:
    """One line for `offload report`: which AdamW the host update equals (Note [which
    AdamW the host update equals])."""
    requested = _requested_sqrt()
    here = "torch.optim.AdamW on this CPU, bit for bit"
    if requested not in ("auto", "torch"):
        here = (f"torch.optim.AdamW on this CPU where the {requested} square root ({SQRT_ENV_VAR}) "
                "equals torch.sqrt (adam_sqrt)")
    return here + "; CUDA's AdamW to fp32 rounding, not bit for bit (its own fma contractions)"


# Note [which AdamW the host update equals]
# On a machine with a GPU, a user may compare with plain torch there, whose
# AdamW runs on CUDA. The host update equals torch's AdamW on the host CPU,
# bit for bit (Note [bitwise torch order]: the same roundings, torch.sqrt's
# own square root), and CUDA's to fp32 rounding only: nvcc contracts that
# kernel's multiply-adds into fmas of its own choosing (by default, and not
# the same across its releases), and its square root is the IEEE one. Chosen
# on purpose: the host's torch is the only reference the host can equal on
# every machine and release, exactly, and checked by every test on the CPU;
# matching CUDA's would mean copying one nvcc release's contractions, and
# would still differ from its foreach kernel. What it costs on a GPU: losses
# and weights equal plain torch on the same GPU to fp32 rounding (the CUDA
# tests compare at that tolerance, `exact()` in tests/support/layer_under_test.py).
# `offload report` shows it (adam_equals).


def _probed_source(level: str) -> str:
    verdicts = _probe_verdicts(level)
    return next((source for source, count in verdicts.items() if count == 0), "torch")


@functools.lru_cache(maxsize=None)
def _hard_significands(t: int, count: int) -> torch.Tensor:
    """The `count` 24-bit significands X (2^23 <= X < 2^24) whose square root
    lies nearest a rounding midpoint, in increasing distance, for the binades
    whose biased exponent E has t's parity (t = 25 or 26): x = X * 2^(E - 150)
    has the root of X * 2^t scaled by a power of two, and sqrt(X * 2^t) lies
    in [2^24, 2^25), where the midpoints are the odd M; it is nearest one when
    r = M^2 - X * 2^t is small. A sqrt that rounds from too few bits fails on
    these first (Note [bitwise torch order]). Found from r, not by a search
    over M: M^2 = r (mod 2^t) for odd M needs r = 1 (mod 8) and then has four
    roots mod 2^t, +-a and +-a + 2^(t-1), each lifted bit by bit (Hensel)."""
    lo, hi = math.isqrt((1 << 23) << t), math.isqrt(((1 << 24) << t) - 1)
    radius = 8 * count  # about count / 4 usable M per 8 consecutive r; doubled below if short
    while True:
        r = torch.arange(-radius, radius + 1, dtype=torch.int64)
        r = r[torch.remainder(r, 8) == 1]
        a = torch.ones_like(r)
        for k in range(3, t):  # a^2 = r (mod 2^k) -> (mod 2^(k+1))
            a = a + (((a * a - r) >> k) & 1) * (1 << (k - 1))
        modulus = 1 << t
        roots = torch.stack([a, -a, a + modulus // 2, -a + modulus // 2]).remainder(modulus)
        mid = roots + torch.div(lo - roots + modulus - 1, modulus, rounding_mode="floor") * modulus
        x = (mid * mid - r) >> t
        ok = (mid <= hi) & (x >= 1 << 23) & (x < 1 << 24)
        x, dist = x[ok], r.expand_as(mid)[ok].abs()
        if x.numel() >= count:
            order = torch.sort(dist, stable=True).indices[:count]
            return x[order]
        radius *= 2


_PROBE_HARD, _PROBE_PER_BINADE = 4096, 8192
_PROBE_EDGES = (0, 1, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F800000)  # bit patterns
PROBE_SIZE = 255 * _PROBE_PER_BINADE + len(_PROBE_EDGES)


def _probe_chunks():
    """probe_inputs() one binade at a time (8192 inputs; the edges last), so the
    probe never holds more than a few hundred KB: a probe of 60 MB at once left
    that much in the process's heap (RSS) after it was freed."""
    gen = torch.Generator().manual_seed(0x5EED)
    for biased in range(255):
        fraction = _hard_significands(25 + (biased + 1) % 2, _PROBE_HARD) - (1 << 23)
        rand = torch.randint(0, 1 << 23, (_PROBE_PER_BINADE - _PROBE_HARD,), generator=gen,
                             dtype=torch.int64)
        yield ((biased << 23) | torch.cat([fraction, rand])).to(torch.int32).view(torch.float32)
    yield torch.tensor(_PROBE_EDGES, dtype=torch.int32).view(torch.float32)


def probe_inputs() -> torch.Tensor:
    """PROBE_SIZE (~2.1M) fp32 square-root inputs, the same in every process:
    per binade (subnormals through the largest finite) the 4096 hardest-to-
    round significands and 4096 random ones, then 0, +inf and the binade
    edges. Built when asked (~30 ms), not kept: 8 MB."""
    return torch.cat(list(_probe_chunks()))


@functools.lru_cache(maxsize=None)
def _probe_verdicts(level: str) -> dict[str, int]:
    """For each sqrt of kernel_sqrts(level), fastest first: on how many probe
    inputs it differs from torch.sqrt in this process. Once per process and
    level, binade by binade; only the counts are kept."""
    verdicts = dict.fromkeys(kernel_sqrts(level), 0)
    for x in _probe_chunks():
        want = x.sqrt().view(torch.int32)
        ours = torch.empty_like(x)
        for source in verdicts:
            _native.native.adam.sqrt(x.data_ptr(), ours.data_ptr(), x.numel(), source, level)
            verdicts[source] += int((ours.view(torch.int32) != want).sum())
    return verdicts


def probe_mismatches(source: str, level: str) -> int:
    """On how many probe inputs the kernel's `source` sqrt at `level` differs
    from torch.sqrt in this process (0: torch's sqrt, as far as the probe sees)."""
    return _probe_verdicts(level)[source]


def adam_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
    sum_grad_squares: bool = False,
) -> float | None:
    """One Adam (adamw_mode=False) or AdamW update, in place.

    master, exp_avg, exp_avg_sq: fp32 CPU contiguous, same number of elements.
    grad: fp32, bf16 or fp16, same number of elements (shapes may differ).
    step: the step number after this update (1 for the first), as in torch.
    out: optional bf16/fp16 tensor that receives the updated master, rounded to
    nearest even; equal bit for bit to master.to(out.dtype).
    num_threads: kernel threads (default torch.get_num_threads()).
    sum_grad_squares: also return the sum of grad's squares (a term of the global
    gradient norm), taken by the kernel as it reads the gradient: no second pass
    over it (Note [global gradient norm] in offload/step/grad_norm.py). Not
    bit for bit any torch reduction's: its summation order is the kernel's.
    """
    _check_tensor("master", master, (torch.float32,), None)
    n = master.numel()
    _check_tensor("grad", grad, GRAD_DTYPES, n)
    _check_tensor("exp_avg", exp_avg, (torch.float32,), n)
    _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if out is not None:
        _check_tensor("out", out, OUT_DTYPES, n)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step being taken), got {step!r}")
    lr = _check_scalar("lr", lr, 0.0)
    beta1 = _check_scalar("beta1", beta1, 0.0, 1.0)
    beta2 = _check_scalar("beta2", beta2, 0.0, 1.0)
    eps = _check_scalar("eps", eps, 0.0)
    weight_decay = _check_scalar("weight_decay", weight_decay, 0.0)
    threads = simd.num_threads(num_threads)
    if n == 0:
        return 0.0 if sum_grad_squares else None

    # Note [bitwise torch order] (csrc/adam/adam_kernels.h): the scalars
    # exactly as torch's _single_tensor_adam computes them, in double, with
    # the same expressions (`** 0.5`, not math.sqrt: pow and sqrt may differ
    # in the last bit); each is rounded to fp32 once, where it is used.
    bias1 = 1 - beta1**step if bias_correction else 1.0
    bias2 = 1 - beta2**step if bias_correction else 1.0
    step_size = lr / bias1
    bias2_sqrt = bias2**0.5
    decay = 1 - lr * weight_decay if adamw_mode else weight_decay

    if _native.native is None:
        _native.warn_fallback("CPU Adam")
        squares = None
        if sum_grad_squares:  # a second pass here: the torch path has no kernel to take it in
            squares = float(torch.linalg.vector_norm(grad.reshape(-1), dtype=torch.float32)) ** 2
        _adam_step_torch(master, grad, exp_avg, exp_avg_sq, beta1, beta2, eps, step_size,
                         bias2_sqrt, weight_decay, decay, adamw_mode, out)
        return squares
    level = simd.selected_level()
    source = sqrt_source(level)
    scalars = (-step_size, bias2_sqrt, beta1, beta2, 1 - beta1, 1 - beta2, eps, decay,
               bool(adamw_mode), weight_decay != 0, level, threads)
    if source != "torch":
        squares = _native_pass(master, grad, exp_avg, exp_avg_sq, out, 0, n, scalars, "fused", source,
                               sum_grad_squares=sum_grad_squares)
    else:
        squares = _adam_step_split(master, grad, exp_avg, exp_avg_sq, out, n, scalars, sum_grad_squares)
    return squares if sum_grad_squares else None


def _native_pass(master, grad, exp_avg, exp_avg_sq, out, begin, end, scalars, adam_pass, source,
                 root=None, sum_grad_squares=False) -> float:
    """One native pass over elements [begin, end) of the flat buffers; with
    sum_grad_squares, the sum of the gradient's squares there (else 0.0)."""
    out_ptr = 0 if out is None else out.data_ptr() + begin * out.element_size()
    return _native.native.adam.update(
        master.data_ptr() + 4 * begin, grad.data_ptr() + begin * grad.element_size(),
        _DTYPE_NAMES[grad.dtype], exp_avg.data_ptr() + 4 * begin,
        exp_avg_sq.data_ptr() + 4 * begin, out_ptr,
        _DTYPE_NAMES[out.dtype] if out is not None else "", end - begin, *scalars,
        adam_pass, source, 0 if root is None else root.data_ptr(), sum_grad_squares,
    )


def _adam_step_split(master, grad, exp_avg, exp_avg_sq, out, n, scalars, sum_grad_squares=False) -> float:
    """The update split around torch's own sqrt, where no kernel sqrt is
    torch's (Note [bitwise torch order], rule 4): per block, the moments pass,
    torch.sqrt(v) into a scratch block, then the apply pass. Every op is
    torch's own or one the kernels reproduce, so it is exact anywhere."""
    v_flat = exp_avg_sq.view(-1)
    scratch = torch.empty(min(n, SPLIT_BLOCK), dtype=torch.float32)
    squares = 0.0
    for begin in range(0, n, SPLIT_BLOCK):
        end = min(begin + SPLIT_BLOCK, n)
        squares += _native_pass(master, grad, exp_avg, exp_avg_sq, out, begin, end, scalars, "moments",
                                "ieee", sum_grad_squares=sum_grad_squares)
        root = scratch[: end - begin]
        torch.sqrt(v_flat[begin:end], out=root)
        _native_pass(master, grad, exp_avg, exp_avg_sq, out, begin, end, scalars, "apply", "ieee",
                     root)
    return squares


@torch.no_grad()
def _adam_step_torch(master, grad, exp_avg, exp_avg_sq, beta1, beta2, eps, step_size,
                     bias2_sqrt, weight_decay, decay, adamw_mode, out) -> None:
    """Pure-PyTorch path for hosts without the extension: torch's own ops in
    _single_tensor_adam's order, so it equals torch bit for bit as the kernel does."""
    master, exp_avg, exp_avg_sq = master.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g = grad.reshape(-1).float()
    if weight_decay != 0:
        if adamw_mode:
            master.mul_(decay)
        else:
            g = g.add(master, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
    if out is not None:
        out.view(-1).copy_(master)


def fused_torch_adam(master, grad, m, v, step: int, group: dict) -> None:
    """torch's fused kernel, for state that lives on a CUDA device."""
    beta1, beta2 = group["betas"]
    # torch.full is a fill kernel on the stream; torch.tensor(step, device=...) would
    # copy from pageable memory and wait for the stream: with one update per shard,
    # the host waited for the GPU before each (0.94B in bf16 on an H200: 55 ms a
    # step of updates, where the GPU's own work is under 10).
    step_t = torch.full((), float(step), dtype=torch.float32, device=master.device)
    fn = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
    fn([master], [grad], [m], [v], [], [step_t], lr=group["lr"], beta1=beta1, beta2=beta2,
       weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)
