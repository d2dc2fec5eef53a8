"""The step runner alone (offload/step/runner.py), on stand-ins for the parts it is
given: the counters and the accumulation window, the boundary override, a failed
update and its retry, fp16's overflow skip and its refusal of a user's own
optimizer.step(), what a checkpoint takes of it and gives back. The engine-level
runs (tests/engine/test_parity.py and the rest) show the same against plain PyTorch."""
import pytest
import torch

from offload.config import Config
from offload.host_worker import HostWorker
from offload.step.loss_scaler import LossScaler
from offload.step.phase import StepPhase
from offload.step.runner import StepRunner
from offload.step.update_policy import UpdatePolicy
from offload.tiers import Tier
from offload.timeline import Timeline


class Gradient:
    """A shard's gradient partition, as the runner sees it (partition/shard_gradient.py)."""

    def __init__(self, n):
        self.part, self.pending, self.tier = torch.zeros(n), False, Tier.HOST

    def take(self, grad, owned=False):
        self.part += grad
        self.pending = True

    def clear(self, applied=False):
        self.part.zero_()
        self.pending = False


class Shard:
    def __init__(self, n):
        self.part_numel, self.home, self.trainable = n, Tier.HOST, True
        self.gradient = Gradient(n)


class Manager:
    to_host = None
    backward_passes = 0

    def backward(self, shards, value=1.0):
        """What a backward leaves: each shard's gradient, one more pass counted."""
        for s in shards:
            s.gradient.take(torch.full((s.part_numel,), value))
        self.backward_passes += 1


class Optimizer:
    """Records the updates; `fail` makes the next one raise."""

    state_tiers = frozenset({Tier.HOST})  # where the state lives (ShardedAdam.states)

    def __init__(self, shards):
        self.shards, self.grad_sq, self.states = shards, 0.0, self
        self.param_groups = [{"lr": 0.1}]
        self.updates, self.fail, self.runner = [], None, None

    def update(self):
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        self.updates.append([s.gradient.part.clone() for s in self.shards if s.gradient.pending])

    def step(self):  # the driver: ShardedAdam.step hands the whole update to the runner
        self.runner.update()


class ProcessGroup:
    world_size, rank, replicas, job_size, job_rank = 1, 0, 1, 1, 0  # ProcessGroupInfo: one process

    def any_flag(self, flag, device):
        return flag


class Store:
    def __init__(self):
        self.rewrites = 0

    def rewrite_unwritten(self):
        self.rewrites += 1


def runner(gas=1, precision="fp32", clip=0.0, stores=()):
    config = Config.load({"gradient_accumulation_steps": gas, "gradient_clipping": clip,
                          "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                          **({"fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1}} if precision == "fp16" else {})})
    shards = [Shard(3), Shard(5)]
    manager, optimizer = Manager(), Optimizer(shards)
    made = StepRunner(config=config, shards=shards, pg=ProcessGroup(), device=torch.device("cpu"), account=None,
                      timeline=Timeline(enabled=False), manager=manager, optimizer=optimizer,
                      policy=UpdatePolicy.of(config, separate_memory=False), stores=list(stores),
                      uses_nvme=False, loss_scaler=LossScaler.of(config), lr_scheduler=None,
                      before_update=lambda: None, host_worker=HostWorker())
    optimizer.runner = made
    return made, shards, manager, optimizer


def test_an_accumulation_window_updates_once_at_its_end_with_every_micro_batchs_gradient():
    r, shards, manager, opt = runner(gas=2)
    with pytest.raises(RuntimeError, match="without a backward"):
        r.step()
    manager.backward(shards, 1.0)
    r.step()
    assert (opt.updates, r.counters.micro_in_window, r.step_applied, r.gradients_pending) == ([], 1, False, True)
    manager.backward(shards, 2.0)
    r.step()
    assert len(opt.updates) == 1 and r.step_applied and not r.gradients_pending
    torch.testing.assert_close(opt.updates[0][1], torch.full((5,), 3.0))  # both micro-batches' sum
    c = r.counters
    assert (c.global_steps, c.micro_steps, c.micro_in_window) == (1, 2, 0)


def test_the_boundary_override_decides_instead_of_the_count():
    r, shards, manager, opt = runner(gas=4)
    r.boundary = True
    manager.backward(shards)
    r.step()
    assert len(opt.updates) == 1 and r.counters.global_steps == 1
    r.boundary = False
    assert not r.is_boundary()
    r.boundary = None
    assert not r.is_boundary()  # micro-step 1 of 4 again, by the count


def test_a_failed_update_refuses_forward_and_is_retried_by_step():
    store = Store()
    r, shards, manager, opt = runner(stores=[store])
    manager.backward(shards)
    opt.fail = OSError("disk full")
    with pytest.raises(OSError, match="disk full") as raised:
        r.step()
    assert any("retries this step" in note for note in raised.value.__notes__)
    assert r.phase is StepPhase.FAILED and r.counters.global_steps == 0
    with pytest.raises(RuntimeError, match="after a failed engine.step"):
        r.forward_starts()
    with pytest.raises(RuntimeError, match="after a failed engine.step"):
        r.refuse_after_failed_step("save_checkpoint")
    r.step()  # the retry: the kept values written first, then the update
    assert store.rewrites == 1 and len(opt.updates) == 1
    assert r.phase is StepPhase.READY and r.counters.global_steps == 1 and r.step_applied


def test_fp16_skips_an_overflowed_step_and_refuses_a_users_own_optimizer_step():
    r, shards, manager, opt = runner(precision="fp16")
    scale = r.loss_scaler.scale
    manager.backward(shards, float("inf"))
    r.counters.scaled_passes += 1  # engine.backward scaled it
    r.step()
    assert opt.updates == [] and r.counters.skipped_steps == 1 and not r.step_applied
    assert r.loss_scaler.scale < scale and not r.gradients_pending
    manager.backward(shards, scale)
    r.counters.scaled_passes += 1
    r.step()  # unscaled with the scale backward used
    torch.testing.assert_close(opt.updates[0][0], torch.full((3,), scale / r.loss_scaler.scale))
    manager.backward(shards)
    with pytest.raises(RuntimeError, match="engine.optimizer.step\\(\\) was called"):
        opt.step()  # straight from a user's loop: no unscaling, no overflow check


def test_a_checkpoint_takes_the_counters_and_scale_and_gives_them_back():
    r, shards, manager, opt = runner(gas=2, precision="fp16")
    with pytest.raises(RuntimeError, match="call engine.step\\(\\) first"):
        manager.backward(shards)
        r.refuse_save_mid_step()  # a backward that no step() counted yet
    r.counters.scaled_passes += 1
    r.step()
    r.refuse_save_mid_step()  # inside the window, after step(): saved with its gradients
    saved = r.state_dict()
    assert saved["micro_in_window"] == 1 and saved["loss_scaler"] is not None
    into, *_ = runner(gas=2, precision="fp16")
    into.loss_scaler.scale = 1.0
    into.load_state_dict(saved, window=True, steps=True, loss_scale=True)
    assert into.state_dict() == saved
    fresh, *_ = runner(gas=2, precision="fp16")
    fresh.load_state_dict(saved, window=False, steps=False, loss_scale=False)
    assert fresh.counters.micro_in_window == 0 and fresh.counters.micro_steps == 0
