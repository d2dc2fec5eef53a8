"""`"device": "auto"` (Note [automatic placement] in offload/placement.py): the
engine trains like plain PyTorch under budgets that split the model between
host memory and NVMe at several points, resumes exactly into another plan,
refuses an impossible budget before anything moves, and on the sim keeps
its planned device share off the bus."""
import copy
import logging
import re
from pathlib import Path

import pytest
import torch

import offload
from offload.tiers import Tier
from tests.support.models import TinyGPT
from tests.support.harness import (batches, build, engine_weights, make_config, run_engine, run_reference,
                                  run_reference_mixed, train_engine)

STEPS = 6


def deep_gpt():
    """Deep enough that its homes and state outweigh what NVMe's buffers take
    (tiny_gpt's do not: all of it on NVMe would need more host memory)."""
    torch.manual_seed(0)
    return TinyGPT(hidden=48, layers=8)


def auto_config(tmp_path, *, host_budget=None, device_budget=None, precision="fp32", gas=1, clip=0.0):
    cfg = make_config("cpu", "cpu", tmp_path, precision=precision, gas=gas, clip=clip)
    zero = cfg["zero_optimization"]
    zero["offload_param"] = {"device": "auto", "nvme_path": str(tmp_path)}
    zero["offload_optimizer"] = {"device": "auto", "nvme_path": str(tmp_path)}
    cfg["memory"] = {"host_budget": host_budget, "device_budget": device_budget}
    return cfg


def run_auto(model, data, cfg, *, copied=True):
    """run_engine, also returning the plan and the host tier's peak. copied=False:
    train `model` itself (one built under offload.init is its builder's, not copied)."""
    with offload.initialize(copy.deepcopy(model) if copied else model, cfg) as engine:
        losses = train_engine(engine, data)
        return engine_weights(engine), losses, engine.placement(), engine.memory_report()["host"]["peak"]


def reserved(model, cfg) -> int:
    """The host bytes initialize reserves for `cfg` (its budget line)."""
    cfg = copy.deepcopy(cfg)
    cfg["memory"] = {"host_budget": 1 << 40}
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        note = engine.account.budget_notes[Tier.HOST]
    return int(re.match(r"initialize reserved (\d+) of", note).group(1))


