"""The CPU Adam's threads while it overlaps backward (Note [optimizer threads] in
offload/simd.py): every core but one beside a separate device, one beside a CPU
backward, or offload_optimizer.cpuadam_cores_perc's share; results unchanged."""
import copy
import os

import pytest
import torch

import offload
from offload.config import Config, ConfigError
from offload.optim import sharded_adam
from offload.simd import overlap_threads
from tests.support.harness import batches, build, make_config, run_reference, train_engine


@pytest.mark.parametrize("share,device_apart,expected", [
    (None, True, 15), (None, False, 1), (0.5, True, 8), (0.5, False, 8), (1.0, True, 16), (0.01, True, 1)])
def test_threads_follow_the_cpu_affinity_and_the_share(monkeypatch, share, device_apart, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert overlap_threads(share, device_apart=device_apart) == expected


@pytest.mark.parametrize("value", [0, -0.5, 1.5, "all", True])
def test_a_bad_share_is_refused_naming_the_key(tmp_path, value):
    cfg = make_config("cpu", "cpu", tmp_path)
    cfg["zero_optimization"]["offload_optimizer"]["cpuadam_cores_perc"] = value
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_optimizer\.cpuadam_cores_perc"):
        Config.load(cfg)


@pytest.mark.parametrize("share,layer", [(None, "sim"), (1.0, "sim"), (None, "cpu")])
def test_the_overlapped_updates_run_on_those_threads_and_stay_exact(tmp_path, monkeypatch, share, layer):
    monkeypatch.setenv("OFFLOAD_DEVICE", layer)
    cores = len(os.sched_getaffinity(0))
    expected = overlap_threads(share, device_apart=layer == "sim")
    used = []  # num_threads of each update that ran while backward did
    real = sharded_adam.adam_step

    def recording(*args, num_threads=None, **kwargs):
        used.append(num_threads)
        return real(*args, num_threads=num_threads, **kwargs)

    monkeypatch.setattr(sharded_adam, "adam_step", recording)
    model = build("tiny_gpt")
    data = batches(4, seed=9)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    # nvme state: overlapped on the cpu layer too (host state beside a CPU backward is not)
    cfg = make_config("cpu", "nvme" if layer == "cpu" else "cpu", tmp_path)
    cfg["zero_optimization"]["offload_optimizer"]["cpuadam_cores_perc"] = share
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        assert engine.optimizer.overlap_threads == expected
        losses = train_engine(engine, data)
        weights = engine.full_state_dict(master=True)
    assert expected == (max(1, int(share * cores)) if share else (max(1, cores - 1) if layer == "sim" else 1))
    assert used and expected in used  # the updates started during backward ran on them
    torch.testing.assert_close(losses, ref_losses[:, 0], rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
