"""The paths users take besides engine(x) / engine.backward / engine.step, each
against plain PyTorch on the same model, batches and seeds (Note [the model
is the interface] in offload/partition/manager.py, Note [the optimizer users
drive] in offload/optim/sharded_adam.py)."""
import copy
import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import offload
from tests.support.harness import (assert_weights, batches, build, engine_weights, lm_loss, make_config,
                                  run_reference)
from tests.support.models import TinyGPT

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)

PLACEMENTS = [("cpu", "cpu"), ("nvme", "nvme")]


@pytest.mark.parametrize("param,optim", PLACEMENTS)
def test_the_model_called_itself_trains_like_pytorch(tmp_path, param, optim):
    model = build("tiny_gpt")
    data = batches(8)
    ref_model, ref_losses = run_reference(model, data, gas=2, clip=0.0, lr=1e-2, weight_decay=0.01)
    model = copy.deepcopy(model)
    losses = []
    with offload.initialize(model, make_config(param, optim, tmp_path, gas=2)) as engine:
        for (x, y), in data:
            loss = lm_loss(model(x), y)  # the user's module, not engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        torch.testing.assert_close(torch.stack(losses), ref_losses[:, 0])
        assert_weights(engine, ref_model, rtol=0, atol=0)


@pytest.mark.parametrize("param,optim", PLACEMENTS)
def test_a_plain_torch_loop_trains_like_pytorch(tmp_path, param, optim):
    # loss.backward() per micro-batch, optimizer.step() / zero_grad() at the boundary,
    # a torch LR scheduler on engine.optimizer: how Trainer and Accelerate drive it.
    gas = 3
    model = build("shared_param")
    data = batches(9, seed=2)
    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 1.0 / (1 + s))
    ref_model, ref_losses = run_reference(model, data, gas=gas, clip=0.0, lr=1e-2, weight_decay=0.01,
                                          scheduler_fn=schedule)
    model = copy.deepcopy(model)
    losses = []
    with offload.initialize(model, make_config(param, optim, tmp_path)) as engine:
        opt = engine.optimizer
        assert isinstance(opt, torch.optim.Optimizer)
        sched = schedule(opt)
        for i, ((x, y),) in enumerate(data):
            loss = lm_loss(model(x), y)
            (loss / gas).backward()
            losses.append(loss.detach())
            if (i + 1) % gas == 0:
                opt.step()
                opt.zero_grad()
                sched.step()
        torch.testing.assert_close(torch.stack(losses), ref_losses[:, 0])
        assert_weights(engine, ref_model, rtol=0, atol=0)
        assert engine.global_steps == len(data) // gas


def test_several_backward_calls_before_one_engine_step_accumulate(tmp_path):
    model = build("tiny_gpt")
    data = batches(6, seed=5)
    # Plain PyTorch: two backward calls, then one step, each pair of batches.
    ref_model, _ = run_reference(model, data, gas=2, clip=0.0, lr=1e-2, weight_decay=0.01)
    model = copy.deepcopy(model)
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path)) as engine:
        for i, ((x, y),) in enumerate(data):
            (lm_loss(model(x), y) / 2).backward()
            if i % 2 == 1:
                engine.step()  # gradient_accumulation_steps 1: every step() is a boundary
        assert_weights(engine, ref_model, rtol=0, atol=0)


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks run under a checkpoint function, as Hugging Face's
    gradient_checkpointing_enable does (functools.partial(torch checkpoint, ...))."""

    checkpoint_fn = None

    def forward(self, idx):
        h = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            h = self.checkpoint_fn(block.__call__, h)
        return torch.nn.functional.linear(self.ln_f(h), self.wte.weight)


def _checkpointed(kind):
    torch.manual_seed(0)
    model = CheckpointedGPT()
    if kind == "offload":
        model.checkpoint_fn = offload.checkpoint
    else:
        model.checkpoint_fn = functools.partial(torch_checkpoint.checkpoint, use_reentrant=kind == "reentrant")
    return model


@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant", "offload"])
@pytest.mark.parametrize("param,optim", PLACEMENTS)
def test_any_checkpoint_function_gives_pytorchs_gradients(tmp_path, kind, param, optim):
    model = _checkpointed(kind)
    data = batches(6, seed=7)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    model = copy.deepcopy(model)
    losses = []
    with offload.initialize(model, make_config(param, optim, tmp_path)) as engine:
        for step, ((x, y),) in enumerate(data):
            forward = model if step % 2 else engine  # both entries
            loss = lm_loss(forward(x), y)
            loss.backward()
            engine.step()
            losses.append(loss.detach())
        torch.testing.assert_close(torch.stack(losses), ref_losses[:, 0])
        assert_weights(engine, ref_model, rtol=0, atol=0)
        # Nothing stays gathered between steps: every hold was given back.
        assert all(not s.held for s in engine.shards)


@pytest.mark.parametrize("param,optim,precision", [("cpu", "cpu", "fp32"), ("nvme", "nvme", "fp32"),
                                                   ("nvme", "nvme", "bf16")])
def test_optimizer_and_model_state_dicts_resume_exactly(tmp_path, param, optim, precision):
    # What Trainer's checkpoints hold: model.state_dict() and optimizer.state_dict(),
    # through torch.save; resumed into a new engine, training goes on bit for bit.
    data = batches(6, seed=11)

    def run(model, engine, part):
        for (x, y), in part:
            lm_loss(model(x), y).backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad()

    model = build("tiny_gpt")
    with offload.initialize(model, make_config(param, optim, tmp_path / "a", precision=precision)) as engine:
        run(model, engine, data)
        expected = engine_weights(engine)
    model = build("tiny_gpt")
    with offload.initialize(model, make_config(param, optim, tmp_path / "b", precision=precision)) as engine:
        assert engine.optimizer.state_dict()["state"] == {}  # torch's: nothing before the first step
        run(model, engine, data[:3])
        torch.save({"model": model.state_dict(), "optim": engine.optimizer.state_dict()}, tmp_path / "ck.pt")
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    model = build("tiny_gpt", seed=3)
    with offload.initialize(model, make_config(param, optim, tmp_path / "c", precision=precision)) as engine:
        model.load_state_dict(saved["model"])
        engine.optimizer.load_state_dict(saved["optim"])
        run(model, engine, data[3:])
        for name, value in engine_weights(engine).items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_fp16_refuses_gradients_or_steps_outside_the_engine(tmp_path):
    (x, y), = batches(1)[0]
    cfg = make_config("cpu", "cpu", tmp_path, extra={"fp16": {"enabled": True}})
    with offload.initialize(build("tiny_gpt"), cfg) as engine:
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(RuntimeError, match="fp16 with loss scaling: engine.optimizer.step"):
            engine.optimizer.step()
        lm_loss(engine(x), y).backward()  # not loss-scaled
        with pytest.raises(RuntimeError, match="1 backward pass\\(es\\) ran outside engine.backward"):
            engine.step()
