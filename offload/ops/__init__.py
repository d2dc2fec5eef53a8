"""Fused kernels callable on plain tensors (native, with pure-PyTorch fallbacks)."""
from offload.ops.adam import adam_step

__all__ = ["adam_step"]
