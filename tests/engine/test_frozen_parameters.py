"""Frozen parameters (Note [frozen parameters] in offload/placement.py): a LoRA-shaped
model whose base is frozen trains like plain PyTorch while each frozen weight costs
its home alone, on every tier, to the byte; unfreezing one no parameter group lists is
refused by name; a checkpoint without the frozen weights resumes bit for bit on
the same base and is refused on another (Note [checkpoints without frozen weights])."""
import collections
import copy
import json

import pytest
import torch
from safetensors import safe_open

import offload
from offload.checkpoint_io import CheckpointError
from offload.partition.shard import Residency, Shard
from offload.placement import Budgets, ParamSpec, plan_placement
from offload.tiers import Tier
from tests.support.harness import (batches, engine_weights, make_config, run_reference, run_reference_mixed,
                                  train_engine)
from tests.support.models import lora_gpt
from tests.support.layer_under_test import exact

STEPS = 4
CONFIGS = [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("auto", "auto")]


def config(param, optim, tmp_path, *, precision="fp32", gas=1, clip=0.0, host_budget=None):
    cfg = make_config("cpu" if param == "auto" else param, "cpu" if optim == "auto" else optim, tmp_path,
                      precision=precision, gas=gas, clip=clip)
    zero = cfg["zero_optimization"]
    if param == "auto":
        zero["offload_param"] = {"device": "auto", "nvme_path": str(tmp_path)}
    if optim == "auto":
        zero["offload_optimizer"] = {"device": "auto", "nvme_path": str(tmp_path)}
    if host_budget is not None:
        cfg["memory"] = {"host_budget": host_budget}
    return cfg


def reference(model, data, precision, *, gas=1, clip=0.0, state_on_device=False):
    """Plain PyTorch; state_on_device: the names whose optimizer state the engine's plan
    put on the device (run_reference_mixed steps those where the engine does)."""
    if precision == "fp32":
        return run_reference(model, data, gas=gas, clip=clip, lr=1e-2, weight_decay=0.01)
    return run_reference_mixed(model, data, dtype=torch.bfloat16, gas=gas, lr=1e-2, weight_decay=0.01,
                               state_on_device=state_on_device)


def state_on_device(plan) -> set[str]:
    return {s.name for s in plan.shards if s.state is Tier.DEVICE}


def frozen_and_trainable(model):
    frozen = {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    return frozen, trainable


@pytest.mark.any_device  # Note [the device a test runs on] (tests/conftest.py)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", CONFIGS)
def test_a_lora_model_trains_like_plain_pytorch_on_every_tier(tmp_path, param, optim, precision):
    """Frozen base (a tied embedding and LM head, a position parameter read in the root's
    forward), LoRA adapters and a trainable LayerNorm: losses and every weight equal plain
    PyTorch's (in bf16, the base as a model loaded in bf16 holds it)."""
    model = lora_gpt(dtype=torch.bfloat16 if precision == "bf16" else None)
    data = batches(STEPS, seed=3)
    with offload.initialize(copy.deepcopy(model), config(param, optim, tmp_path, precision=precision)) as engine:
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
        on_device = state_on_device(engine.placement())
    ref_model, ref_losses = reference(model, data, precision, state_on_device=on_device)
    torch.testing.assert_close(losses, ref_losses[:, 0], **exact())
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}", **exact())


