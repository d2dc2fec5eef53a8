"""Note [shared fp32 master]: with fp32 parameters and optimizer state both on
NVMe, the parameter's file is the master and the state file holds only the
moments; an overlapped update takes the master from the gathered parameter.
Training still matches plain PyTorch exactly, when the learned "gathered"
set is wrong, and checkpoints move between this layout and the others."""
import copy

import pytest
import torch

import offload
from offload.checkpoint_io.load import read_swap_file
from offload.tiers import Tier
from tests.checkpoint_io import checkpoint_runs as runs
from tests.support.harness import batches, build, make_config, run_reference, train_engine

STEPS = 6


def _assert_matches_reference(engine, losses, ref_model, ref_losses):
    torch.testing.assert_close(losses, ref_losses[:, 0])
    weights = engine.full_state_dict(master=True)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_state_file_holds_only_the_moments_and_masters_come_from_gathered_copies(tmp_path):
    model = build("tiny_gpt")
    data = batches(STEPS, seed=4)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path)) as engine:
        opt = engine.optimizer
        assert all(opt.states.shares_master(s) for s in engine.shards)
        for s in engine.shards:  # two moments, no master
            read_swap_file(opt.states.state_file(s), torch.float32, 2 * s.part_numel)
            with pytest.raises(Exception, match="expected at least"):
                read_swap_file(opt.states.state_file(s), torch.float32, 2 * s.part_numel + 1)
        assert opt.states.state_bytes(opt.shards) == sum(8 * s.part_numel for s in engine.shards)
        losses = train_engine(engine, data)
        # Weights are read by their backward, so their masters came along;
        # a bias's gradient needs no value, so it is never gathered then.
        brought = {engine.shards[i].name for i in engine.step_runner.in_backward.masters_from_gather}
        assert "blocks.0.fc.weight" in brought and "blocks.0.fc.bias" not in brought
        _assert_matches_reference(engine, losses, ref_model, ref_losses)


def test_masters_expected_from_gathered_copies_but_not_brought_are_read(tmp_path):
    """The learned set is wrong on purpose (every shard, biases included, and
    then none): the stream must read what the update does not bring."""
    model = build("tiny_gpt")
    data = batches(STEPS, seed=5)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)

    def mislearn(engine, step):
        everything = frozenset(s.index for s in engine.shards)
        engine.step_runner.in_backward.masters_from_gather = everything if step % 2 else frozenset()

    with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path)) as engine:
        losses = train_engine(engine, data, before_step=mislearn)
        _assert_matches_reference(engine, losses, ref_model, ref_losses)


def test_a_deferred_step_reads_every_master(tmp_path):
    """Gradient clipping defers the updates past backward: nothing is gathered then."""
    model = build("tiny_gpt")
    data = batches(STEPS, seed=6)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.05, lr=1e-2, weight_decay=0.01)
    with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path, clip=0.05)) as engine:
        losses = train_engine(engine, data)
        assert not engine.step_runner.in_backward.masters_from_gather
        _assert_matches_reference(engine, losses, ref_model, ref_losses)


@pytest.mark.parametrize("saved_as,loaded_as", [
    (("nvme", "nvme"), ("cpu", "cpu")),  # the fast part: the shared layout into an own master
    pytest.param(("nvme", "nvme"), ("cpu", "nvme"), marks=pytest.mark.slow),
    pytest.param(("cpu", "cpu"), ("nvme", "nvme"), marks=pytest.mark.slow),
    pytest.param(("nvme", "cpu"), ("nvme", "nvme"), marks=pytest.mark.slow)])
def test_checkpoint_moves_between_shared_and_own_master_layouts(tmp_path, saved_as, loaded_as):
    def engine(tiers, path, seed):
        return offload.initialize(build("tiny_gpt", seed), make_config(*tiers, tmp_path / path))

    runs.seed(0)
    with engine(saved_as, "a", 0) as e:
        runs.train(e, 3)
        e.save_checkpoint(tmp_path / "ck")
        saved = runs.snapshot(e)
        saved_moments = {s.name: _moments(e, s) for s in e.shards}
        runs.seed(1)
        continued = runs.train(e, 2)
    with engine(loaded_as, "b", 7) as fresh:
        fresh.load_checkpoint(tmp_path / "ck")
        loaded = runs.snapshot(fresh)
        for s in fresh.shards:
            torch.testing.assert_close(_moments(fresh, s), saved_moments[s.name], rtol=0, atol=0)
        runs.seed(1)
        resumed = runs.train(fresh, 2)
    for kind in ("master", "home"):
        for name, value in saved[kind].items():
            torch.testing.assert_close(loaded[kind][name], value, rtol=0, atol=0)
    torch.testing.assert_close(resumed, continued, rtol=0, atol=0)


def _moments(engine, shard):
    opt = engine.optimizer
    if Tier.NVME not in opt.states.state_tiers:
        return torch.cat([t.cpu() for t in opt.state_tensors(shard)[1:]])
    own_master = 0 if opt.states.shares_master(shard) else 1
    packed = read_swap_file(opt.states.state_file(shard), torch.float32, (2 + own_master) * shard.part_numel)
    return packed[own_master * shard.part_numel:].clone()


def _bytes_read(engine) -> int:
    return sum(s.stats.bytes_read for s in engine._stores)


def test_on_a_separate_device_masters_come_down_with_their_gradients(tmp_path, monkeypatch):
    """Note [masters down with their gradients]: on the sim (a device with memory of its
    own, every copy checked against stream order) the gathered parameter is the
    device's, so its partition goes down behind the gradient and the update takes
    it: the disk reads each master no more, and training equals plain PyTorch."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    monkeypatch.setenv("OFFLOAD_SIM_GBPS", "5")
    model = build("tiny_gpt")
    data = batches(STEPS, seed=8)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    read = {}
    for brings in (True, False):
        with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path / str(brings))) as engine:
            assert engine.device_layer.name == "sim"
            if not brings:
                engine.manager.to_host.brings_master = lambda shard: False
            counts = []
            losses = train_engine(engine, data, before_step=lambda e, step: counts.append(_bytes_read(e)))
            read[brings] = counts[-1] - counts[-2]  # one whole step, after the first learned the order
            brought = {engine.shards[i].name for i in engine.step_runner.in_backward.masters_from_gather}
            _assert_matches_reference(engine, losses, ref_model, ref_losses)
            if brings:
                assert "blocks.0.fc.weight" in brought
                masters = sum(s.part_numel * 4 for s in engine.shards if s.name in brought)
            else:
                assert not brought
    # The masters that came down are exactly the bytes the disk no longer read.
    assert read[False] - read[True] == masters, read


def test_masters_stay_on_disk_without_room_on_the_device(tmp_path, monkeypatch):
    """A clone the device budget has no room for is not made: the stream reads the master."""
    from offload.accounting import TierBudgetError

    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    model = build("tiny_gpt")
    data = batches(3, seed=9)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path)) as engine:
        account = engine.shards[0].ctx.account
        charge = account.charge

        def no_room_for_masters(tier, nbytes, what):
            if what.startswith("master of"):
                raise TierBudgetError(f"no room for {what}")
            return charge(tier, nbytes, what)

        monkeypatch.setattr(account, "charge", no_room_for_masters)
        losses = train_engine(engine, data)
        assert not engine.step_runner.in_backward.masters_from_gather
        _assert_matches_reference(engine, losses, ref_model, ref_losses)
