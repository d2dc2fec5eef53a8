"""Optimizers that run on the host CPU over native kernels."""
from offload.optim.cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
