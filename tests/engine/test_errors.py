"""Bad input and misuse fail at once, with messages that name the problem."""

import pytest
import torch

import offload
from offload.config import ConfigError
from tests.support.harness import batches, build, lm_loss, make_config


def test_unknown_config_key_names_it_and_the_closest(tmp_path):
    cfg = make_config("cpu", "cpu", tmp_path)
    cfg["zero_optimization"]["stage3_prefetch_bucket_sz"] = 5
    with pytest.raises(ConfigError, match="stage3_prefetch_bucket_sz.*did you mean 'stage3_prefetch_bucket_size'"):
        offload.initialize(build("shared_param"), cfg)


def test_missing_optimizer_section(tmp_path):
    cfg = make_config("cpu", "cpu", tmp_path)
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="no 'optimizer' section"):
        offload.initialize(build("shared_param"), cfg)


def test_nvme_path_that_is_a_file_fails_at_initialize(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    cfg = make_config("nvme", "nvme", blocker)
    model = build("shared_param")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(Exception, match="not_a_dir"):
        offload.initialize(model, cfg)
    # Nothing was taken from the model before the failure.
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_device_budget_too_small_fails_at_initialize(tmp_path):
    cfg = make_config("none", "none", tmp_path, extra={"memory": {"device_budget": 1000}})
    with pytest.raises(MemoryError, match="device tier budget exceeded"):
        offload.initialize(build("tiny_gpt"), cfg)


def test_step_without_backward_and_backward_without_a_graph(tmp_path):
    (x, y), = batches(1)[0]
    with offload.initialize(build("shared_param"), make_config("cpu", "cpu", tmp_path)) as engine:
        with pytest.raises(RuntimeError, match="step\\(\\) called without a backward since the last step"):
            engine.step()
        with torch.no_grad():
            loss = lm_loss(engine(x), y)
        with pytest.raises(RuntimeError, match="does not require grad"):
            engine.backward(loss)
        with pytest.raises(TypeError, match="scalar loss"):
            engine.backward(torch.ones(3, requires_grad=True))


def test_closed_engine_refuses_work_and_removes_its_files(tmp_path):
    engine = offload.initialize(build("shared_param"), make_config("nvme", "nvme", tmp_path))
    rank_dir, = tmp_path.glob("offload-*/rank0")  # this run's own directory (offload/aio/run_dir.py)
    assert any(rank_dir.iterdir())
    engine.close()
    assert not any(tmp_path.iterdir())
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        engine(torch.zeros(1, 2, dtype=torch.long))


def test_non_float_and_meta_parameters_are_refused(tmp_path):
    model = torch.nn.Linear(3, 3, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        offload.initialize(model, make_config("cpu", "cpu", tmp_path))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        offload.initialize("not a model", make_config("cpu", "cpu", tmp_path))


def test_eval_under_no_grad_and_train_again(tmp_path):
    """Evaluation between steps neither leaks gathered parameters nor changes training."""
    model = build("tiny_gpt")
    data = batches(4, seed=9)
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path)) as engine:
        for i, per_rank in enumerate(data):
            x, y = per_rank[0]
            engine.train()
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            engine.eval()
            with torch.no_grad():
                engine(x)
            assert engine.memory_report()["device"]["now"] == 0
            assert all(s.residency.value == "released" for s in engine.shards)


def test_interrupted_initialize_leaves_no_files_and_restores_the_model(tmp_path, monkeypatch):
    import offload.engine.engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("simulated Ctrl-C at the end of initialize")

    monkeypatch.setattr(offload.engine.engine, "build_scheduler", interrupted)
    cfg = make_config("nvme", "nvme", tmp_path, scheduler={"type": "WarmupLR", "params": {}})
    model = build("shared_param")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(KeyboardInterrupt):
        offload.initialize(model, cfg)
    assert not any(tmp_path.iterdir())
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    assert not model.a._forward_pre_hooks  # hooks removed


def test_a_model_in_eval_mode_trains_through_engine_backward_as_plain_torch(tmp_path):
    """from_pretrained leaves a model in eval mode; plain PyTorch runs backward there, so does the engine."""
    import copy

    from tests.support.harness import engine_weights, run_reference, train_engine

    model, data = build("tiny_gpt").eval(), batches(3, seed=2)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    with offload.initialize(copy.deepcopy(model), make_config("cpu", "cpu", tmp_path)) as engine:
        assert not engine.module.training
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
    torch.testing.assert_close(losses, ref_losses[:, 0], rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0)


def test_steps_per_print_is_seen_without_any_logging_set_up(tmp_path):
    """DeepSpeed's progress line shows by default (its logger has a handler of its own); ours is
    printed where the script configured no logging, and logged where it did."""
    import subprocess
    import sys

    script = f"""
import torch, offload
from tests.support.harness import batches, build, lm_loss, make_config
cfg = make_config("cpu", "cpu", {str(tmp_path)!r}, extra={{"steps_per_print": 2}})
with offload.initialize(build("tiny_gpt"), cfg) as engine:
    for (x, y), in batches(4):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
"""
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300,
                         env={**__import__("os").environ, "OFFLOAD_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line.split(":")[0] for line in out.stdout.splitlines() if "lr" in line] == ["[offload] step 2",
                                                                                     "[offload] step 4"]


def test_a_file_where_a_directory_belongs_is_named(tmp_path):
    from offload.checkpoint_io import CheckpointError

    (tmp_path / "a-file").write_text("x")
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path)) as engine:
        (x, y), = batches(1)[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        with pytest.raises(CheckpointError, match=r"a-file is a file; give a directory"):
            engine.save_checkpoint(tmp_path / "a-file")
    for nvme_path, said in [(tmp_path / "a-file" / "swap", r"a-file is a file, not a folder"),
                            ("/proc/offload-swap", r"no folder can be made in /proc")]:
        with pytest.raises(OSError, match=said):
            offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", nvme_path))


def test_the_nvme_path_folders_initialize_made_go_with_close(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", "swap/run")):
        assert (tmp_path / "swap" / "run").is_dir()
    assert not (tmp_path / "swap").exists()  # relative, made by initialize: removed
    (tmp_path / "mine").mkdir()
    with offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", "mine")):
        pass
    assert (tmp_path / "mine").is_dir()  # the user's own folder stays
