"""The placement planner (Note [automatic placement] in offload/placement.py):
budgets respected to the byte, deterministic, the traffic model it optimizes."""
import random

import pytest

from offload.placement import Budgets, ParamSpec, plan_placement, uniform
from offload.tiers import Tier

H, N, D = Tier.HOST, Tier.NVME, Tier.DEVICE


def specs(sizes, persistent=()):
    return [ParamSpec(f"p{i}", n, n, persistent=i in persistent) for i, n in enumerate(sizes)]


def auto(sizes, *, host=None, device=0, itemsize=4, separate=False, nvme=True, home_tier=None, state_tier=None,
         persistent=()):
    return plan_placement(specs(sizes, persistent), Budgets(device=device, host=host, nvme_homes=nvme,
                                                            nvme_state=nvme),
                          itemsize=itemsize, separate_memory=separate, home_tier=home_tier, state_tier=state_tier)


def host_held(plan):
    return plan.held_bytes()[H]


def test_unlimited_budgets_keep_everything_on_the_host():
    plan = auto([100, 200, 300], host=None)
    assert [(s.home, s.state) for s in plan.shards] == [(H, H)] * 3
    assert plan.moved_per_step()["nvme"] == 0


def test_without_room_everything_goes_to_nvme_and_moves_28_bytes_per_fp32_element():
    plan = auto([100, 200], host=0)
    assert [(s.home, s.state) for s in plan.shards] == [(N, N)] * 2
    assert plan.moved_per_step()["nvme"] == 28 * 300  # Note [shared fp32 master]: 16 read, 12 written
    assert plan.held_bytes()[N] == 12 * 300  # a 4-byte home and the two moments


@pytest.mark.parametrize("itemsize", [4, 2])
@pytest.mark.parametrize("seed", range(20))
def test_the_host_budget_is_respected_to_the_byte_and_the_plan_is_deterministic(seed, itemsize):
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 30))]
    everything = host_held(auto(sizes, host=None, itemsize=itemsize))
    budget = rng.randrange(0, everything + 1)
    plan = auto(sizes, host=budget, itemsize=itemsize)
    assert host_held(plan) <= budget
    assert plan == auto(list(sizes), host=budget, itemsize=itemsize)  # same inputs, same plan
    # Nothing more fits: each shard still below the host cannot move up within what is left.
    left = budget - host_held(plan)
    for s in plan.shards:
        if s.home is N and s.state is N:
            assert s.part_numel * itemsize > left  # not even its home alone fits


def test_fp32_keeps_home_and_state_together_head_first():
    # 12 bytes an element for both (the fp32 home is the master); two of three fit, from
    # the head: what offload.init can decide as it builds (Note [building into the plan]).
    plan = auto([100, 100, 100], host=12 * 200)
    assert [(s.home, s.state) for s in plan.shards] == [(H, H), (H, H), (N, N)]
    assert host_held(plan) == 12 * 200
    assert plan.moved_per_step()["nvme"] == 28 * 100


def test_bf16_puts_every_home_on_the_host_before_any_state():
    # A bf16 home: 6 bytes a step saved for 2 held; its state saves 24 for 12.
    plan = auto([100, 100, 100], host=2 * 300 + 12 * 100, itemsize=2)
    assert [(s.home, s.state) for s in plan.shards] == [(H, H), (H, N), (H, N)]
    assert host_held(plan) == 2 * 300 + 12 * 100


def test_a_smaller_move_fills_what_a_larger_one_leaves():
    plan = auto([1000, 10], host=12 * 10 + 4 * 10)
    # the tail (10 elements) moves whole; 40 bytes are left, not enough for the
    # head's 4000-byte home: it stays on NVMe
    assert [(s.home, s.state) for s in plan.shards] == [(N, N), (H, H)]
    plan = auto([1000, 10], host=12 * 1000 + 4 * 10)
    # the head whole, and the tail's fp32 home alone (its state would need 120)
    assert [(s.home, s.state) for s in plan.shards] == [(H, H), (H, N)]


