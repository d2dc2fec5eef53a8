"""transformers.Trainer through the engine (examples/hf_trainer.py's route): the
same losses as plain Trainer, a saved model from_pretrained loads, and Trainer's
own checkpoints resume exactly. Skipped without transformers and accelerate."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from tests.support.layer_under_test import exact, test_device

pytestmark = [pytest.mark.any_device, pytest.mark.torch_release]  # Note [the device a test runs on] (tests/conftest.py)
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["nvme", "auto"])  # auto: Note [automatic placement]
def test_the_example_matches_plain_trainer_and_its_model_reloads(tmp_path, where):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--steps", "6", "--compare",
                          "--out", str(tmp_path / "run"), "--nvme-path", str(tmp_path / "nvme"), "--offload", where],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(summary["losses"]) == len(summary["plain_losses"]) == 6
    # Bit for bit: the same parameter groups and torch's default AdamW arithmetic (on a
    # GPU plain Trainer's AdamW steps there: equal to fp32 rounding, tests/support/layer_under_test.py).
    torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64),
                               torch.tensor(summary["plain_losses"], dtype=torch.float64), **exact())
    assert summary["reloaded_max_abs_logit_diff"] == 0.0
    if where == "nvme":
        assert summary["nvme_bytes_moved"] > 0
    else:  # ample RAM here: everything planned on the host
        assert summary["nvme_bytes_moved"] == 0


def _model():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _decay_groups(model):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from hf_trainer import decay_groups
    finally:
        sys.path.pop(0)
    return decay_groups(model)


def _nvme_config(path) -> dict:
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": {"device": "nvme", "nvme_path": str(path)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}}


def _data():
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (12,), generator=gen) for _ in range(48)]
    return [{"input_ids": r, "labels": r} for r in rows]


def _args(out, **kw):
    return transformers.TrainingArguments(
        str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=8, learning_rate=2e-3,
        weight_decay=0.01, max_grad_norm=0.5, optim="adamw_torch", logging_steps=1, save_strategy="steps", save_steps=4,
        report_to=[], use_cpu=test_device().type == "cpu", seed=0, data_seed=0, disable_tqdm=True, dataloader_drop_last=True, **kw)


def _train(tmp_path, name, resume=None, stop_after=None):
    model = _model()
    cfg = _nvme_config(tmp_path / f"nvme-{name}")
    groups = _decay_groups(model)  # Trainer's own split, as examples/hf_trainer.py passes it
    engine = offload.initialize(model, cfg, param_groups=groups)
    with engine:
        schedule = transformers.get_linear_schedule_with_warmup(engine.optimizer, 0, 8)
        callbacks = [] if stop_after is None else [_StopAt(stop_after)]
        trainer = transformers.Trainer(model=model, args=_args(tmp_path / "run"), train_dataset=_data(),
                                       optimizers=(engine.optimizer, schedule), callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        weights = engine.full_state_dict(master=True)
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    return weights, losses


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


@pytest.mark.slow
def test_trainer_checkpoints_resume_exactly_and_clipping_matches_plain_trainer(tmp_path):
    # Plain Trainer, max_grad_norm 0.5 (clipping active), for the losses.
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "plain"), train_dataset=_data())
    plain.train()
    plain_losses = {e["step"]: e["loss"] for e in plain.state.log_history if "loss" in e}
    full_weights, full_losses = _train(tmp_path, "full")
    assert full_losses.keys() == plain_losses.keys()
    torch.testing.assert_close(list(full_losses.values()), list(plain_losses.values()), **exact())
    # Stopped after Trainer's checkpoint at step 4, then resumed from it in a new engine.
    _train(tmp_path, "first", stop_after=4)
    assert (tmp_path / "run" / "checkpoint-4" / "optimizer.pt").exists()
    resumed_weights, resumed_losses = _train(tmp_path, "resumed", resume=str(tmp_path / "run" / "checkpoint-4"))
    assert set(resumed_losses) == set(full_losses)  # Trainer's state keeps steps 1-4's logs
    for step in (5, 6, 7, 8):  # trained after the resume
        assert resumed_losses[step] == full_losses[step]
    for name, value in full_weights.items():
        torch.testing.assert_close(resumed_weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")  # same recipe


def _accelerate_loop(model, optimizer, scheduler, data, accumulation=2):
    import accelerate

    accelerator = accelerate.Accelerator(cpu=test_device().type == "cpu", gradient_accumulation_steps=accumulation)
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, norms = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
    accelerator.free_memory()
    return torch.stack(losses).cpu(), norms


@pytest.mark.slow
def test_an_accelerate_loop_matches_the_same_loop_on_plain_pytorch(tmp_path):
    data = _data()[:16]
    plain = _model()
    opt = torch.optim.AdamW(plain.parameters(), lr=2e-3, weight_decay=0.01)
    ref_losses, ref_norms = _accelerate_loop(plain, opt, torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, 8), data)
    model = _model()
    cfg = _nvme_config(tmp_path)
    with offload.initialize(model, cfg) as engine:
        sched = torch.optim.lr_scheduler.LinearLR(engine.optimizer, 1.0, 0.1, 8)
        losses, norms = _accelerate_loop(model, engine.optimizer, sched, data)
        weights = engine.full_state_dict(master=True)
    torch.testing.assert_close(losses, ref_losses, **exact())
    torch.testing.assert_close(norms, ref_norms, **exact())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name].cpu(), p.detach().cpu(), **exact(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("reentrant", [True, False])
def test_hugging_face_gradient_checkpointing_gives_pytorchs_weights(tmp_path, reentrant):
    data = _data()[:6]

    def steps(model, step):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
        model.train()
        for i in range(0, len(data), 2):
            batch = {k: torch.stack([d[k] for d in data[i:i + 2]]).to(test_device()) for k in data[0]}
            model(**batch).loss.backward()
            step()

    plain = _model().to(test_device())
    opt = torch.optim.AdamW(plain.parameters(), lr=2e-3, weight_decay=0.01)
    steps(plain, lambda: (opt.step(), opt.zero_grad()))
    model = _model()
    cfg = _nvme_config(tmp_path)
    with offload.initialize(model, cfg) as engine:
        steps(model, engine.step)
        weights = engine.full_state_dict(master=True)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name].cpu(), p.detach().cpu(), **exact(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("cpu_checkpointing", [False, True], ids=["device", "cpu_checkpointing"])
@pytest.mark.parametrize("hf_reentrant", [None, False, True], ids=["alone", "in-hf-nonreentrant", "in-hf-reentrant"])
def test_the_engines_checkpointing_of_llama_decoder_layers_gives_pytorchs_weights(tmp_path, cpu_checkpointing,
                                                                                  hf_reentrant):
    """activation_checkpointing.modules on a Hugging Face class (LlamaDecoderLayer), alone
    or inside HF's own gradient checkpointing: the torch-release-sensitive path (Note
    [recompute across torch releases]) on a real model, bit for bit against plain PyTorch."""
    data = _data()[:6]

    def steps(model, step):
        if hf_reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": hf_reentrant})
            model.enable_input_require_grads()
        model.train()
        losses = []
        for i in range(0, len(data), 2):
            batch = {k: torch.stack([d[k] for d in data[i:i + 2]]).to(test_device()) for k in data[0]}
            loss = model(**batch).loss
            loss.backward()
            step()
            losses.append(loss.detach().cpu())
        return torch.stack(losses)

    plain = _model().to(test_device())
    opt = torch.optim.AdamW(plain.parameters(), lr=2e-3, weight_decay=0.01)
    ref_losses = steps(plain, lambda: (opt.step(), opt.zero_grad()))
    model = _model()
    cfg = _nvme_config(tmp_path)
    cfg["activation_checkpointing"] = {"modules": ["LlamaDecoderLayer"], "cpu_checkpointing": cpu_checkpointing,
                                       "profile": True}
    with offload.initialize(model, cfg) as engine:
        losses = steps(model, engine.step)
        weights = engine.full_state_dict(master=True)
        assert engine.activation_checkpointing.wrapped == 2
        recomputed = engine.activation_checkpointing.saver.timings["recomputations"]
    torch.testing.assert_close(losses, ref_losses, **exact())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name].cpu(), p.detach().cpu(), **exact(), msg=lambda m: f"{name}: {m}")
    # Inside HF's reentrant checkpoint the layers' forward runs without grad, so
    # the engine has nothing to save and recomputes nothing of its own.
    assert (recomputed == 0) if hf_reentrant else (recomputed > 0), recomputed
