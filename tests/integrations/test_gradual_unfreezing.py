"""Gradual unfreezing of a Hugging Face Llama (Note [unfreezing] in offload/engine/unfreeze.py):
the embeddings and the first decoder layer frozen at initialize, unfrozen at step 3, train as
plain PyTorch trains them, in a user's own loop and under Trainer with a callback."""
import copy

import pytest
import torch

import offload
from tests.support.layer_under_test import exact, test_device

pytestmark = [pytest.mark.any_device]
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

UNFREEZE_AT = 3


def _model():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _frozen_names(model):
    return [n for n, _ in model.named_parameters() if n.startswith(("model.embed_tokens", "model.layers.0."))]


def _freeze(model, frozen, on):
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(not on)


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 12), generator=gen) for _ in range(n)]


def _config(tmp_path, place):
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                                  "offload_param": {"device": place, "nvme_path": str(tmp_path)},
                                  "offload_optimizer": {"device": place, "nvme_path": str(tmp_path)}}}


@pytest.mark.parametrize("place", ["cpu", "nvme", "auto"])
def test_a_llama_unfrozen_at_step_3_in_a_users_loop_trains_as_plain_pytorch(tmp_path, place):
    model = _model()
    frozen = _frozen_names(model)
    batches = _batches(6)
    ref = copy.deepcopy(model).to(test_device())
    _freeze(ref, frozen, True)
    opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.01, foreach=False)
    ref_losses = []
    for i, ids in enumerate(batches):
        if i == UNFREEZE_AT:
            _freeze(ref, frozen, False)
        loss = ref(input_ids=ids.to(test_device()), labels=ids.to(test_device())).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    _freeze(model, frozen, True)
    with offload.initialize(model, _config(tmp_path, place)) as engine:
        states = {}
        losses = []
        for i, ids in enumerate(batches):
            if i == UNFREEZE_AT:
                states["before"] = {s.name: s.state for s in engine.placement().shards}
                _freeze(model, frozen, False)
            ids = ids.to(engine.device)
            loss = model(input_ids=ids, labels=ids).loss  # the user's own loop: no engine call
            loss.backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad()
            losses.append(loss.item())
        states["after"] = {s.name: s.state for s in engine.placement().shards}
        weights = engine.full_state_dict(master=True)
    assert all(states["before"][n] is None for n in frozen) and all(states["after"][n] for n in frozen)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **exact())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name].cpu(), p.detach().cpu(), **exact(), msg=lambda m: f"{name}: {m}")


class _Unfreeze(transformers.TrainerCallback):
    def __init__(self, model, frozen):
        self.model, self.frozen = model, frozen

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == UNFREEZE_AT:
            _freeze(self.model, self.frozen, False)


def _trainer(model, optimizer, out, frozen):
    rows = [{"input_ids": ids[0], "labels": ids[0]} for ids in _batches(24)]
    args = transformers.TrainingArguments(
        str(out), per_device_train_batch_size=2, max_steps=6, learning_rate=2e-3, weight_decay=0.01,
        max_grad_norm=0.0, optim="adamw_torch", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=test_device().type == "cpu", seed=0, data_seed=0, disable_tqdm=True, lr_scheduler_type="constant")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, optimizers=(optimizer, None),
                                   callbacks=[_Unfreeze(model, frozen)])
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.slow
def test_a_llama_unfrozen_by_a_trainer_callback_trains_as_plain_trainer(tmp_path):
    plain = _model()
    frozen = _frozen_names(plain)
    _freeze(plain, frozen, True)
    # Every parameter in the optimizer, frozen ones too, so that unfreezing trains them
    # (Trainer's own optimizer leaves out what is frozen when it is made).
    plain_losses = _trainer(plain, torch.optim.AdamW(plain.parameters(), lr=2e-3, weight_decay=0.01,
                                                      foreach=False), tmp_path / "plain", frozen)
    model = _model()
    _freeze(model, frozen, True)
    with offload.initialize(model, _config(tmp_path / "nvme", "cpu")) as engine:
        losses = _trainer(model, engine.optimizer, tmp_path / "ours", frozen)
        weights = engine.full_state_dict(master=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), **exact())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name].cpu(), p.detach().cpu(), **exact(), msg=lambda m: f"{name}: {m}")


def test_a_from_pretrained_llama_in_eval_mode_trains_through_engine_backward_as_plain_pytorch(tmp_path):
    """from_pretrained returns the model in eval mode; plain PyTorch trains it so, and so does the engine."""
    _model().save_pretrained(tmp_path / "llama")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    assert not model.training
    ref = copy.deepcopy(model).to(test_device())
    opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.01, foreach=False)
    batches, ref_losses, losses = _batches(3), [], []
    for ids in batches:
        loss = ref(input_ids=ids.to(test_device()), labels=ids.to(test_device())).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    with offload.initialize(model, _config(tmp_path / "nvme", "cpu")) as engine:
        for ids in batches:
            ids = ids.to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **exact())
