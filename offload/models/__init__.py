"""Plain PyTorch models the examples and benchmarks train. They know nothing
of offload: the engine wraps them like any user model."""
from offload.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