@pytest.mark.any_device  # Note [the device a test runs on] (tests/conftest.py)
@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_accumulation_and_clipping_with_frozen_weights_equal_plain_pytorch(tmp_path, param, optim):
    model, data = lora_gpt(), batches(2 * STEPS, seed=5)
    ref_model, ref_losses = reference(model, data, "fp32", gas=2, clip=0.05)
    with offload.initialize(copy.deepcopy(model), config(param, optim, tmp_path, gas=2, clip=0.05)) as engine:
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
    # The global norm sums its terms in another order than torch's: equal to rounding.
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme"), ("auto", "auto")])
def test_a_frozen_weight_costs_its_home_alone_to_the_byte(tmp_path, param, optim, precision):
    """The closed form per element (c: the compute dtype's bytes): a frozen weight c on its
    home tier and nothing else; a trainable one c + 12 + 4 (its home, master and moments,
    fp32 gradient; in fp32 a host home is the master, an NVMe home's file the master of
    NVMe state). Every step writes the trainable state alone to NVMe. auto, with this
    machine's RAM, plans it all on the host: the cpu figures."""
    model = lora_gpt(dtype=torch.bfloat16 if precision == "bf16" else None)
    frozen, trainable = frozen_and_trainable(model)
    c = 4 if precision == "fp32" else 2
    F, T = sum(frozen.values()), sum(trainable.values())
    charged = []
    with offload.initialize(copy.deepcopy(model), config(param, optim, tmp_path, precision=precision)) as engine:
        charge = engine.account.charge
        engine.account.charge = lambda tier, n, what: (charged.append(what), charge(tier, n, what))[1]
        report = engine.account.report()
        stores = engine.swap_stores
        written = sum(s.stats.bytes_written for s in stores)
        train_engine(engine, batches(STEPS, seed=1))
        written = (sum(s.stats.bytes_written for s in stores) - written) / STEPS
        plan = engine.placement()
    if param in ("cpu", "auto"):
        master_in_home = c == 4
        assert report["host"]["now"] == F * c + T * ((0 if master_in_home else c) + 12 + 4)
        assert report["nvme"]["now"] == 0
        assert written == 0
    else:
        shared_master = c == 4
        assert report["nvme"]["now"] == F * c + T * (c + (8 if shared_master else 12))
        assert report["host"]["now"] == 0  # gradients exist only while pending (lazy on NVMe)
        # The new home value and the state written back; nothing of the frozen base.
        assert written == T * (c + (8 if shared_master else 12))
    on_host = param in ("cpu", "auto")
    assert plan.held_bytes()[Tier.HOST if on_host else Tier.NVME] == \
        F * c + T * ((0 if c == 4 and on_host else c) + (8 if c == 4 and not on_host else 12))
    assert not [w for w in charged if any(w.endswith(f"of {name}") for name in frozen)]
    assert {s.name for s in plan.shards if not s.trainable} == set(frozen)


def test_the_sim_carries_the_frozen_base_up_in_its_compute_dtype_only(tmp_path, monkeypatch):
    """With a device budget the adapters and their state go on the device first; the frozen
    base takes what is left there, its overflow going up the bus in bf16 for forward and
    backward, never down: the plan's prediction bounds the bus bytes, which are exactly the
    off-device frozen homes' reads."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    model = lora_gpt(hidden=48, layers=4, dtype=torch.bfloat16)
    frozen, trainable = frozen_and_trainable(model)
    data = batches(STEPS + 2, seed=2)
    ref_model, ref_losses = reference(model, data, "bf16")
    device_budget = 2 * (sum(trainable.values()) * (2 + 16) + sum(frozen.values()) * 2 // 2)
    cfg = config("auto", "auto", tmp_path, precision="bf16")
    cfg["memory"] = {"device_budget": device_budget}
    reads = collections.Counter()  # each shard's copies up, in the timed steps
    prefetch = Shard.prefetch

    def counted(shard):
        if shard.residency is Residency.RELEASED and shard.reads_ahead:
            reads[shard.name] += 1
        prefetch(shard)

    monkeypatch.setattr(Shard, "prefetch", counted)
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        losses = [train_engine(engine, data[:2])]
        plan, counters = engine.placement(), engine.device_layer.counters
        before = counters.bytes_copied
        reads.clear()
        losses.append(train_engine(engine, data[2:]))
        measured = (counters.bytes_copied - before) / STEPS
        weights = engine_weights(engine)
    shards = {s.name: s for s in plan.shards}
    assert all(shards[n].home is Tier.DEVICE and shards[n].state is Tier.DEVICE for n in trainable), plan.format()
    on_device = [n for n in frozen if shards[n].home is Tier.DEVICE]
    assert on_device and len(on_device) < len(frozen), plan.format()  # a split of the base
    off = [n for n in frozen if shards[n].home is not Tier.DEVICE]
    assert plan.moved_per_step()["bus"] == sum(shards[n].part_numel for n in off) * 2 * 2
    # What went up: each off-device frozen home once for forward, and again for backward
    # where backward reads its value (plain PyTorch saves it for backward: a weight whose
    # input needs a gradient; not a bias, nor block 0's qkv, whose input needs none) unless
    # it was kept from forward (Note [reads ahead passed a gathered parameter]). The plan
    # counts two reads of each, a bound. Nothing else crossed the bus, either way.
    read_twice = [n for n in off if n in saved_for_backward(model, data[0][0][0])]
    assert set(off) - set(read_twice)  # the bound is not trivially the figure
    assert set(reads) == set(off), sorted(set(reads) ^ set(off))
    assert all(STEPS <= reads[n] <= STEPS * (1 + (n in read_twice)) for n in off), reads
    assert measured == 2 * sum(shards[n].part_numel * reads[n] for n in off) / STEPS
    assert measured <= plan.moved_per_step()["bus"]
    torch.testing.assert_close(torch.cat(losses), ref_losses[:, 0], rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def saved_for_backward(model, x) -> set[str]:
    """The parameters plain PyTorch's autograd saves for backward in a forward of `x`."""
    model = copy.deepcopy(model)
    by_storage = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
    saved = set()

    def pack(t):
        name = by_storage.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if name is not None:
            saved.add(name)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return saved


