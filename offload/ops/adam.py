"""`adam_step`: the fused CPU Adam/AdamW update used by the offload optimizer.

One call updates fp32 master weights and moments in place from a fp32, bf16 or
fp16 gradient and, optionally, writes the updated weights rounded to bf16 or
fp16 into `out` in the same pass (what an offload step must send back to the
device). Arguments are checked here, so the native kernel (csrc/adam/) only
ever sees valid contiguous CPU buffers of matching sizes.
"""
from __future__ import annotations

import math
import numbers

import torch

from offload import _native, simd

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
) -> None:
    """One Adam (adamw_mode=False) or AdamW update, in place.

    master, exp_avg, exp_avg_sq: fp32 CPU contiguous, same number of elements.
    grad: fp32, bf16 or fp16, same number of elements (shapes may differ).
    step: the step number after this update (1 for the first), as in torch.
    out: optional bf16/fp16 tensor that receives the updated master, rounded to
    nearest even; equal bit for bit to master.to(out.dtype).
    num_threads: kernel threads (default torch.get_num_threads()).
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
        return

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
        _adam_step_torch(master, grad, exp_avg, exp_avg_sq, beta1, beta2, eps, step_size,
                         bias2_sqrt, weight_decay, decay, adamw_mode, out)
        return
    _native.native.adam.update(
        master.data_ptr(), grad.data_ptr(), _DTYPE_NAMES[grad.dtype],
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if out is None else out.data_ptr(), _DTYPE_NAMES[out.dtype] if out is not None else "",
        n, -step_size, bias2_sqrt, beta1, beta2, 1 - beta1, 1 - beta2, eps, decay,
        bool(adamw_mode), weight_decay != 0, simd.selected_level(), threads,
    )


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
