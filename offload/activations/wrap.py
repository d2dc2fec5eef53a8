"""The engine's side of activation checkpointing: the saver on the manager's
hook point, and the modules named in the config checkpointed.

Note [checkpointed modules]
A module of a class named in `activation_checkpointing.modules` gets, for
the engine's lifetime, a subclass of its own class whose forward calls the
original through offload.checkpoint; the instance's `__class__` is swapped
to it (as FSDP2's fully_shard does) and swapped back at engine.close().
Why not a wrapper module in its parent: the wrapper would add a level to
every parameter and state_dict name (blocks.0.module.ln1.weight), and
checkpoints and parity tests key on those names; keeping them needs
state_dict hooks in both directions. With the class swap nothing is renamed,
`isinstance(m, Block)` still holds, and the module's forward hooks (the
manager's gather/release) run once around the checkpointed call. Only
`type(m) is Block` tells the difference while the engine is open.
"""
from __future__ import annotations

import torch

from offload.activations.recompute import checkpoint
from offload.activations.saver import ActivationSaver

_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    new = _CHECKPOINTED.get(cls)
    if new is None:
        def forward(self, *args, **kwargs):
            return checkpoint(super(new, self).forward, *args, **kwargs)

        new = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _CHECKPOINTED[cls] = new
    return new


def original_class(module: torch.nn.Module) -> type:
    """The module's own class, under a checkpointed subclass (Note [checkpointed modules])."""
    cls = type(module)
    return cls.__mro__[1] if _CHECKPOINTED.get(cls.__mro__[1]) is cls else cls


class ActivationCheckpointing:
    """What one engine installed: its saver and the modules whose class it swapped."""

    def __init__(self, model: torch.nn.Module, config, account, device: torch.device):
        self.saver = ActivationSaver(account, device,
                                     cpu_checkpointing=config.cpu_checkpointing,
                                     synchronize=config.synchronize_checkpoint_boundary,
                                     profile=config.profile)
        self._swapped: list[tuple[torch.nn.Module, type]] = []
        wanted = set(config.modules)
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(wanted - present)
        if missing:
            raise ValueError(f"activation_checkpointing.modules: no module of class {', '.join(map(repr, missing))} "
                             f"in the model (its module classes: {', '.join(sorted(present))})")
        for module in model.modules():
            cls = type(module)
            if cls.__name__ in wanted and cls not in _CHECKPOINTED.values():
                module.__class__ = _checkpointed_class(cls)
                self._swapped.append((module, cls))

    def attach(self, manager) -> None:
        """Puts the saver on the manager's saved-tensor hook point (Note [activation bytes]);
        on a device with memory of its own, checkpoint inputs go through its copy
        streams (Note [pinned checkpoint inputs])."""
        self.saver.manager = manager
        ctx = manager.shards[0].ctx if manager.shards else None
        if ctx is not None and ctx.layer.separate_memory:
            self.saver.wait_for_device = ctx.layer.synchronize
        if ctx is not None and ctx.streams is not None:
            self.saver.use_copy_streams(ctx.streams, ctx.account.pinned, pin=ctx.layer.page_locks)
        manager.activations = self.saver

    @property
    def wrapped(self) -> int:
        """How many modules are checkpointed now (0 once removed)."""
        return len(self._swapped)

    def remove(self) -> None:
        """Gives every swapped module its own class back, and the saver's pinned
        buffers (before the device layer closes). Idempotent."""
        self.saver.close()
        while self._swapped:
            module, cls = self._swapped.pop()
            module.__class__ = cls
