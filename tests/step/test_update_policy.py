"""Note [when updates run] (offload/step/update_policy.py): one policy answers when
updates run and what they hold, for the engine and the budgets alike."""
import offload
from offload.config import Config
from offload.step.update_policy import UpdatePolicy
from offload.tiers import Tier
from tests.support.harness import build, make_config


def policy(*, clip=0.0, gas=1, precision="fp32", separate=True, bucket=None, overlap=True, updates=None):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "zero_optimization": {"stage": 3, "overlap_comm": overlap,
                                 **({"reduce_bucket_size": bucket} if bucket else {}),
                                 **({"offload_optimizer": {"overlap_updates": updates}} if updates is not None else {})},
           **({"bf16": {"enabled": True}} if precision == "bf16" else {}),
           **({"fp16": {"enabled": True}} if precision == "fp16" else {})}
    return UpdatePolicy.of(Config.load(cfg), separate_memory=separate)


def test_when_updates_run():
    host, nvme = {Tier.HOST}, {Tier.NVME}
    assert policy().during_backward(host, at_boundary=True)
    assert not policy(separate=False).during_backward(host, at_boundary=True)  # host Adam beside a CPU backward
    assert policy(separate=False).during_backward(nvme, at_boundary=True)  # NVMe transfers to hide
    assert not policy().during_backward(host, at_boundary=False)
    for blocked in (policy(clip=1.0), policy(precision="fp16"), policy(overlap=False)):
        assert not blocked.during_backward(nvme, at_boundary=True)
    assert policy(clip=1.0).deferred(host, [Tier.HOST, Tier.DEVICE])
    assert not policy(clip=1.0).deferred(host, [Tier.NVME])  # a home's write could fail
    assert not policy(clip=1.0).deferred(host | nvme, [Tier.HOST])
    assert policy().updates_free_gradients and not policy(gas=2).updates_free_gradients
    assert not policy(clip=1.0).updates_free_gradients and not policy(precision="fp16").updates_free_gradients


def test_our_key_decides_where_given_and_deepspeeds_overlap_comm_where_not():
    nvme = {Tier.NVME}
    assert policy(overlap=False, updates=True).during_backward(nvme, at_boundary=True)
    assert not policy(overlap=True, updates=False).during_backward(nvme, at_boundary=True)
    assert not policy(overlap=True, updates=False).deferred({Tier.HOST}, [Tier.HOST])
    assert policy(overlap=True).overlap_updates and not policy(overlap=False).overlap_updates
    import pytest

    with pytest.raises(offload.ConfigError, match="overlap_updates: 1 is not true or false"):
        policy(updates=1)


def test_the_optimizers_cap_and_the_budgets_bound_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    p = policy(bucket=1000)
    assert (p.pending_cap(300), p.pending_cap(4000), policy().pending_cap(300)) == (1000, 4000, 600)
    assert p.backlog_bound(300) == 1000 + 600
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "nvme", tmp_path)) as engine:
        largest = max(s.part_numel for s in engine.optimizer.shards)
        assert engine.step_runner.in_backward.pending_grad_elems == engine.step_runner.policy.pending_cap(largest)
