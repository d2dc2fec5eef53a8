"""Where each parameter's home and its optimizer state live: the plan
(Note [automatic placement]).

`plan_placement` decides, per parameter, two tiers: its home (the
compute-dtype partition forward gathers) and its optimizer state (fp32
master, exp_avg, exp_avg_sq). An explicit config (`offload_param.device` /
`offload_optimizer.device` "none", "cpu" or "nvme") fixes one of them for
every parameter, as it always has; `"auto"` lets the planner choose, within
a byte budget per tier. The plan is made at initialize, before anything
moves; `engine.placement()` returns it and `offload estimate --config`
prints it.

# Note [automatic placement]
Every byte kept on a higher tier is a byte a link does not move, every step.
Per element of a parameter partition, with c the compute dtype's size, a
step moves (Note [shared fp32 master] in offload/optim/states.py):

    home NVMe         reads 2c (forward, backward), writes c (the new value)
    state NVMe        reads and writes 12 (master, exp_avg, exp_avg_sq); 8
                      each when the master is the fp32 home's file itself
    home off-device   2c up the bus (forward, backward), beside a device with
                      memory of its own; a device home takes c up (its new
                      value) and nothing for the gathers

and holds in host memory c for a host home (nothing when the home is fp32
and the state is on the host too: the home is the master) and 12 for host
state. The planner:
1. puts under-threshold parameters on the device (stage3_param_persistence_
   threshold, as an explicit config does);
2. beside a device with memory of its own, fills the device budget with
   parameter homes, the model's tail first (its gradients arrive first and
   its parameters are needed first by backward): each saves c per element
   on the bus, and a device home needs no host copy of the parameter; then,
   with the room left, the optimizer state of device homes, tail first: 16
   bytes an element (the state and the fp32 gradient that stays beside it)
   that save the gradient's c down and the new value's c up, and the host's
   Adam for that shard (updated on the device, by step());
3. starts every other choice at the lowest tier the config allows (NVMe
   where a path is given, else the host), then spends the host budget
   greedily on the move that saves the most NVMe bytes per host byte it
   costs, ties to the head. In fp32 that is home and state together (28
   bytes moved saved for 12 held); in bf16 the home alone goes first (6 for
   2), its state after. Moves that no longer fit are skipped; a smaller one
   may still fit.
Budgets are what the tier may hold for homes and state: the engine's own
buffers (staging, gathered working set, gradients, optimizer buffers) come
first. build.py plans, reserves what the engine holds beside the plan
(engine/budgets.py), and plans again with the room lowered by any shortfall
and one shard's state to spare, until it fits. The plan depends only on the
parameters' sizes and order, the dtype and the budgets, so every rank with
the same budgets makes the same plan (each rank's defaults differ with its
free memory: ranks take the smallest). A model built under offload.init is
built into its planned home (Note [building into the plan]). A shard whose
state is on the device keeps its gradient there (Shard.gradient.tier): it is
not copied down, and its update runs on the device at step() while the
host's Adam runs the others (Note [optimizer overlap]).

Note [building into the plan]
The host pass goes head first, so its first choices are a prefix of the
model in order: what offload.init can decide one parameter at a time, as
the model is built, without knowing the rest (`HomePolicy` in
engine/build.py, within the same host budget, recorded when the build
starts). Which end of the model gets the host makes no difference to the
bytes moved; with the head on the host, the tail's NVMe state is what the
overlapped step reads first, at the start of backward. Initialize then plans
the whole model and moves only what the plan puts elsewhere: the parameters
the engine's own buffers leave no room for, the device homes, and anything
the construction order put out of the model's order.

Note [frozen parameters]
A parameter frozen when the engine is built (requires_grad=False: a LoRA's
base, a frozen embedding) is only ever read. It costs its home in the
compute dtype, c bytes an element on its home tier (its whole padded size
on the device), and nothing else: no fp32 master, no moments, no gradient
partition, no NVMe state file, and its home is never written back. In a
plan its `state` is None. A quantized one (a QLoRA base) costs its own
bytes instead, `itemsize` an element (Note [quantized frozen weights] in
partition/quantized.py), and everything below counts c as that. A step reads it twice (forward, and backward
where the module's input gradient needs the weight) and writes nothing:
    home NVMe         reads 2c           home off-device  2c up the bus
So per element a frozen home saves 2c of NVMe reads for c of host memory,
and 2c of bus for c of device memory. The planner gives the trainable set
and its state the higher tiers first (for a LoRA they are under 1% of the
bytes): on the device, trainable homes, then their state, then frozen
homes, tail first; on the host, at equal saving per byte, trainable moves
before frozen ones. The frozen base fills what is left; only its overflow
goes to NVMe, read ahead like any home. A parameter trainable at initialize
may stop and start training freely (requires_grad False: no gradient, no
update, as in plain PyTorch); one frozen at initialize and set trainable
later trains from the next forward, its state made then (Note [unfreezing]
in engine/unfreeze.py).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from offload.tiers import Tier

# The shares an auto plan takes (Note [automatic placement]): of the host
# memory available at initialize when memory.host_budget is not set, and of
# the device budget (memory.device_budget, else the device's free memory)
# for device homes. The rest is for activations, the gathered working set,
# the allocator's slack and the rest of the process.
HOST_SHARE = 0.75
DEVICE_SHARE = 0.5
# Device bytes per element of a partition whose optimizer state is on the device:
# master, exp_avg, exp_avg_sq and the fp32 gradient that stays beside them.
DEVICE_STATE_BYTES = 16


@dataclass(frozen=True)
class ParamSpec:
    """What the planner knows of one parameter."""

    name: str
    part_numel: int  # this rank's partition
    padded_numel: int  # the whole parameter, padded: what a device home holds
    persistent: bool = False  # under stage3_param_persistence_threshold: a device home in any plan
    fixed_home: Tier | None = None  # already homed (built under offload.init)
    trainable: bool = True  # False: frozen, a home and nothing else (Note [frozen parameters])
    # A home's own bytes an element where they are not the compute dtype's (a quantized
    # frozen weight's packed bytes: 1), and the bytes kept whole beside compute with it
    # (its quantization state): Note [quantized frozen weights] in partition/quantized.py.
    itemsize: int | None = None
    side_bytes: int = 0


@dataclass(frozen=True)
class Budgets:
    """Bytes an auto plan may give homes and state on each tier (None: no limit),
    and whether NVMe has a path for homes and for state."""

    device: int | None = 0
    host: int | None = None
    nvme_homes: bool = False
    nvme_state: bool = False


@dataclass(frozen=True)
class ShardPlacement:
    name: str
    part_numel: int
    padded_numel: int
    home: Tier
    state: Tier | None  # None: frozen, no optimizer state and no gradient (Note [frozen parameters])
    itemsize: int | None = None  # as ParamSpec's
    side_bytes: int = 0

    @property
    def trainable(self) -> bool:
        return self.state is not None


@dataclass(frozen=True)
class Placement:
    """The plan: one ShardPlacement per parameter, in the model's order."""

    shards: tuple[ShardPlacement, ...]
    itemsize: int  # the compute dtype's bytes
    separate_memory: bool
    budgets: Budgets | None = None  # the room an auto plan filled with homes and state (None: explicit)
    host_limit: int | None = None  # an auto plan's host budget, the engine's buffers included
    notes: tuple[str, ...] = field(default=())

    def uses(self, tier: Tier) -> bool:
        return any(tier in (s.home, s.state) for s in self.shards)

    @property
    def state_tiers(self) -> frozenset:
        """Every tier some trainable parameter's optimizer state lives on."""
        return frozenset(s.state for s in self.shards if s.trainable)

    def home_bytes(self) -> dict[Tier, int]:
        """Bytes of parameter homes per tier (an fp32 host home with host state is
        the master itself: counted with the state)."""
        held = dict.fromkeys(Tier, 0)
        for s in self.shards:
            held[s.home] += _home_bytes(s, s.itemsize or self.itemsize)
        return held

    def state_bytes(self) -> dict[Tier, int]:
        """Bytes of optimizer state (master, exp_avg, exp_avg_sq) per tier."""
        held = dict.fromkeys(Tier, 0)
        for s in self.shards:
            if s.trainable:
                held[s.state] += _state_bytes(s, self.itemsize)
        return held

    def held_bytes(self) -> dict[Tier, int]:
        """Bytes of homes and optimizer state per tier (gradients and buffers not included)."""
        homes, states = self.home_bytes(), self.state_bytes()
        return {t: homes[t] + states[t] for t in Tier}

    def moved_per_step(self) -> dict[str, int]:
        """Predicted bytes per step on each link: "nvme" (host<->disk, both ways) and
        "bus" (host<->device, both ways; 0 where the device is the host)."""
        c = self.itemsize
        nvme = bus = 0
        for s in self.shards:
            n = s.part_numel
            nvme += n * _nvme_per_elem(s.home, s.state, s.itemsize or c)
            if self.separate_memory:
                if not s.trainable:  # read up for forward and backward, never written
                    bus += 0 if s.home is Tier.DEVICE else n * 2 * (s.itemsize or c)
                    continue
                if s.state is Tier.DEVICE:  # updated where its gradient is: new values go down to a home off it
                    bus += 0 if s.home is Tier.DEVICE else n * 3 * c
                    continue
                grad = c  # gradients go down in the compute dtype (Note [copy streams])
                bus += n * (grad + (c if s.home is Tier.DEVICE else 2 * c))
        return {"nvme": nvme, "bus": bus}

    def summary(self) -> str:
        """One line: bytes per tier, predicted bytes per step per link."""
        held = self.held_bytes()
        moved = self.moved_per_step()
        kind = "auto" if self.budgets is not None else "explicit"
        per_tier = ", ".join(f"{t.value} {_gib(held[t])}" for t in Tier)
        links = f"nvme {_gib(moved['nvme'])}" + (f", bus {_gib(moved['bus'])}" if self.separate_memory else "")
        return f"placement ({kind}): homes and optimizer state {per_tier}; moved per step {links}"

    def to_dict(self) -> dict:
        held = self.held_bytes()
        return {"auto": self.budgets is not None,
                "held_bytes": {t.value: held[t] for t in Tier},
                "moved_per_step": self.moved_per_step(),
                "budgets": None if self.budgets is None else {"device": self.budgets.device,
                                                              "host": self.budgets.host},
                "host_limit": self.host_limit,
                "shards": [{"name": s.name, "home": s.home.value,
                            "state": s.state.value if s.trainable else None,
                            "part_numel": s.part_numel} for s in self.shards],
                "notes": list(self.notes)}

    def format(self) -> str:
        """Per tier: parameters homed, states held, bytes; then the summary."""
        lines = [self.summary()]
        for t in Tier:
            homes = sum(1 for s in self.shards if s.home is t)
            states = sum(1 for s in self.shards if s.state is t)
            lines.append(f"  {t.value:<6} {homes:>5} homes  {states:>5} optimizer states  "
                         f"{_gib(self.held_bytes()[t])}")
        frozen = [s for s in self.shards if not s.trainable]
        if frozen:
            lines.append(f"  frozen {len(frozen):>5} parameters ({sum(s.part_numel for s in frozen)} elements): "
                         "homes only, no optimizer state or gradient")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _home_bytes(s: ShardPlacement, c: int) -> int:
    if s.home is Tier.DEVICE:
        return s.padded_numel * c
    if s.home is Tier.HOST and s.state is Tier.HOST and c == 4:
        return 0  # the fp32 home is the master (counted with the state)
    return s.part_numel * c