def split_budgets(model, tmp_path, precision="fp32"):
    """Host budgets between the least an auto plan needs (everything it may move on
    NVMe) and what keeps everything on the host."""
    least = reserved(model, make_config("nvme", "nvme", tmp_path, precision=precision))
    most = reserved(model, make_config("cpu", "cpu", tmp_path, precision=precision))
    assert least < most
    return [least + (most - least) * k // 8 for k in (2, 4, 7)]


def test_ample_ram_plans_everything_on_the_host_and_trains_as_cpu_offload_bit_for_bit(tmp_path, caplog):
    model, data = build("tiny_gpt"), batches(STEPS)
    with caplog.at_level(logging.INFO, logger="offload"):
        auto_weights, auto_losses, engine = run_engine(model, data, auto_config(tmp_path))
    plan = engine.placement()
    assert all((s.home, s.state) == (Tier.HOST, Tier.HOST) for s in plan.shards)
    assert plan.moved_per_step()["nvme"] == 0 and plan.budgets is not None
    assert any(r.getMessage().startswith("placement (auto): homes and optimizer state") for r in caplog.records)
    cpu_weights, cpu_losses, _ = run_engine(model, data, make_config("cpu", "cpu", tmp_path))
    torch.testing.assert_close(auto_losses, cpu_losses, rtol=0, atol=0)
    for name, value in cpu_weights.items():
        torch.testing.assert_close(auto_weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_budgets_that_split_the_model_train_like_plain_pytorch(tmp_path, precision):
    model, data = deep_gpt(), batches(STEPS)
    if precision == "fp32":
        ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
        ref_losses = ref_losses[:, 0]
    else:
        ref_model, ref_losses = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=1, lr=1e-2,
                                                    weight_decay=0.01)
        ref_losses = ref_losses[:, 0]
    cpu_weights, cpu_losses, _ = run_engine(model, data, make_config("cpu", "cpu", tmp_path / "cpu",
                                                                      precision=precision))
    mixed_sides = 0
    for i, budget in enumerate(split_budgets(model, tmp_path / "probe", precision)):
        weights, losses, plan, peak = run_auto(model, data, auto_config(tmp_path / str(i), host_budget=budget,
                                                                        precision=precision))
        tiers = {t for s in plan.shards for t in (s.home, s.state)}
        assert tiers == {Tier.HOST, Tier.NVME}, plan.format()  # a split, not one tier
        assert peak <= budget
        mixed_sides += sum(s.home is not s.state for s in plan.shards)
        torch.testing.assert_close(losses, ref_losses)
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
        # the same operations in the same order as all on the host: the same bits
        torch.testing.assert_close(losses, cpu_losses, rtol=0, atol=0)
        for name, value in cpu_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    if precision == "bf16":  # homes go up first: some home and its state on different tiers
        assert mixed_sides > 0


def test_clipping_and_accumulation_under_a_split_plan_equal_plain_pytorch(tmp_path):
    model, data = deep_gpt(), batches(8, seed=3)
    ref_model, ref_losses = run_reference(model, data, gas=2, clip=0.05, lr=1e-2, weight_decay=0.01)
    budget = split_budgets(model, tmp_path / "probe")[1]
    weights, losses, _ = run_engine(model, data, auto_config(tmp_path, host_budget=budget, gas=2, clip=0.05))
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_resume_into_a_run_with_another_plan_is_exact(tmp_path):
    model, data = deep_gpt(), batches(8, seed=5)
    roomy, tight = split_budgets(model, tmp_path / "probe")[2], split_budgets(model, tmp_path / "probe")[0]
    whole_weights, whole_losses, _ = run_engine(model, data, make_config("cpu", "cpu", tmp_path / "whole"))
    with offload.initialize(copy.deepcopy(model), auto_config(tmp_path / "a", host_budget=roomy)) as first:
        plan_a = first.placement()
        losses_a = train_engine(first, data[:4])
        first.save_checkpoint(tmp_path / "ck")
    with offload.initialize(copy.deepcopy(model), auto_config(tmp_path / "b", host_budget=tight)) as second:
        plan_b = second.placement()
        second.load_checkpoint(tmp_path / "ck")
        losses_b = train_engine(second, data[4:])
        weights = engine_weights(second)
    moved = [a.name for a, b in zip(plan_a.shards, plan_b.shards) if (a.home, a.state) != (b.home, b.state)]
    assert moved, "the two plans should differ"
    torch.testing.assert_close(torch.cat([losses_a, losses_b]), whole_losses, rtol=0, atol=0)
    for name, value in whole_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_a_budget_below_the_least_plan_is_refused_at_initialize_with_the_numbers(tmp_path):
    model = deep_gpt()
    least = reserved(model, make_config("nvme", "nvme", tmp_path / "probe"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(MemoryError, match=rf"host tier budget exceeded: this configuration needs at least "
                                          rf"{least} bytes .* memory.host_budget is {least - 1}"):
        offload.initialize(model, auto_config(tmp_path, host_budget=least - 1))
    for name, p in model.named_parameters():  # nothing moved
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)


def test_without_an_nvme_path_auto_keeps_everything_on_the_host_or_refuses(tmp_path):
    model = build("tiny_gpt")
    cfg = auto_config(tmp_path)
    for side in ("offload_param", "offload_optimizer"):
        del cfg["zero_optimization"][side]["nvme_path"]
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        assert not engine.placement().uses(Tier.NVME)
    cfg["memory"] = {"host_budget": 1000}
    with pytest.raises(MemoryError, match=r"give zero_optimization\.offload_param an nvme_path .*; or give "
                                          r"zero_optimization\.offload_optimizer an nvme_path"):
        offload.initialize(copy.deepcopy(model), cfg)


def test_on_the_sim_the_planned_device_share_stays_off_the_bus(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    model, data = deep_gpt(), batches(4, seed=2)
    device_budget = 1_200_000  # half of it for homes: a part of its 0.9 MB of fp32 parameters

    def bytes_per_step(cfg):
        with offload.initialize(copy.deepcopy(model), cfg) as engine:
            train_engine(engine, data[:2])
            counters = engine.device_layer.counters
            before = counters.bytes_copied
            losses = train_engine(engine, data[2:3])
            return counters.bytes_copied - before, engine.placement(), losses, engine_weights(engine)

    cpu_cfg = make_config("cpu", "cpu", tmp_path / "cpu")
    cpu_cfg["memory"] = {"device_budget": device_budget}
    cpu_bytes, cpu_plan, cpu_losses, cpu_weights = bytes_per_step(cpu_cfg)
    auto_bytes, plan, losses, weights = bytes_per_step(auto_config(tmp_path / "auto", device_budget=device_budget))
    on_device = [s for s in plan.shards if s.home is Tier.DEVICE]
    assert on_device and len(on_device) < len(plan.shards)
    assert plan.moved_per_step()["bus"] < cpu_plan.moved_per_step()["bus"]
    assert auto_bytes < cpu_bytes
    # Each planned device home saves one upload of its compute-dtype value a step
    # (its new value goes up once instead of a gather for forward and another for
    # backward), less where the host-homed run kept a tail parameter gathered
    # across the turn from forward to backward (Note [prefetch order]: one upload).
    saved = sum(s.padded_numel * plan.itemsize for s in on_device)
    assert 0.8 * saved <= cpu_bytes - auto_bytes <= saved, (cpu_bytes, auto_bytes, saved)
    torch.testing.assert_close(losses, cpu_losses, rtol=0, atol=0)
    for name, value in cpu_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


# Room for every home of deep_gpt on the sim device and the optimizer state of some.
ROOMY_DEVICE = {"fp32": 6_000_000, "bf16": 4_000_000}


@pytest.mark.parametrize("precision,gas,clip", [("fp32", 2, 0.05), ("bf16", 1, 0.0)])
def test_on_the_sim_state_planned_on_the_device_stays_there_and_trains_like_plain_pytorch(
        tmp_path, monkeypatch, precision, gas, clip):
    """The device's room left after the homes takes their optimizer state, tail first: those
    shards' gradients and new values cross no bus, and their update runs beside host Adam's
    (overlapped with backward; under clipping and accumulation, by step())."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    model, data = deep_gpt(), batches(4 * gas, seed=4)
    per_step = [data[i:i + gas] for i in range(0, len(data), gas)]
    if precision == "fp32":
        ref_model, ref_losses = run_reference(model, data, gas=gas, clip=clip, lr=1e-2, weight_decay=0.01)
    else:
        ref_model, ref_losses = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=gas, lr=1e-2,
                                                    weight_decay=0.01)
    cpu_cfg = make_config("cpu", "cpu", tmp_path / "cpu", precision=precision, gas=gas, clip=clip)
    cpu_weights, cpu_losses, _ = run_engine(model, data, cpu_cfg)
    cfg = auto_config(tmp_path / "auto", device_budget=ROOMY_DEVICE[precision], precision=precision,
                      gas=gas, clip=clip)
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        losses = [train_engine(engine, step) for step in per_step[:2]]
        plan, counters = engine.placement(), engine.device_layer.counters
        engine.optimizer.zero_grad()  # a clipped step's updates (and uploads) run on: settled here
        before = counters.bytes_copied
        losses += [train_engine(engine, step) for step in per_step[2:]]
        engine.optimizer.zero_grad()
        measured = (counters.bytes_copied - before) / (len(per_step) - 2)
        weights = engine_weights(engine)
        grads_on_device = {s.name for s in engine.shards if s.gradient.tier is Tier.DEVICE}
    losses = torch.cat(losses)
    on_device = {s.name for s in plan.shards if s.state is Tier.DEVICE}
    assert all(s.home is Tier.DEVICE for s in plan.shards), plan.format()
    assert on_device and len(on_device) < len(plan.shards), plan.format()  # a split of the state
    assert grads_on_device == on_device
    # tail first; a shard left off the device would not have fit the room left
    room = plan.budgets.device - sum(s.padded_numel * plan.itemsize for s in plan.shards) \
        - sum(16 * s.part_numel for s in plan.shards if s.state is Tier.DEVICE)
    assert plan.shards[-1].state is Tier.DEVICE and room >= 0
    assert all(16 * s.part_numel > room for s in plan.shards if s.state is not Tier.DEVICE)
    assert plan.held_bytes()[Tier.DEVICE] <= ROOMY_DEVICE[precision] // 2
    # What crosses the bus is only the host-state shards' gradients down and new values
    # up, in the compute dtype, once a micro-batch for the gradients: the plan's figure.
    host_elems = sum(s.part_numel for s in plan.shards if s.state is Tier.HOST)
    c = plan.itemsize
    assert measured == host_elems * c * (gas + 1)
    assert plan.moved_per_step()["bus"] == host_elems * 2 * c
    torch.testing.assert_close(losses, ref_losses[:, 0] if gas == 1 else ref_losses.reshape(-1)[:len(losses)])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
    # the same kernel over the same values as all on the host: the same bits
    torch.testing.assert_close(losses, cpu_losses, rtol=0, atol=0)
    for name, value in cpu_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_on_the_sim_state_on_all_three_tiers_trains_exactly_and_keeps_its_accounts(tmp_path, monkeypatch):
    """Device, host and NVMe state in one plan: gradients of host-state shards are updated
    from their staging buffers (never charged) while NVMe-state ones are charged until their
    update; the host tier's count is the same after every step (it once fell by a
    gradient's bytes a step, until close() found it negative)."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    model, data = deep_gpt(), batches(6, seed=2)
    cpu_weights, cpu_losses, _ = run_engine(model, data, make_config("cpu", "cpu", tmp_path / "cpu"))
    # The host budget holds the copy streams' own buffers (the gradient staging ring, the
    # pinned uploads of device homes' values) and some state beside them; the rest spills.
    cfg = auto_config(tmp_path / "auto", device_budget=3_000_000, host_budget=1_900_000)
    host_now = []
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        assert engine.placement().state_tiers == {Tier.DEVICE, Tier.HOST, Tier.NVME}, engine.placement().format()
        losses = []
        for step in data:
            losses.append(train_engine(engine, [step]))
            host_now.append(engine.memory_report()["host"]["now"])
        weights = engine_weights(engine)
    assert len(set(host_now[1:])) == 1, host_now
    torch.testing.assert_close(torch.cat(losses), cpu_losses, rtol=0, atol=0)
    for name, value in cpu_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_on_the_sim_a_device_home_updated_late_under_the_next_forward_is_waited_for(tmp_path, monkeypatch):
    """Note [device homes' new values]: with clipping, a device home with host state is
    updated on the host worker beside the next forward and its new value goes up from
    there; the forward's gather waits for the update, then the copy. Updates slowed
    down here so the forward gets there first; the sim checks each access's order."""
    import threading
    import time

    from offload.optim.sharded_adam import ShardedAdam

    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    model, data = deep_gpt(), batches(4, seed=7)
    cpu_weights, cpu_losses, _ = run_engine(model, data, make_config("cpu", "cpu", tmp_path / "cpu", clip=0.05))
    original = ShardedAdam.update_shard
    late = []

    def slow_update(self, shard, *args, **kwargs):
        if shard.home is Tier.DEVICE and threading.current_thread() is not threading.main_thread():
            late.append(shard.name)
            time.sleep(0.02)
        return original(self, shard, *args, **kwargs)

    monkeypatch.setattr(ShardedAdam, "update_shard", slow_update)
    cfg = auto_config(tmp_path / "auto", device_budget=1_200_000, clip=0.05)  # some homes on the device
    weights, losses, _ = run_engine(model, data, cfg)
    assert late, "no device home was updated on the host worker"
    torch.testing.assert_close(losses, cpu_losses, rtol=0, atol=0)
    for name, value in cpu_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_on_the_sim_a_run_with_state_on_the_device_resumes_exactly_into_an_all_host_plan(tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    model, data = deep_gpt(), batches(6, seed=6)
    whole_weights, whole_losses, _ = run_engine(model, data, make_config("cpu", "cpu", tmp_path / "whole"))
    with offload.initialize(copy.deepcopy(model),
                            auto_config(tmp_path / "a", device_budget=ROOMY_DEVICE["fp32"])) as first:
        assert first.placement().uses(Tier.DEVICE) and Tier.DEVICE in first.placement().state_tiers
        losses_a = train_engine(first, data[:3])
        first.save_checkpoint(tmp_path / "ck")
    with offload.initialize(copy.deepcopy(model), auto_config(tmp_path / "b")) as second:  # sim: no free memory known
        assert not second.placement().uses(Tier.DEVICE)
        second.load_checkpoint(tmp_path / "ck")
        losses_b = train_engine(second, data[3:])
        weights = engine_weights(second)
    torch.testing.assert_close(torch.cat([losses_a, losses_b]), whole_losses, rtol=0, atol=0)
    for name, value in whole_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_model_built_under_offload_init_is_built_into_its_planned_homes_and_trains_exactly(tmp_path, precision):
    # Note [building into the plan]: offload.init takes the host pass of the plan in
    # the model's order as it builds; initialize plans the whole model and moves only
    # what the engine's own buffers leave no room for.
    data = batches(STEPS, seed=4)
    budget = split_budgets(deep_gpt(), tmp_path / "probe", precision)[1]
    cfg = auto_config(tmp_path / "built", host_budget=budget, precision=precision)
    torch.manual_seed(0)
    with offload.init(cfg) as builder:
        model = TinyGPT(hidden=48, layers=8)
    built = [(s, s.home) for s in builder.shards]
    weights, losses, plan, peak = run_auto(model, data, cfg, copied=False)
    planned = {s.name: s for s in plan.shards}
    moved = sum(planned[s.name].part_numel for s, home in built if planned[s.name].home is not home)
    on_host = sum(s.part_numel for s in plan.shards if s.home is Tier.HOST)
    assert {t for s in plan.shards for t in (s.home, s.state)} == {Tier.HOST, Tier.NVME}
    if precision == "fp32":  # a split of the homes, built mostly where they stay
        assert {home for _, home in built} == {Tier.HOST, Tier.NVME}
        assert moved <= 0.15 * sum(s.part_numel for s in plan.shards) and moved < on_host / 3
    else:  # every home on the host (homes first in bf16), the state split: nothing moved
        assert moved == 0
    assert peak <= budget
    # every plan computes the same bits: the model built plainly, all on the host
    plain_weights, plain_losses, _ = run_engine(deep_gpt(), data, make_config("cpu", "cpu", tmp_path / "plain",
                                                                              precision=precision))
    torch.testing.assert_close(losses, plain_losses, rtol=0, atol=0)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert len(list((tmp_path / "built").rglob("param.*.swp"))) <= sum(s.home is Tier.NVME for s in plan.shards)


def _two_rank_worker(rank, world, port, nvme_root, results):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OFFLOAD_DEVICE="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, data = deep_gpt(), batches(6, world=world, seed=7)
        ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01,
                                              world=world)
        budgets = split_budgets(model, os.path.join(nvme_root, f"probe{rank}"))
        # Each rank its own budget: the plan is made within the smallest, the same on both.
        cfg = auto_config(Path(nvme_root) / "run", host_budget=budgets[1] if rank == 0 else budgets[2])
        weights, losses, engine = run_engine(model, data, cfg, rank=rank)
        plan = engine.placement()
        plans = [None] * world
        dist.all_gather_object(plans, [(s.home.value, s.state.value) for s in plan.shards])
        assert plans[0] == plans[1]
        assert {t for s in plan.shards for t in (s.home, s.state)} == {Tier.HOST, Tier.NVME}
        torch.testing.assert_close(losses, ref_losses[:, rank])
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
        results.put((rank, 0, "ok"))
        # On the sim: every home and some optimizer state on the device (their gradients
        # reduce-scattered into device partitions, their homes all-gathered from the
        # masters), the rest on the host.
        os.environ["OFFLOAD_DEVICE"] = "sim"
        cfg = auto_config(Path(nvme_root) / "sim", device_budget=4_000_000 if rank == 0 else 10**9)
        weights, losses, engine = run_engine(model, data, cfg, rank=rank)
        plan = engine.placement()
        dist.all_gather_object(plans, [(s.home.value, s.state.value) for s in plan.shards])
        assert plans[0] == plans[1]
        assert all(s.home is Tier.DEVICE for s in plan.shards)
        assert {s.state for s in plan.shards} == {Tier.DEVICE, Tier.HOST}, plan.format()
        torch.testing.assert_close(losses, ref_losses[:, rank])
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
        results.put((rank, 1, "ok"))
    except Exception:  # noqa: BLE001 - reported to the parent test
        import traceback

        results.put((rank, 0, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns two ranks
def test_two_ranks_with_different_budgets_make_one_plan_and_match_data_parallel_pytorch(tmp_path):
    from tests.engine.ranks import run_ranks

    outcome, procs = run_ranks(_two_rank_worker, (str(tmp_path),))
    failures = {k: v for k, v in outcome.items() if v != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for (r, _), msg in failures.items())
    assert len(outcome) == 4 and [p.exitcode for p in procs] == [0, 0]


def test_activation_checkpointing_and_consolidation_under_a_split_plan(tmp_path):
    from safetensors.torch import load_file

    model, data = deep_gpt(), batches(STEPS, seed=6)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    budget = split_budgets(model, tmp_path / "probe")[1]
    cfg = auto_config(tmp_path / "run", host_budget=budget)
    cfg["activation_checkpointing"] = {"modules": ["Block"]}
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        assert engine.placement().uses(Tier.NVME) and engine.placement().uses(Tier.HOST)
        losses = train_engine(engine, data)
        masters = engine.full_state_dict(master=True)
        engine.save_checkpoint(tmp_path / "ck")
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), msg=lambda m: f"{name}: {m}")
    # one file from a checkpoint whose partitions lay on two tiers: the masters, exactly
    out = load_file(str(offload.consolidate(tmp_path / "ck", tmp_path / "m.safetensors", progress=False)))
    for name, value in masters.items():
        if name in out:
            assert torch.equal(out[name], value), name


def test_the_default_host_budget_is_a_share_of_available_memory_and_the_plan_fills_it(tmp_path, monkeypatch):
    """No memory.host_budget: HOST_SHARE of what the OS says is available. A replan
    lowers the room the plan may fill, never that limit (a bug that once planned
    the 2.48B model all on NVMe with 16 GiB free)."""
    import psutil

    from offload.placement import HOST_SHARE

    model, data = deep_gpt(), batches(3, seed=8)
    budgets = split_budgets(model, tmp_path / "probe")
    available = int(budgets[1] / HOST_SHARE)
    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=available))
    weights, losses, plan, peak = run_auto(model, data, auto_config(tmp_path / "run"))
    assert plan.budgets.host > 0 and plan.held_bytes()[Tier.HOST] > 0  # not all on NVMe
    assert plan.uses(Tier.NVME)
    assert peak <= HOST_SHARE * available


@pytest.mark.parametrize("param,optim", [("auto", "nvme"), ("auto", "none"), ("none", "auto"), ("cpu", "auto"),
                                         ("nvme", "auto")])
def test_one_side_auto_the_other_explicit_trains_like_plain_pytorch(tmp_path, param, optim):
    model, data = deep_gpt(), batches(3, seed=1)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    cfg = make_config("cpu", "cpu", tmp_path)
    zero = cfg["zero_optimization"]
    for key, device in (("offload_param", param), ("offload_optimizer", optim)):
        zero[key] = {"device": device, **({"nvme_path": str(tmp_path)} if device in ("auto", "nvme") else {})}
    cfg["memory"] = {"host_budget": 3_000_000}
    weights, losses, plan, peak = run_auto(model, data, cfg)
    explicit = optim if param == "auto" else param
    side = [s.state for s in plan.shards] if param == "auto" else [s.home for s in plan.shards]
    assert set(side) == {Tier.from_offload_device(explicit)}  # the explicit side as configured
    assert peak <= 3_000_000
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_an_explicit_cpu_side_that_the_host_cannot_hold_is_named_in_the_refusal(tmp_path):
    cfg = make_config("cpu", "cpu", tmp_path)
    cfg["zero_optimization"]["offload_param"] = {"device": "auto", "nvme_path": str(tmp_path)}
    cfg["memory"] = {"host_budget": 3_000_000}
    with pytest.raises(MemoryError, match=r"set zero_optimization\.offload_optimizer\.device to 'auto' or 'nvme' "
                                          r"\(it is 'cpu'"):
        offload.initialize(deep_gpt(), cfg)