def test_the_planner_puts_the_trainable_set_first_and_the_frozen_base_in_what_is_left():
    """Device: trainable homes, their state, then frozen homes, tail first. Host: at equal
    NVMe bytes saved per host byte (a frozen bf16 home, 4 for 2; bf16 state, 24 for 12), the
    trainable move first; only the frozen overflow goes to NVMe."""
    specs = [ParamSpec(f"base{i}", 100, 100, trainable=False) for i in range(6)] + \
        [ParamSpec("lora", 10, 10), ParamSpec("base6", 100, 100, trainable=False)]
    plan = plan_placement(specs, Budgets(device=10 * 2 + 10 * 16 + 100 * 2, host=None),
                          itemsize=2, separate_memory=True, home_tier=None, state_tier=None)
    by = {s.name: s for s in plan.shards}
    assert by["lora"].home is Tier.DEVICE and by["lora"].state is Tier.DEVICE
    assert by["base6"].home is Tier.DEVICE and by["base6"].state is None  # the tail frozen home
    assert all(by[f"base{i}"].home is Tier.HOST for i in range(6))
    assert plan.state_tiers == {Tier.DEVICE}
    # Host: the trainable state first, then frozen homes head first, the rest on NVMe.
    specs = [ParamSpec(f"base{i}", 100, 100, trainable=False) for i in range(4)] + [ParamSpec("lora", 10, 10)]
    plan = plan_placement(specs, Budgets(device=0, host=10 * (2 + 12) + 2 * 100 * 2, nvme_homes=True,
                                         nvme_state=True),
                          itemsize=2, separate_memory=False, home_tier=None, state_tier=None)
    by = {s.name: s for s in plan.shards}
    assert (by["lora"].home, by["lora"].state) == (Tier.HOST, Tier.HOST)
    assert [by[f"base{i}"].home for i in range(4)] == [Tier.HOST, Tier.HOST, Tier.NVME, Tier.NVME]
    moved = plan.moved_per_step()["nvme"]
    assert moved == 2 * 100 * 2 * 2  # two frozen homes read twice, nothing written
    assert plan.held_bytes()[Tier.HOST] == 10 * 14 + 2 * 100 * 2


