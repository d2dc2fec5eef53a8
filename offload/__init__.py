"""offload: train PyTorch models larger than the GPU, and larger than RAM.

What exists so far: the fused CPU Adam kernel (`offload.ops.adam_step`), the
CPU optimizer built on it (`offload.optim.CPUAdam`), and the `offload` CLI
(`offload report`, `offload bench ...`). See docs/ARCHITECTURE.md.
"""
__version__ = "0.1.0"
