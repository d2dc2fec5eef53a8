"""torch.compile by blocks, each at its boundary (Note [compiled blocks]), and the
prefetcher sized by blocks (Note [blocks as the unit of prefetch]). A layer above the
parameter runtime and the activations: it drives both, and neither imports it.

Note [compiled blocks]
What compiles well is a block's own math on parameters already gathered, so
`engine.compile()` (or the config's `compile` section, at initialize) draws the line at each
block's boundary, the way torchtitan compiles a transformer block by block:
- Outside, eager: every gather and release. The block's new forward
  gathers all the parameters under it, calls the compiled one, and releases
  them (ParameterManager.gather_at_boundary); the modules inside it lose the
  engine's hooks, so dynamo traces none of them. Prefetch, gradients taken
  in, the update: all outside too, as in eager.
- Inside, compiled: the block's original forward. The forward's
  TorchFunctionMode (GatherOnUse) is popped for the call, since every
  parameter the block reads is already gathered, and its `id()` lookups
  would be a graph break in every op.
- Saved tensors: the compiled function saves what its backward needs as
  any autograd Function does, so the engine's saved-tensor hooks, active
  outside, turn a saved parameter into a record and gather it again in
  backward, unchanged.
- The engine's activation checkpointing of the same blocks goes outside
  the gathers: the recomputation in backward calls the same function, so
  it gathers the block's parameters again (held until their gradients are
  final, as any recomputation's) and reruns the same compiled graph. Were
  the gathers on the block's hooks instead, the recomputation, which calls
  only the forward, would meet released parameters: dynamo recompiled for
  their placeholder strides and the checkpoint caught the different saves.
The block's forward is set on the instance, and removed at engine.close().
A parameter of the block read by another module (a tied weight) is gathered
by that module as before.

Note [blocks as the unit of prefetch]
Eager, a block takes its parameters into use one module at a time, so a
prefetch bucket of the largest parameter (Note [prefetch order]) keeps the
reads a few parameters ahead of compute. A compiled block takes them all at
its start, and its backward unpacks them all at once: the bucket then filled
before the block's last parameter, whose read started only when the block
did, and the block waited for it (GPT 67M on NVMe, 2-core Xeon: 0.10-0.17 s
of waits a step against eager's 0.05-0.06, the compiled step 1.07-1.09x
eager's). So with blocks compiled the limits left unset are sized by the
largest block's parameters gathered at once instead of the largest
parameter: the next block is read whole while this one computes, and the
last block is kept from forward to backward. initialize's check of the
device budget counts a block gathered whole (the config's compile
section); engine.compile() after initialize checks the same against what
the device tier holds then, and refuses before any block changes.
"""
from __future__ import annotations

import contextlib

import torch

from offload.activations.wrap import checkpointed_forward, model_blocks, original_class
from offload.partition.gather_on_use import GatherOnUse
from offload.partition.prefetch import prefetch_limits, working_set_elems
from offload.tiers import Tier


def _at_the_boundary(block, compiled, gather, release):
    """compiled(*args) between gather and release of the block's parameters, with the
    engine's GatherOnUse popped when it is the innermost mode."""
    def call(*args, **kwargs):
        gather(block, args)
        try:
            top = torch.overrides._get_current_function_mode()
            with (torch.overrides._pop_mode_temporarily() if isinstance(top, GatherOnUse)
                  else contextlib.nullcontext()):
                return compiled(*args, **kwargs)
        finally:
            release(block, args, None)
    return call


