"""The reference the Adam kernel tests compare with: torch's own AdamW/Adam on the CPU
(single-tensor path), the kernel run the same way, and the inputs both get."""
import contextlib
import platform

import pytest
import torch

from offload import _native
from offload.ops import adam_step

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
needs_native = pytest.mark.skipif(_native.native is None, reason="native extension not built")


@contextlib.contextmanager
def torch_sqrt_replaced_by(source: str, level: str):
    """torch.optim's own update with Tensor.sqrt replaced by the kernel's
    `source` sqrt at `level`: the reference for a forced fused source."""
    def kernel_sqrt(t):
        t = t.contiguous()
        out = torch.empty_like(t)
        _native.native.adam.sqrt(t.data_ptr(), out.data_ptr(), t.numel(), source, level)
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.Tensor, "sqrt", kernel_sqrt)
    try:
        yield
    finally:
        mp.undo()


def lr_at(step, lr):
    """A schedule: the lr changes every step, decaying then jumping back."""
    return lr * (0.93 ** (step % 20))


def torch_reference(p0, grads, *, adamw_mode, weight_decay, lr=HP["lr"], beta1=HP["beta1"],
                     schedule=False, sqrt=None):
    """torch's result; `sqrt` = (source, level) puts that kernel sqrt in place of torch's."""
    p = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    # Default arguments: foreach=None picks the single-tensor path for CPU tensors.
    opt = cls([p], lr=lr, betas=(beta1, HP["beta2"]), eps=HP["eps"], weight_decay=weight_decay)
    with (contextlib.nullcontext() if sqrt is None else torch_sqrt_replaced_by(*sqrt)):
        for step, g in enumerate(grads, start=1):
            if schedule:
                opt.param_groups[0]["lr"] = lr_at(step, lr)
            p.grad = g.float().clone()
            opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def run_ours(p0, grads, *, adamw_mode, weight_decay, out=None, lr=HP["lr"], beta1=HP["beta1"],
              schedule=False, **kw):
    p = p0.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        adam_step(p, g, m, v, step=step, lr=lr_at(step, lr) if schedule else lr, beta1=beta1,
                  beta2=HP["beta2"], eps=HP["eps"], weight_decay=weight_decay,
                  adamw_mode=adamw_mode, out=out, **kw)
    return p, m, v


def assert_bitwise(ours, ref, equal_nan=False):
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=equal_nan,
                                   msg=lambda m: f"{name}: {m}")


def grads_for(n, steps=10, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Varying scale per step so moments see growth and decay.
    return [(torch.randn(n, generator=gen) * (0.1 + step)).to(dtype) for step in range(steps)]


SPLIT_BLOCK = 4096  # the split update's block in these tests, so mid-size buffers cross several


def mkl_in_torch() -> bool:
    return torch.backends.mkl.is_available() and platform.machine() in ("x86_64", "AMD64")
