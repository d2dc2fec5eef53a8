"""The `activation_checkpointing` section: DeepSpeed's keys, plus our `modules`.

Kept apart from sections.py (already past 500 lines); same conventions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from offload.config.base import ConfigError, _bool, _class_names, _int, _Section


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig(_Section):
    """`activation_checkpointing`: recompute activations in backward (offload.checkpoint).

    modules (ours): class names of the modules the engine checkpoints at
      initialize (`["Block"]`); each must occur in the model. Empty: only the
      model's own offload.checkpoint calls checkpoint.
    cpu_checkpointing: the checkpoints' inputs are kept on the host tier (pinned
      host copies with CUDA; on a CPU-only host, charged to the host tier).
    synchronize_checkpoint_boundary: with CUDA, synchronize the device before and
      after each checkpointed call (no effect on a CPU-only host: CPU work is
      already synchronous).
    profile: time checkpointed forwards and recomputations (engine's
      `activation_report()`).
    auto (ours): where `modules` is empty and the device has a budget, the engine
      checkpoints the model's blocks (the children of its largest nn.ModuleList)
      as the budget needs it, block by block (Note [activations in the plan]);
      false: only `modules` and the model's own calls checkpoint.
    partition_activations, contiguous_memory_optimization and number_checkpoints
      are accepted with their off values only (see docs/CONFIG.md for why).
    """

    SECTION: ClassVar[str] = "activation_checkpointing"
    modules: tuple[str, ...] = ()
    auto: bool = True
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def __post_init__(self):
        k = self._key
        self._set("modules", _class_names(k("modules"), self.modules, "Block"))
        for name in ("auto", "cpu_checkpointing", "synchronize_checkpoint_boundary", "profile"):
            _bool(k(name), getattr(self, name))
        if _bool(k("partition_activations"), self.partition_activations):
            raise ConfigError(
                "activation_checkpointing.partition_activations: true is not supported: DeepSpeed splits "
                "each checkpoint across the model-parallel ranks, and offload has no model parallelism (every "
                "data-parallel rank holds a different batch's activations, whatever the world size), so there "
                "is nothing to split; use cpu_checkpointing to move checkpoints off the device")
        if _bool(k("contiguous_memory_optimization"), self.contiguous_memory_optimization):
            raise ConfigError(
                "activation_checkpointing.contiguous_memory_optimization: true is not supported: DeepSpeed "
                "copies partitioned checkpoints into one preallocated buffer, which needs "
                "partition_activations; offload leaves checkpoints where the allocator put them")
        number = _int(k("number_checkpoints"), self.number_checkpoints, lo=1, none=True)
        if number is not None:
            raise ConfigError(
                f"activation_checkpointing.number_checkpoints: {number} is only used to size DeepSpeed's "
                "contiguous_memory_optimization buffer, which offload does not implement; remove it "
                "(which modules are checkpointed is 'modules')")
