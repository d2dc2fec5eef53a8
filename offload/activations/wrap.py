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

from offload.activations.plan import ActivationPlan, planned_call
from offload.activations.recompute import checkpoint
from offload.activations.saver import ActivationSaver

_CHECKPOINTED: dict[type, type] = {}
# Blocks whose checkpointing the activation plan decides at each call (Note [activations in the plan]).
_PLANNED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    new = _CHECKPOINTED.get(cls)
    if new is None:
        def forward(self, *args, **kwargs):
            return checkpoint(super(new, self).forward, *args, **kwargs)

        new = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _CHECKPOINTED[cls] = new
    return new


def _planned_class(cls: type) -> type:
    new = _PLANNED.get(cls)
    if new is None:
        def forward(self, *args, **kwargs):
            return planned_call(self, super(new, self).forward, args, kwargs)

        new = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _PLANNED[cls] = new
    return new


def original_class(module: torch.nn.Module) -> type:
    """The module's own class, under a checkpointed or planned subclass (Note [checkpointed modules])."""
    cls = type(module)
    base = cls.__mro__[1]
    return base if _CHECKPOINTED.get(base) is cls or _PLANNED.get(base) is cls else cls


def checkpointed_forward(module: torch.nn.Module, call):
    """`call` (a block's forward, compiled: Note [compiled blocks]) checkpointed as the
    engine checkpoints the module: always, as the plan decides, or not at all."""
    cls = type(module)
    if _CHECKPOINTED.get(cls.__mro__[1]) is cls:
        return lambda *args, **kwargs: checkpoint(call, *args, **kwargs)
    if _PLANNED.get(cls.__mro__[1]) is cls:
        return lambda *args, **kwargs: planned_call(module, call, args, kwargs)
    return call


def model_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the model's largest nn.ModuleList (by parameters): its blocks; [] where none."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return []
    return list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters())))


class ActivationCheckpointing:
    """What one engine installed: its saver and the modules whose class it swapped."""

    def __init__(self, model: torch.nn.Module, config, account, device: torch.device, *,
                 plan_budget: tuple[int, str] | None = None, local_ranks: int = 1):
        """plan_budget: (bytes, what they are) where the device has a budget the activation
        plan keeps within (Note [activations in the plan]); None: no plan. local_ranks:
        the job's ranks on this host, among which the pinned pool's default bound is split
        (Note [the node's share] in offload/node.py)."""
        self.local_ranks = local_ranks
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
                module.__class__ = _checkpointed_class(cls)  # names kept: Note [checkpointed modules]
                self._swapped.append((module, cls))
        self.planned = 0  # blocks whose checkpointing the plan decides
        self._plan_budget = None
        if plan_budget is not None and config.auto and not wanted:
            blocks = [b for b in model_blocks(model) if type(b) not in (*_CHECKPOINTED.values(), *_PLANNED.values())]
            classes = {type(b) for b in blocks}
            if len(classes) == 1 and not any("forward" in vars(b) for b in blocks):
                for block in blocks:
                    block.__class__ = _planned_class(type(block))  # as above: Note [checkpointed modules]
                    self._swapped.append((block, original_class(block)))
                self.planned = len(blocks)
                self._plan_budget = (plan_budget, classes.pop().__name__)

    def attach(self, manager) -> None:
        """Puts the saver on the manager's saved-tensor hook point (Note [activation bytes]);
        on a device with memory of its own, checkpoint inputs go through its copy
        streams (Note [pinned checkpoint inputs])."""
        self.saver.manager = manager
        ctx = manager.shards[0].ctx if manager.shards else None
        if ctx is not None and ctx.layer.separate_memory:
            self.saver.wait_for_device = ctx.layer.synchronize
        if ctx is not None and ctx.streams is not None:
            self.saver.use_copy_streams(ctx.streams, ctx.account.pinned, pin=ctx.layer.page_locks,
                                        planned=bool(self.planned), local_ranks=self.local_ranks)
        if self.planned:
            (budget, source), block_class = self._plan_budget
            self.saver.plan = ActivationPlan(self.saver, self.saver.account, blocks=self.planned,
                                             block_class=block_class, budget=budget, budget_source=source,
                                             inputs_to_host=self.saver.pinned_inputs is not None)
        manager.activations = self.saver

    @property
    def wrapped(self) -> int:
        """How many modules are checkpointed now, always (0 once removed)."""
        return len(self._swapped) - self.planned

    @property
    def plan(self) -> ActivationPlan | None:
        return self.saver.plan

    def remove(self) -> None:
        """Gives every swapped module its own class back, and the saver's pinned
        buffers (before the device layer closes). Idempotent."""
        self.saver.close()
        self.saver.plan = None
        self.planned = 0
        while self._swapped:
            module, cls = self._swapped.pop()
            module.__class__ = cls  # its own class back (Note [checkpointed modules])
