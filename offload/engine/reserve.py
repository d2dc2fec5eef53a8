"""What initialize reserves beside the homes and the optimizer state, and an auto
plan settled within the budgets around it: one computation, for initialize
(engine/build.py, on the model's parameters) and for the estimate
(offload/sizing/memory_model.py, on the parameters it counted), so the two agree to
the byte (tests/sizing/test_reserved_agree.py).

Each item of `planned` needs only its home, its optimizer state's tier (`state`),
`part_numel` and `padded_numel`: initialize's _Planned and the plan's
ShardPlacement both have them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from offload.config import Config
from offload.engine import budgets
from offload.engine.stores import staging_plan, store_configs
from offload.placement import Budgets, Placement
from offload.tiers import Tier


@dataclass(frozen=True)
class Reserve:
    """configs: the swap stores' settings by role (engine/stores.py); staging: the
    parameter staging pool's (buffer bytes, depth), or None; need: per budgeted tier,
    {what: bytes} (budgets.tier_needs)."""

    configs: dict
    staging: tuple[int, int] | None
    need: dict[Tier, dict]


def reserve(planned: list, config: Config, *, separate_memory: bool, world_size: int, rank: int = 0,
            have_param_store: bool = False, on_demand: int, unit: int = 0) -> Reserve:
    """on_demand: elements of the largest set of parameters one module gathers at once
    (budgets.largest_module_group); unit: a compiled block's (budgets.gathered_by_blocks)."""
    dtype = config.precision.dtype
    configs = store_configs(planned, config, rank, have_param_store)
    staging = staging_plan(planned, config, dtype, separate_memory, world_size)
    need = budgets.tier_needs(planned, config, dtype, sum(c.buffer_bytes for c in configs.values()),
                              separate_memory=separate_memory, world_size=world_size,
                              param_staging_bytes=staging[0] * staging[1] if staging else 0,
                              on_demand=on_demand, unit=unit,
                              grad_backlog_elems=budgets.grad_backlog(config, planned,
                                                                      separate_memory=separate_memory))
    return Reserve(configs, staging, need)


def settle_plan(placement: Placement, config: Config, plan_within: Callable[[Budgets], Placement],
                reserve_of: Callable[[Placement], Reserve]) -> tuple[Placement, Reserve]:
    """An auto plan leaves room for what the engine holds besides homes and state;
    where that came out more than it left, plan again with less (budgets.replan_within),
    up to 8 times. `placement`: the first plan; an explicit one (no budgets) is kept."""
    held = reserve_of(placement)
    first = placement.budgets
    for _ in range(8 if first is not None else 0):
        replanned = budgets.replan_within(placement, held.need, config, first)
        if replanned is None:
            break
        placement = plan_within(replanned)
        held = reserve_of(placement)
    return placement, held