def test_the_device_budget_takes_homes_from_the_tail_and_persistent_parameters_stay_there():
    plan = auto([100, 100, 100, 5], device=4 * 200, host=None, separate=True, persistent={3})
    assert [s.home for s in plan.shards] == [H, D, D, D]
    assert plan.held_bytes()[D] == 4 * 205
    assert all(s.state is H for s in plan.shards)  # the homes took all the room: no state on the device
    # a device home takes its new value up once a step, an offloaded one goes up for forward and
    # backward; every gradient comes down
    assert plan.moved_per_step()["bus"] == 205 * (4 + 4) + 100 * (4 + 2 * 4)
    assert auto([100], device=10**9, separate=False).shards[0].home is H  # no separate memory, no device homes


def test_the_room_the_homes_leave_takes_their_optimizer_state_tail_first_to_the_byte():
    # homes 4 x (100 + 100 + 100) = 1200; state and gradient 16 B/element: room for two of three
    plan = auto([100, 100, 100], device=1200 + 16 * 200, host=None, separate=True)
    assert [(s.home, s.state) for s in plan.shards] == [(D, H), (D, D), (D, D)]
    assert plan.held_bytes()[D] == 1200 + 12 * 200  # the gradients are the engine's, reserved beside
    # one byte less: the middle one's state no longer fits
    plan = auto([100, 100, 100], device=1200 + 16 * 200 - 1, host=None, separate=True)
    assert [s.state for s in plan.shards] == [H, H, D]
    # a smaller shard further from the tail may still fit
    plan = auto([10, 100, 100], device=4 * 210 + 16 * 110, host=None, separate=True)
    assert [s.state for s in plan.shards] == [D, H, D]
    # state on the device moves nothing over the bus; a device home with host state moves
    # its gradient down and its new value up
    assert plan.moved_per_step()["bus"] == 100 * (4 + 4)
    # only beside device homes, never with an explicit state tier, never without separate memory
    assert all(s.state is H for s in auto([100, 100], device=10**9, separate=True, home_tier=H).shards)
    assert all(s.state is N for s in auto([100, 100], device=10**9, separate=True, state_tier=N).shards)
    assert all(s.state is not D for s in auto([100], device=10**9, separate=False).shards)


def test_an_explicit_side_is_kept_and_only_the_other_is_planned():
    plan = auto([100, 100], host=12 * 100, home_tier=N)
    assert [s.home for s in plan.shards] == [N, N]
    assert [s.state for s in plan.shards] == [H, N]
    plan = auto([100, 100], host=4 * 100, state_tier=N)
    assert [s.state for s in plan.shards] == [N, N]
    assert [s.home for s in plan.shards] == [H, N]


def test_without_nvme_paths_everything_stays_on_the_host_and_the_shortfall_is_noted():
    plan = auto([100, 100], host=100, nvme=False)
    assert [(s.home, s.state) for s in plan.shards] == [(H, H)] * 2
    assert "short" in plan.notes[0]


def test_an_explicit_config_is_a_uniform_plan():
    plan = uniform(specs([10, 20], persistent={0}), home_tier=N, state=H, itemsize=4, separate_memory=False)
    assert [(s.home, s.state) for s in plan.shards] == [(D, H), (N, H)]
    assert plan.budgets is None and "explicit" in plan.summary()


def test_summary_and_dict_give_bytes_per_tier_and_per_link():
    plan = auto([1 << 20, 1 << 20], host=12 << 20, separate=True)
    d = plan.to_dict()
    assert d["held_bytes"] == {"device": 0, "host": 12 << 20, "nvme": 12 << 20}
    assert d["moved_per_step"]["nvme"] == 28 << 20
    assert "host 12.00 MiB" in plan.summary() and "nvme 28.00 MiB" in plan.summary()
