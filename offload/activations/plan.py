"""The activations' part of the plan: which blocks keep what their forward saves,
which are checkpointed, and whose checkpoint inputs go to the host, decided at
each block's call from what the device budget has left.

Note [activations in the plan]
An auto plan (Note [automatic placement] in offload/placement.py) gives homes
and optimizer state a share of the device budget at initialize; what forward
saves for backward depends on the inputs, which initialize has not seen. So
the activations' part of the plan is made as forward runs, block by block,
from measured bytes:
  - the blocks: the children of the model's largest nn.ModuleList (the unit
    compile and prefetch use too), where the config names no
    activation_checkpointing.modules, `auto` is on, and the device has a
    budget (memory.device_budget; on CUDA without one, its free memory at
    initialize plus what the engine holds there then);
  - the first forward at an input size not seen before checkpoints every
    block. Each checkpointed call records what its forward would have saved
    unchecked (the distinct storages it saved, parameters aside: what the
    saver would have charged); so the plan learns, per input size, the bytes
    a block saves, and the bytes saved after the last block until backward
    starts (the head and the loss, outside the model's call too);
  - then block i of n keeps its activations when the device has room, after
    what it holds now, for them, for the inputs of the n-i-1 blocks after it
    checkpointed, for one block recomputed in backward, and for the head's;
    else it is checkpointed; and where a checkpointed block's inputs would not
    fit either, they go to the host (cpu_checkpointing's path, a pinned copy
    on the copy streams: Note [pinned checkpoint inputs] in saver.py);
  - the costs, cheapest first: whole (nothing), checkpointed (the block's
    forward once more in backward, about a third of its compute), inputs on
    the host (their bytes down and up the bus, overlapped with compute). The
    state's share of the device (DEVICE_SHARE of the budget) is set at
    initialize, before any input is seen, and is not moved after it;
  - an input size larger than any seen (a longer sequence) is measured at its
    first forward, every block checkpointed, then planned; a size at most one
    seen is planned from the nearest larger one's figures (what a block saves
    grows at least in proportion to its input: attention's scores faster).
    Where even every block checkpointed with its inputs on the host does not
    fit, the charge that passes the budget raises in forward, as without a
    plan, before any weight or state has changed.
Checkpointing changes no value (offload.checkpoint recomputes the same
operations with the RNG state restored), so the results are plain PyTorch's
whatever is chosen. The choice is logged when it changes, and
engine.activation_report()["plan"] states it.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from offload.activations.recompute import checkpointed_call
from offload.activations.saver import ACTIVE, ActivationSaver
from offload.accounting import TierBudgetError
from offload.tiers import Tier

log = logging.getLogger("offload")


@dataclass(frozen=True)
class Choice:
    """What one forward chose for its blocks."""

    whole: int = 0
    checkpointed: int = 0
    inputs_on_host: int = 0  # of the checkpointed
    measuring: bool = False  # an input size not seen before: every block checkpointed

    def describe(self, block_class: str) -> str:
        total = self.whole + self.checkpointed
        host = f" ({self.inputs_on_host} with their inputs on the host)" if self.inputs_on_host else ""
        if self.measuring:
            return (f"all {total} {block_class} blocks checkpointed{host}, measuring what each saves at an "
                    "input size not seen before")
        return f"{self.whole} of {total} {block_class} blocks keep their activations; checkpointed: " \
               f"{self.checkpointed}{host}"


@dataclass
class _Sizes:
    """What the plan measured at one input size (bytes of a block's first tensor input)."""

    input: int
    block: int = 0  # most any block saved
    tail: int | None = None  # saved after the last block until backward started

    def at(self, size: int) -> tuple[int, int]:
        """(block, tail) scaled down in proportion to `size`: no less than what a block
        and the head save there, as both grow at least in proportion to the input."""
        return self.block * size // self.input, (self.tail or 0) * size // self.input


class ActivationPlan:
    """The one owner of the activation choices of an engine's forwards (Note [activations in the plan])."""

    def __init__(self, saver: ActivationSaver, account, *, blocks: int, block_class: str, budget: int,
                 budget_source: str, inputs_to_host: bool):
        self.saver, self.account = saver, account
        self.blocks, self.block_class = blocks, block_class
        self.budget, self.budget_source = budget, budget_source
        self.inputs_to_host = inputs_to_host  # the device has copy streams for them
        self._sizes: dict[int, _Sizes] = {}
        self._keys: list[int] = []  # sorted input sizes measured
        self._calls = 0
        self._first_input = 0
        self._measuring = False
        self._source: _Sizes | None = None
        self._after_last = 0
        self.awaits_backward = False
        self.idle = False  # this forward's blocks run as they are (begin_forward)
        self._counts = [0, 0, 0]  # whole, checkpointed, inputs on host
        self.last: Choice | None = None  # the last forward's
        self.reason = ""

    # ---- per forward -------------------------------------------------------
    def begin_forward(self, *, model_checkpoints: bool = False) -> None:
        """A new forward of the engine: the last one's choice is settled. model_checkpoints:
        the model checkpoints its blocks itself (Hugging Face's gradient_checkpointing_enable):
        its blocks run as they are, this forward, rather than checkpointed twice."""
        self._settle_choice()
        self.idle = model_checkpoints
        self._calls = 0
        self._counts = [0, 0, 0]
        self._measuring = False
        self.awaits_backward = False

    def backward_starts(self, held: int) -> None:
        """The first saved activation unpacked: held is what the saver charges now."""
        self.awaits_backward = False
        sizes = self._sizes.get(self._first_input)
        if sizes is not None:
            tail = max(0, max(held, self.saver.device_peak) - self._after_last)
            sizes.tail = tail if sizes.tail is None else max(sizes.tail, tail)

    def _settle_choice(self) -> None:
        if not self._calls:
            return
        whole, ckpt, host = self._counts
        choice = Choice(whole, ckpt, host, self._measuring)
        if choice != self.last:
            log.info("activation plan: %s (%s)", choice.describe(self.block_class), self.reason)
        self.last = choice

    # ---- a block's call ----------------------------------------------------
    def call(self, fn, args: tuple, kwargs: dict):
        """The block's forward, whole or checkpointed as the budget allows."""
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        size = first.numel() * first.element_size()
        index = self._calls
        if index == 0:
            self._first_input = size
            known = self._known(size)
            self._measuring = known is None or known.tail is None
            self._source = None if self._measuring else known  # this forward's figures
        self._calls += 1
        remaining = max(0, self.blocks - index - 1)
        sizes = self._source
        whole, to_host = False, False
        if sizes is not None:
            now = self.account.usage(Tier.DEVICE).now
            block, _ = sizes.at(size)
            _, tail = sizes.at(self._first_input)
            later = remaining * size + (block if remaining else 0) + tail
            whole = now + block + later <= self.budget
            to_host = not whole and self.inputs_to_host and now + size + later > self.budget
            self.reason = (f"a block saves {block} bytes at this input size, the head and loss {tail}; "
                           f"{self.budget_source} {self.budget}")
        else:
            to_host = self.inputs_to_host and self._host_needed(size, remaining)
            self.reason = f"{self.budget_source} {self.budget}"
        if whole:
            before = self.saver.device_bytes()
            out = fn(*args, **kwargs)
            self._measured(size, self.saver.device_bytes() - before)
            self._counts[0] += 1
        else:
            out, would_save = checkpointed_call(self.saver, fn, args, kwargs, inputs_to_host=to_host)
            self._measured(size, would_save)
            self._check_recompute(would_save)
            self._counts[1] += 1
            self._counts[2] += to_host
        if index == self.blocks - 1:
            self._after_last = self.saver.device_bytes()
            self.saver.reset_peak()
            self.awaits_backward = True
        return out

    def _check_recompute(self, would_save: int) -> None:
        """Backward recomputes this block with what is held now still held: where that does not
        fit, say so here, in forward, before any update has run during backward."""
        now = self.account.usage(Tier.DEVICE).now
        if now + would_save > self.budget:
            raise TierBudgetError(
                f"device tier budget exceeded: backward will recompute a {self.block_class} block, "
                f"{would_save} bytes, beside the {now} held now, past {self.budget_source} {self.budget}; "
                f"{self.short_of()}")

    def _host_needed(self, size: int, remaining: int) -> bool:
        """Measuring: the inputs go to the host where this one and those after it would not fit."""
        return self.account.usage(Tier.DEVICE).now + (remaining + 1) * size > self.budget

    def _known(self, size: int) -> _Sizes | None:
        """The figures measured at `size`, or at the nearest larger size measured."""
        at = bisect.bisect_left(self._keys, size)
        return self._sizes[self._keys[at]] if at < len(self._keys) else None

    def _measured(self, size: int, saved: int) -> None:
        sizes = self._sizes.get(size)
        if sizes is None:
            sizes = self._sizes[size] = _Sizes(size)
            bisect.insort(self._keys, size)
        sizes.block = max(sizes.block, saved)

    def short_of(self) -> str:
        """Said with a budget error inside a planned forward or backward: what the plan did and
        what else would make room."""
        whole, ckpt, host = self._counts
        measured = self._source or self._known(self._first_input)
        figures = "" if measured is None else (f"; a block saves {measured.block} bytes at input size "
                                               f"{measured.input}, the head and loss {measured.tail or 0}")
        return (f"the activation plan (Note [activations in the plan]) had checkpointed {ckpt} of this "
                f"forward's {whole + ckpt} {self.block_class} blocks so far, {host} with their inputs on the "
                f"host{figures}; it does not move what else the device holds: put less there "
                "(zero_optimization.offload_param / offload_optimizer device 'cpu', where not already), or use "
                "a smaller micro batch or sequence, or a larger memory.device_budget")

    def report(self) -> dict:
        """What the last forward chose, and the figures it chose from."""
        self._settle_choice()
        return {"blocks": self.blocks, "block_class": self.block_class, "budget": self.budget,
                "last": None if self.last is None else vars(self.last),
                "said": None if self.last is None else self.last.describe(self.block_class),
                "why": self.reason,
                "measured": {size: vars(s) for size, s in self._sizes.items()}}


def planned_call(module: torch.nn.Module, fn, args: tuple, kwargs: dict):
    """A planned block's forward: through its engine's plan inside the engine's
    forward, else as it is."""
    saver = ACTIVE.get()
    plan = None if saver is None else saver.plan
    if plan is None or plan.idle or torch._C._current_graph_task_id() != -1:
        return fn(*args, **kwargs)
    return plan.call(fn, args, kwargs)


def plan_budget(layer, config) -> tuple[int, str] | None:
    """What the activation plan keeps within: the device budget, else on a device that
    says its free memory, that (nothing of the engine's is there yet, at initialize);
    None: no budget to plan for (a device sharing the host's memory)."""
    if not layer.separate_memory:
        return None
    if config.memory.device_budget is not None:
        return config.memory.device_budget, "memory.device_budget"
    free = layer.free_memory()
    return None if free is None else (free, "the device's free memory at initialize")