def test_unfreezing_a_parameter_no_group_lists_is_refused_by_name_and_training_goes_on(tmp_path):
    """Parameter groups given to initialize that leave a frozen weight out: torch's optimizer
    would never step it, so unfreezing it is refused at the next forward, before anything changes."""
    model, data = lora_gpt(), batches(3, seed=1)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": 1e-2}]
    engine = offload.initialize(model, config("cpu", "cpu", tmp_path), param_groups=groups)
    with engine:
        train_engine(engine, data[:1])
        before = engine_weights(engine)
        target = model.blocks[0].qkv.base.weight
        target.requires_grad_(True)
        x, _ = data[1][0]
        with pytest.raises(RuntimeError, match=r"blocks\.0\.qkv\.base\.weight.*in none of the parameter groups"):
            engine(x)
        target.requires_grad_(False)  # put back: the engine goes on as before
        after = engine_weights(engine)
        for key, value in before.items():
            torch.testing.assert_close(after[key], value, rtol=0, atol=0)
        train_engine(engine, data[2:])


def test_a_model_with_every_parameter_frozen_is_refused_at_initialize(tmp_path):
    model = lora_gpt()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="every parameter of the model is frozen"):
        offload.initialize(model, config("cpu", "cpu", tmp_path))


@pytest.mark.parametrize("listed", ["trainable", "all"])
def test_deepspeeds_form_with_frozen_parameters_listed_or_left_out_trains_like_pytorch(tmp_path, listed):
    """model_parameters as PEFT scripts pass it (the trainable ones) or every parameter:
    frozen ones stay in the group, as torch keeps them, with no state."""
    model, data = lora_gpt(), batches(STEPS, seed=7)
    ref_model, ref_losses = reference(model, data, "fp32")
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad] if listed == "trainable" else model.parameters()
    engine, optimizer, _, _ = offload.deepspeed.initialize(model=model, model_parameters=params,
                                                           config=config("nvme", "cpu", tmp_path))
    with engine:
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
        state = optimizer.state_dict()
        n_listed = sum(1 for p in model.parameters() if p.requires_grad or listed == "all")
        assert len(state["param_groups"][0]["params"]) == n_listed
        assert len(state["state"]) == sum(1 for p in model.parameters() if p.requires_grad)
    torch.testing.assert_close(losses, ref_losses[:, 0], rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


# ---- checkpoints --------------------------------------------------------------------
@pytest.mark.any_device  # Note [the device a test runs on] (tests/conftest.py)
@pytest.mark.parametrize("param,optim,precision", [("cpu", "cpu", "fp32"), ("nvme", "nvme", "bf16"),
                                                   ("auto", "auto", "bf16")])
def test_a_checkpoint_without_the_frozen_weights_resumes_bit_for_bit(tmp_path, param, optim, precision):
    model = lora_gpt(dtype=torch.bfloat16 if precision == "bf16" else None)
    frozen, trainable = frozen_and_trainable(model)
    data = batches(2 * STEPS, seed=9)
    cfg = config(param, optim, tmp_path / "nvme", precision=precision)
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        train_engine(engine, data[:STEPS])
        engine.save_checkpoint(tmp_path / "ck", tag="t", exclude_frozen_parameters=True)
        full_losses = train_engine(engine, data[STEPS:])
        full_weights = engine_weights(engine)
        index = {s.name: s.index for s in engine.shards}
    # Nothing of the frozen base was written.
    with safe_open(str(tmp_path / "ck" / "t" / "rank0" / "state.safetensors"), "pt") as f:
        keys = set(f.keys())
    nvme_files = {p.name for p in (tmp_path / "ck" / "t" / "rank0" / "nvme").iterdir()}
    for name in frozen:
        assert f"param.{index[name]}" not in keys and f"param.{index[name]}.swp" not in nvme_files
    assert any(f"exp_avg.{index[n]}" in keys or f"optim.{index[n]}.swp" in nvme_files
               or f"moments.{index[n]}.swp" in nvme_files for n in trainable)
    with offload.initialize(copy.deepcopy(model), cfg) as engine:  # the same base, untrained
        engine.load_checkpoint(tmp_path / "ck", tag="t")
        losses = train_engine(engine, data[STEPS:])
        weights = engine_weights(engine)
    torch.testing.assert_close(losses, full_losses, rtol=0, atol=0)
    for name, value in full_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_a_checkpoint_without_the_frozen_weights_is_refused_on_another_base(tmp_path):
    model = lora_gpt()
    cfg = config("cpu", "cpu", tmp_path)
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        train_engine(engine, batches(2, seed=1))
        engine.save_checkpoint(tmp_path / "ck", exclude_frozen_parameters=True)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.blocks[1].out.weight[3, 4] += 1.0  # one frozen value differs
    with offload.initialize(other, cfg) as engine:
        before = engine_weights(engine)
        with pytest.raises(CheckpointError, match=r"frozen parameter 'blocks.1.out.weight' has other values"):
            engine.load_checkpoint(tmp_path / "ck")
        after = engine_weights(engine)
    for name, value in before.items():  # refused before anything changed
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)
    # Another trainable set: a parameter frozen in the checkpoint trains here.
    unfrozen = copy.deepcopy(model)
    unfrozen.blocks[0].proj.requires_grad_(True)
    with offload.initialize(unfrozen, cfg) as engine:
        with pytest.raises(CheckpointError, match=r"blocks.0.proj.weight"):
            engine.load_checkpoint(tmp_path / "ck")


