"""The `compile` section: which blocks initialize compiles, and how (Note [compiled
blocks] in offload/compile/blocks.py); DeepSpeed's DeepCompile keys are inert.

Kept apart from sections.py (already past 500 lines); same conventions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from offload.config.base import ConfigError, _bool, _class_names, _fail, _Section

_DEEPCOMPILE = ("DeepCompile's, DeepSpeed's whole-graph compiler; offload compiles block by block "
                "(compile.modules, or engine.compile())")
_COMPILE_INERT = {
    "deepcompile": _DEEPCOMPILE,
    "passes": _DEEPCOMPILE,
    "autoep_non_moe": _DEEPCOMPILE,
    "free_activation": _DEEPCOMPILE + "; activations are freed by autograd as in eager",
    "free_activation_threshold": _DEEPCOMPILE,
    "offload_activation": _DEEPCOMPILE + "; activation_checkpointing.cpu_checkpointing keeps checkpoints "
                                         "on the host",
    "offload_activation_pin_memory": _DEEPCOMPILE,
    "offload_opt_states": _DEEPCOMPILE + "; where optimizer state lives is zero_optimization.offload_optimizer",
    "offload_parameters": _DEEPCOMPILE + "; where parameters live is zero_optimization.offload_param",
    "double_buffer": _DEEPCOMPILE + "; parameters are read ahead by the prefetcher, compiled or not",
    "symmetric_memory": _DEEPCOMPILE,
    "debug_log": _DEEPCOMPILE + "; TORCH_LOGS=graph_breaks,recompiles shows what dynamo did",
    "sync_before_reduce": _DEEPCOMPILE,
    "sync_after_reduce": _DEEPCOMPILE,
    "sync_before_allgather": _DEEPCOMPILE,
    "sync_after_allgather": _DEEPCOMPILE,
    "keep_int_input_tensors": _DEEPCOMPILE,
    "keep_all_input_tensors": _DEEPCOMPILE,
}


@dataclass(frozen=True, kw_only=True)
class CompileConfig(_Section):
    """`compile`: blocks compiled at initialize, each at its boundary.

    enabled: compile at initialize (default: when `modules` names any class).
    modules (ours): class names of the blocks (["LlamaDecoderLayer"]); empty:
      the class of the children of the model's largest nn.ModuleList.
    backend, mode, dynamic, fullgraph: torch.compile's arguments for each
      block (fullgraph true makes a graph break inside a block an error).
    """

    SECTION: ClassVar[str] = "compile"
    INERT: ClassVar[dict] = _COMPILE_INERT
    enabled: bool | None = None
    modules: tuple[str, ...] = ()
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = False

    def __post_init__(self):
        k = self._key
        names = _class_names(k("modules"), self.modules, "DecoderLayer")
        self._set("modules", names)
        if self.enabled is not None:
            _bool(k("enabled"), self.enabled)
            if not self.enabled and names:
                raise ConfigError(f"compile: enabled is false but modules names {list(names)}; remove one "
                                  "(modules alone compiles them)")
        if not isinstance(self.backend, str) or not self.backend:
            raise _fail(k("backend"), self.backend, 'a torch.compile backend name ("inductor", "aot_eager", ...)')
        if self.mode is not None and (not isinstance(self.mode, str) or not self.mode):
            raise _fail(k("mode"), self.mode, 'a torch.compile mode ("default", "max-autotune", ...) or null')
        if self.dynamic is not None:
            _bool(k("dynamic"), self.dynamic)
        _bool(k("fullgraph"), self.fullgraph)

    @property
    def at_initialize(self) -> bool:
        return bool(self.modules) if self.enabled is None else self.enabled

    def compile_kwargs(self) -> dict:
        """torch.compile's keyword arguments (torch checks the backend's and mode's names)."""
        out = {"backend": self.backend, "fullgraph": self.fullgraph}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.dynamic is not None:
            out["dynamic"] = self.dynamic
        return out
