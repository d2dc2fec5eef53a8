"""The build at initialize (offload/engine/build.py): build_shards decides every
home and makes the one ShardContext with nothing moved; the optimizer is built
empty; Built.place moves the parameters home one at a time, each handing its
fp32 value to the optimizer before the next."""
import dataclasses

import pytest
import torch

import offload
from offload.aio.run_dir import RunDirectories
from offload.config import Config
import offload.device
from offload.engine.build import build_shards
from offload.optim.sharded_adam import ShardedAdam
from offload.accounting import MemoryAccount
from offload.transfers.collectives import ProcessGroupInfo
from offload.tiers import Tier
from offload.timeline import Timeline
from tests.support.harness import build, make_config


def test_the_optimizer_places_nothing_and_place_moves_each_parameter_once(tmp_path):
    model = build("tiny_gpt")
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = Config.load(make_config("nvme", "nvme", tmp_path))
    account, run_dirs = MemoryAccount(), RunDirectories()
    layer = offload.device.from_env()
    built = build_shards(model, config, layer=layer, pg=ProcessGroupInfo.current(),
                         account=account, timeline=Timeline(enabled=False), run_dirs=run_dirs)
    opt = config.optimizer
    optimizer = ShardedAdam(built.shards, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                            weight_decay=opt.weight_decay, adamw_mode=True, tier=Tier.NVME,
                            device=layer.device, account=account, state_store=built.state_store,
                            param_store=built.param_writer)
    try:
        assert all(s.ctx is built.ctx for s in built.shards) and built.ctx.param_store is not None
        # Built, optimizer included: every parameter still holds its value, nothing is on NVMe.
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), original[name], rtol=0, atol=0)
        assert account.usage(Tier.NVME).now == 0 and optimizer.param_groups[0]["params"] == []

        taken = []

        def take_master(shard, part):
            assert shard.param.stride() == (0,) * shard.param.dim()  # already home: a placeholder
            taken.append(shard.name)
            torch.testing.assert_close(part[:shard.numel], original[shard.name].reshape(-1), rtol=0, atol=0)
            optimizer.init_state(shard, part)

        built.place(take_master)
        assert taken == [s.name for s in built.shards]
        assert len(optimizer.param_groups[0]["params"]) == len(built.shards)
        for shard in built.shards:
            torch.testing.assert_close(shard.home_partition()[:shard.numel], original[shard.name].reshape(-1))
            torch.testing.assert_close(optimizer.master_partition(shard)[:shard.numel],
                                       original[shard.name].reshape(-1))
    finally:
        optimizer.close()
        for store in built.stores():
            store.close()
        run_dirs.remove()


def test_every_shard_shares_the_engines_one_frozen_context_after_offload_init(tmp_path):
    cfg = make_config("nvme", "nvme", tmp_path)
    with offload.init(cfg):
        model = build("tiny_gpt")
    with offload.initialize(model, cfg) as engine:
        ctx = engine.shard_context
        assert all(s.ctx is ctx for s in engine.shards)  # the adopted build-time shards too
        assert ctx.param_store is not None and ctx.grad_tier is Tier.HOST and ctx.lazy_grads
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.lazy_grads = False