def test_a_checkpoint_with_its_frozen_weights_loads_them_and_consolidates_them(tmp_path):
    """Saved as usual, frozen weights are in the checkpoint (their home alone) and come back;
    consolidation writes them; without them, it writes the trainable ones and says so."""
    model = lora_gpt(dtype=torch.bfloat16)
    frozen, trainable = frozen_and_trainable(model)
    cfg = config("nvme", "cpu", tmp_path / "nvme", precision="bf16")
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        train_engine(engine, batches(2, seed=1))
        engine.save_checkpoint(tmp_path / "ck", tag="all")
        engine.save_checkpoint(tmp_path / "ck", tag="lean", exclude_frozen_parameters=True)
        weights = engine_weights(engine)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.wte.weight.zero_()
    with offload.initialize(other, cfg) as engine:
        engine.load_checkpoint(tmp_path / "ck", tag="all")
        loaded = engine_weights(engine)
    for name, value in weights.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    whole = offload.consolidate(tmp_path / "ck", tmp_path / "all.safetensors", tag="all", progress=False)
    lean = offload.consolidate(tmp_path / "ck", tmp_path / "lean.safetensors", tag="lean", progress=False)
    with safe_open(str(whole), "pt") as f:
        assert "wte.weight" in set(f.keys())
        torch.testing.assert_close(f.get_tensor("wte.weight"), weights["wte.weight"], rtol=0, atol=0)
        torch.testing.assert_close(f.get_tensor("blocks.0.qkv.lora_A"), weights["blocks.0.qkv.lora_A"],
                                   rtol=0, atol=0)
    with safe_open(str(lean), "pt") as f:
        assert set(f.keys()) == set(trainable)
        assert set(json.loads(f.metadata()["offload.frozen_not_saved"])) == set(frozen)