def _state_bytes(s: ShardPlacement, c: int) -> int:
    if s.state is Tier.NVME and s.home is Tier.NVME and c == 4:
        return s.part_numel * 8  # the master is the parameter's file
    return s.part_numel * 12


def _nvme_per_elem(home: Tier, state: Tier | None, c: int) -> int:
    if state is None:  # frozen: read for forward and backward, never written
        return 2 * c if home is Tier.NVME else 0
    moved = 3 * c if home is Tier.NVME else 0
    if state is Tier.NVME:
        moved += 16 if (home is Tier.NVME and c == 4) else 24
    return moved


def _host_per_elem(home: Tier, state: Tier | None, c: int) -> int:
    held = 12 if state is Tier.HOST else 0
    if home is Tier.HOST and not (state is Tier.HOST and c == 4):
        held += c
    return held


def uniform(specs: list[ParamSpec], *, home_tier: Tier, state: Tier, itemsize: int, separate_memory: bool,
            home_of=None) -> Placement:
    """An explicit config's plan: every home where `home_of(spec)` says (default:
    under the threshold on the device, else `home_tier`), every state on `state`."""
    def default_home(spec: ParamSpec) -> Tier:
        return Tier.DEVICE if spec.persistent else home_tier
    pick = home_of or default_home
    shards = tuple(ShardPlacement(s.name, s.part_numel, s.padded_numel, s.fixed_home or pick(s),
                                  state if s.trainable else None, s.itemsize, s.side_bytes)
                   for s in specs)
    return Placement(shards, itemsize, separate_memory)


