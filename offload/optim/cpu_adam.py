"""CPUAdam: a torch.optim.Optimizer over the fused native Adam kernel.

It behaves like torch.optim.AdamW (adamw_mode=True) or torch.optim.Adam with
L2 weight decay (adamw_mode=False): same hyperparameters, same state names,
LR schedulers and state_dict()/load_state_dict() work as usual. It only knows
tensors; sharding and offload code hands it flat CPU shards and never reaches
into it (see docs/ARCHITECTURE.md).

Parameters kept in bf16 or fp16 get an fp32 master copy in the state
("master"); the kernel updates the master and writes the rounded value back
into the parameter in the same pass. Moments are always fp32.
"""
from __future__ import annotations

import math

import torch

from offload.ops import adam_step
from offload.ops.adam import GRAD_DTYPES

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP32_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")


class CPUAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        *,
        num_threads: int | None = None,
    ):
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        if not 0.0 <= lr or math.isnan(lr):
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.num_threads = num_threads
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._check_param(p)

    def _check_param(self, p: torch.Tensor) -> None:
        if p.device.type != "cpu":
            raise ValueError(
                f"CPUAdam updates CPU tensors; got a parameter of shape {tuple(p.shape)} "
                f"on {p.device} (use torch.optim.AdamW for device-resident parameters)"
            )
        if p.dtype not in _PARAM_DTYPES:
            raise TypeError(
                f"CPUAdam parameters must be float32, bfloat16 or float16; got {p.dtype} "
                f"for a parameter of shape {tuple(p.shape)}"
            )

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._check_param(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, group, beta1, beta2)
        return loss

    def _update(self, p: torch.Tensor, group: dict, beta1: float, beta2: float) -> None:
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("CPUAdam does not support sparse gradients")
        if grad.dtype not in GRAD_DTYPES:
            raise TypeError(f"gradient dtype {grad.dtype} is not float32, bfloat16 or float16")
        if grad.device.type != "cpu":
            raise ValueError(f"gradient of a CPU parameter is on {grad.device}")
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
            if p.dtype != torch.float32:
                state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format)
        state["step"] += 1
        step = int(state["step"].item())

        # The kernel works on contiguous buffers; a strided parameter is
        # updated through a contiguous copy written back afterwards.
        p_flat = p.detach()
        contiguous = p_flat.is_contiguous()
        if not contiguous:
            p_flat = p_flat.contiguous()
        master = state.get("master", p_flat)
        adam_step(
            master, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"],
            step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
            bias_correction=group["bias_correction"],
            out=None if master is p_flat else p_flat, num_threads=self.num_threads,
        )
        if not contiguous:
            p.detach().copy_(p_flat)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts floating-point state to each parameter's dtype; our
        # masters and moments stay fp32 whatever the parameter is, so they are
        # taken from the saved dict again (not from the cast copy, which for a
        # bf16 parameter would have lost precision).
        saved_groups = state_dict.get("param_groups", [])
        saved_state = state_dict.get("state", {})
        super().load_state_dict(state_dict)
        for saved_group, group in zip(saved_groups, self.param_groups):
            for saved_id, p in zip(saved_group["params"], group["params"]):
                entry = saved_state.get(saved_id)
                if not entry:
                    continue
                for key in _FP32_STATE_KEYS:
                    if key not in entry:
                        continue
                    value = entry[key]
                    if value.numel() != p.numel():
                        raise ValueError(
                            f"state_dict entry {saved_id!r} '{key}' has {value.numel()} elements "
                            f"but the parameter it maps to has {p.numel()}"
                        )
                    self.state[p][key] = value.detach().to("cpu", torch.float32, copy=True).reshape(p.shape).contiguous()