def blocks_to_compile(model: torch.nn.Module, names) -> list[torch.nn.Module]:
    """The modules of the classes `names` (None: the class of the children of the model's
    largest nn.ModuleList, its blocks), outermost only; refused where one is checkpointed."""
    if names is None:
        biggest = model_blocks(model)
        if not biggest:
            raise ValueError("compile: the model has no nn.ModuleList of blocks to compile; name the block "
                             "classes: engine.compile(modules=['DecoderLayer'])")
        names = {original_class(m).__name__ for m in biggest}
    names = {names} if isinstance(names, str) else set(names)
    present = {original_class(m).__name__ for m in model.modules()}
    missing = sorted(names - present)
    if missing:
        raise ValueError(f"compile: no module of class {', '.join(map(repr, missing))} in the model "
                         f"(its module classes: {', '.join(sorted(present))})")
    blocks, inside = [], set()
    for m in model.modules():
        if id(m) in inside or original_class(m).__name__ not in names:
            continue
        if "forward" in vars(m):
            raise ValueError(f"compile: a {type(m).__name__} already has a forward of its own on the instance "
                             "(compiled already, or patched): compile each block once")
        blocks.append(m)
        inside.update(id(sub) for sub in m.modules())
    return blocks


def compile_forwards(blocks: list[torch.nn.Module], **compile_kwargs) -> list:
    """Each block's own forward through torch.compile, which checks its arguments here (an
    unknown backend or mode raises), before anything of the model changes."""
    try:
        return [torch.compile(original_class(block).forward.__get__(block), **compile_kwargs) for block in blocks]
    except Exception as e:  # noqa: BLE001 - dynamo's own error types move between releases
        shown = ", ".join(f"{k}={v!r}" for k, v in compile_kwargs.items())
        raise ValueError(f"compile: torch.compile({shown}) refused: {e}") from e


def compile_blocks(manager, blocks: list[torch.nn.Module], forwards: list) -> list[torch.nn.Module]:
    """Each block's compiled forward (compile_forwards) called with its parameters gathered at
    its boundary (Note [compiled blocks]); returns the blocks, whose `forward` attribute
    uncompile_blocks removes."""
    for block, forward in zip(blocks, forwards):
        call = _at_the_boundary(block, forward, *manager.gather_at_boundary(block))
        # Checkpointed (Note [checkpointed modules]) or planned (Note [activations in the
        # plan]): the checkpoint outside, gathers and all.
        block.forward = checkpointed_forward(block, call)
    return blocks


def gathered_at_once(blocks, shards) -> int:
    """Elements the largest of `blocks` gathers at once: every parameter under it whose
    gather takes a buffer of its own (Note [blocks as the unit of prefetch]); 0 without blocks."""
    by_id = {id(s.param): s for s in shards}
    return max((sum(by_id[id(p)].padded_numel for p in block.parameters()
                    if id(p) in by_id and by_id[id(p)].gathers_to_a_buffer) for block in blocks), default=0)


def uncompile_blocks(blocks) -> None:
    for block in blocks:
        vars(block).pop("forward", None)


def prefetch_by_blocks(manager, shards, config, account, itemsize: int, unit: int) -> None:
    """Note [blocks as the unit of prefetch], for blocks compiled after initialize
    (engine.compile()): refused where the device budget has no room for a block gathered whole."""
    zero = config.zero_optimization
    gathered = [s.padded_numel for s in shards if s.gathers_to_a_buffer]
    if unit <= max(gathered, default=0):
        return  # no block gathers more than its largest parameter: nothing changes
    device = account.usage(Tier.DEVICE)
    need = working_set_elems(zero, gathered, any(s.reads_ahead for s in shards), unit, unit) * itemsize
    if device.budget is not None and device.now + need > device.budget:
        raise MemoryError(  # as initialize's own check of the budgets (engine/budgets.py)
            f"compile: a block gathers {unit * itemsize / 2**20:.1f} MiB of parameters at "
            f"once, so the step needs {need / 2**20:.1f} MiB of them gathered beside the "
            f"{device.now / 2**20:.1f} MiB the device tier holds now, past memory.device_budget "
            f"({device.budget / 2**20:.1f} MiB). Name the blocks in the config's compile section, so that "
            "initialize plans for them, or compile smaller modules (modules=[...])")
    manager.prefetch.resize(prefetch_limits(zero, unit))