def plan_placement(specs: list[ParamSpec], budgets: Budgets, *, itemsize: int, separate_memory: bool,
                   home_tier: Tier | None, state_tier: Tier | None) -> Placement:
    """The auto plan (Note [automatic placement]). home_tier / state_tier: the explicit
    tier of one side (None: that side is planned too)."""
    c = itemsize
    n = len(specs)
    c_of = [s.itemsize or c for s in specs]  # each home's bytes an element
    home: list[Tier] = [Tier.HOST] * n
    state: list[Tier | None] = [Tier.HOST] * n
    low_home = Tier.NVME if budgets.nvme_homes else Tier.HOST
    low_state = Tier.NVME if budgets.nvme_state else Tier.HOST
    device_left = budgets.device
    planned_home = [home_tier is None and s.fixed_home is None and not s.persistent for s in specs]
    for i, s in enumerate(specs):
        home[i] = s.fixed_home or (Tier.DEVICE if s.persistent else (home_tier or low_home))
        state[i] = (state_tier or low_state) if s.trainable else None

    def device_homes(trainable: bool) -> None:
        nonlocal device_left
        for i in reversed(range(n)):
            if not planned_home[i] or specs[i].trainable is not trainable:
                continue
            need = specs[i].padded_numel * c_of[i]
            if device_left is None or need <= device_left:
                home[i] = Tier.DEVICE
                planned_home[i] = False
                if device_left is not None:
                    device_left -= need
    # 2. the device, tail first: trainable homes, then (2b) their optimizer state
    # and the gradient beside it, then (2c) frozen homes (Note [frozen parameters]).
    if separate_memory and home_tier is None:
        device_homes(trainable=True)
    if separate_memory and state_tier is None:
        for i in reversed(range(n)):
            if home[i] is not Tier.DEVICE or state[i] is None:
                continue
            need = specs[i].part_numel * DEVICE_STATE_BYTES
            if device_left is None or need <= device_left:
                state[i] = Tier.DEVICE
                if device_left is not None:
                    device_left -= need
    if separate_memory and home_tier is None:
        device_homes(trainable=False)
    # 3. the host, by NVMe bytes saved per host byte held.
    host_left = budgets.host
    held = sum(specs[i].part_numel * _host_per_elem(home[i], state[i], c_of[i]) for i in range(n))
    if host_left is not None:
        host_left -= held
    notes = []
    heap: list = []
    pushed = iter(range(1 << 62))  # a unique key before the tiers, which do not order

    def options(i: int):
        homes = [home[i]] + ([Tier.HOST] if planned_home[i] and home[i] is Tier.NVME else [])
        states = [state[i]] + ([Tier.HOST] if state_tier is None and state[i] is Tier.NVME else [])
        c = c_of[i]
        now_moved, now_held = _nvme_per_elem(home[i], state[i], c), _host_per_elem(home[i], state[i], c)
        for h in homes:
            for st in states:
                if (h, st) == (home[i], state[i]):
                    continue
                saved = now_moved - _nvme_per_elem(h, st, c)
                cost = _host_per_elem(h, st, c) - now_held
                if saved <= 0:
                    continue
                ratio = saved / cost if cost > 0 else float("inf")
                yield ratio, h, st, cost

    def push(i: int):
        for ratio, h, st, cost in options(i):
            # Highest ratio first, trainable before frozen (Note [frozen parameters]), then the head
            # first (Note [building into the plan]), then the smaller cost.
            heapq.heappush(heap, (-ratio, not specs[i].trainable, i, cost, next(pushed), h, st, home[i], state[i]))

    for i in range(n):
        push(i)
    while heap:
        _, _, i, cost, _, h, st, was_h, was_st = heapq.heappop(heap)
        if (home[i], state[i]) != (was_h, was_st):
            continue  # stale: this shard moved since
        nbytes = cost * specs[i].part_numel
        if host_left is not None and nbytes > host_left:
            continue
        home[i], state[i] = h, st
        if host_left is not None:
            host_left -= nbytes
        push(i)
    if host_left is not None and host_left < 0:
        notes.append(f"the host budget is {-host_left} bytes short even with everything "
                     "that may go lower on NVMe")
    shards = tuple(ShardPlacement(s.name, s.part_numel, s.padded_numel, home[i], state[i], s.itemsize, s.side_bytes)
                   for i, s in enumerate(specs))
    return Placement(shards, c, separate_memory, budgets=budgets, notes=tuple(notes))


def _gib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def nvme_state_buffers(part: int, itemsize: int, homes_on_nvme: bool) -> dict[str, int]:
    """Host bytes the update of NVMe optimizer state keeps in flight, by what they are,
    for `part`, the largest partition whose state is on NVMe: what initialize reserves
    (engine/budgets.py) and what `offload estimate` counts (sizing/memory_model.py),
    one function so the two cannot disagree."""
    held = {"optimizer state buffers in flight": 3 * 12 * part,
            # ShardedAdam.state_buffers: the idle ones kept within a step, up to its cap
            # (measured: in flight and idle together reached 5.6 x 12 B x the largest).
            "idle optimizer buffers kept within a step": 4 * 12 * part,
            "fp32 masters taken from gathered parameters": 3 * 4 * part}
    if itemsize != 4 and homes_on_nvme:  # the compute dtype's: bf16 or fp16
        held["new parameter values on their way to NVMe"] = 3 * itemsize * part
    return held