def test_auto_plans_a_lora_in_ram_where_it_fits_and_spills_only_the_frozen_base(tmp_path):
    """Frozen homes are planned at their real size: with a host budget twice what the LoRA
    needs on the host (base homes, adapters, their state and the engine's buffers) everything
    stays there; with less, only frozen homes go to NVMe, the adapters' state staying in RAM."""
    model = lora_gpt(hidden=96, layers=12, dtype=torch.bfloat16)
    frozen, trainable = frozen_and_trainable(model)
    def reserved(where):  # what initialize reserves on the host with everything `where`
        probe = config(where, where, tmp_path / "probe", precision="bf16", host_budget=1 << 40)
        with offload.initialize(copy.deepcopy(model), probe) as engine:
            note = engine.account.budget_notes[Tier.HOST]
        return int(note.split("initialize reserved ")[1].split(" ")[0])
    most = reserved("cpu")
    data = batches(STEPS, seed=6)
    ref_model, ref_losses = reference(model, data, "bf16")
    # Twice the real need (a LoRA charged like a full fine-tune was planned all on NVMe at
    # this budget), then half the base's bytes short.
    for budget, spills in ((2 * most, False), (most - sum(frozen.values()), True)):
        cfg = config("auto", "auto", tmp_path / str(budget), precision="bf16", host_budget=budget)
        with offload.initialize(copy.deepcopy(model), cfg) as engine:
            losses = train_engine(engine, data)
            plan = engine.placement()
            weights = engine_weights(engine)
        shards = {s.name: s for s in plan.shards}
        on_nvme = [n for n, s in shards.items() if s.home is Tier.NVME]
        assert bool(on_nvme) is spills, plan.format()
        assert set(on_nvme) <= set(frozen), plan.format()
        assert all(shards[n].state is Tier.HOST for n in trainable), plan.format()
        torch.testing.assert_close(losses, ref_losses[:, 0], rtol=0, atol=0)
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_close_hands_the_frozen_host_homes_back_as_they_are_and_frees_what_it_cannot_give(tmp_path, monkeypatch):
    """A frozen host home in the parameter's own dtype becomes the parameter at close, with
    no copy (a LoRA's base needs no memory more to be given back); where the values are not
    given back (they do not fit), the homes and the optimizer state are freed at close, not
    when the model goes."""
    model = lora_gpt(dtype=torch.bfloat16).to(torch.bfloat16)
    cfg = config("cpu", "cpu", tmp_path, precision="bf16")
    engine = offload.initialize(model, cfg)
    train_engine(engine, batches(2, seed=1))
    weights = engine_weights(engine)
    homes = {s.name: s.host_part.data_ptr() for s in engine.shards if not s.trainable}
    engine.close()
    params = dict(model.named_parameters())
    for name, ptr in homes.items():
        assert params[name].data_ptr() == ptr and type(params[name]) is torch.nn.Parameter
    for name, value in weights.items():
        torch.testing.assert_close(params[name].detach().float(), value.to(torch.bfloat16).float(), rtol=0, atol=0)

    import psutil

    model = lora_gpt(dtype=torch.bfloat16)
    engine = offload.initialize(model, config("cpu", "cpu", tmp_path / "b"))
    train_engine(engine, batches(2, seed=1))
    shards, states = engine.shards, engine.optimizer.states._tensors
    available = psutil.virtual_memory()._replace(available=1)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: available)
    engine.close()
    assert all(s.host_part is None for s in shards) and not states
    with pytest.raises(RuntimeError, match="did not fit in memory"):
        model.wte.weight.sum()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_backward_holds_a_frozen_base_on_nvme_a_few_weights_at_a_time(tmp_path, precision):
    """Note [frozen holds in backward]: frozen weights that backward reads again are not
    kept gathered to the end of backward (no gradient hook drops them): the device tier
    holds a few at a time, as in forward, and training is still exact."""
    dtype = torch.bfloat16 if precision == "bf16" else None
    model, data = lora_gpt(hidden=48, layers=8, dtype=dtype), batches(2, seed=8)
    frozen, _ = frozen_and_trainable(model)
    c = 2 if dtype else 4
    ref_model, ref_losses = reference(model, data, precision)
    cfg = config("nvme", "nvme", tmp_path, precision=precision)
    largest = max(frozen.values())
    # Reads ahead of one weight: what is held at once is then the engine's choice, not the prefetcher's.
    cfg["zero_optimization"].update(stage3_prefetch_bucket_size=largest, stage3_max_live_parameters=2 * largest)
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        from tests.support.harness import lm_loss

        losses = []
        for per_rank in data:
            x, y = per_rank[0]
            loss = lm_loss(engine(x), y)
            engine.account.reset_peak()
            at_start = engine.account.usage(Tier.DEVICE).now  # saved activations, what forward left
            engine.backward(loss)
            gathered_in_backward = engine.account.usage(Tier.DEVICE).peak - at_start
            engine.step()
            losses.append(loss.detach().float())
            assert gathered_in_backward <= 4 * largest * c, (gathered_in_backward, sum(frozen.values()) * c)
        weights = engine_weights(engine)
    torch.testing.assert_close(torch.stack(losses), ref_losses[:, 0], rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
