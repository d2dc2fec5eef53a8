"""PEFT as users run it (Note [frozen parameters] in offload/placement.py): a LoRA
(with modules_to_save) and an IA3 adapter from `peft.get_peft_model` on a Hugging
Face Llama train through the engine exactly as plain PEFT on plain PyTorch, in
their own loop, with Trainer and Accelerate, under gradient checkpointing, built
under offload.init or loaded with weights=; `model.save_pretrained` writes the
adapter and `merge_and_unload()` after close gives the merged weights. Skipped
without transformers and peft."""
import copy

import pytest
import torch

import offload
from offload.optim import CPUAdam
from offload.tiers import Tier
from tests.support.layer_under_test import exact, test_device

pytestmark = [pytest.mark.any_device, pytest.mark.torch_release]  # Note [the device a test runs on] (tests/conftest.py)
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LR, WD = 2e-3, 0.01


def base_model(dtype=torch.float32):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def lora(model, **kw):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          modules_to_save=["lm_head"], init_lora_weights="gaussian", **kw)
    # autocast_adapter_dtype=False: the adapters in the model's dtype, as the engine computes
    # every parameter in its compute dtype (PEFT's default keeps bf16 adapters in fp32).
    return peft.get_peft_model(model, cfg, autocast_adapter_dtype=False)


def ia3(model):
    return peft.get_peft_model(model, peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                     feedforward_modules=["down_proj"]))


def batches(n=6, batch=2):
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 64, (n * batch, 12), generator=gen)
    return [{"input_ids": rows[i:i + batch], "labels": rows[i:i + batch]} for i in range(0, len(rows), batch)]


def config(where, path, *, precision="fp32", gas=1, clip=0.0):
    side = ({"device": where, "nvme_path": str(path)} if where in ("nvme", "auto") else {"device": where})
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": dict(side), "offload_optimizer": dict(side)}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def plain_run(model, data, *, gas=1, clip=0.0, mixed=False, state_on_device=False):
    """Plain PEFT on plain PyTorch: AdamW over the trainable parameters (torch's; in bf16 an
    fp32 master of each, stepped where the engine steps it: on the host by CPUAdam, equal to
    torch's AdamW element by element; with state_on_device on a GPU by torch's fused AdamW
    there, as the engine's state on the device is)."""
    model = model.to(test_device())
    trainable = [p for p in model.parameters() if p.requires_grad]
    on_gpu = state_on_device and test_device().type == "cuda"
    masters = ([p.detach().float().to("cuda" if on_gpu else "cpu").requires_grad_() for p in trainable] if mixed
               else trainable)
    if not mixed:
        opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD)
    elif on_gpu:
        opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    else:
        opt = CPUAdam(masters, lr=LR, weight_decay=WD)
    losses = []
    for i, batch in enumerate(data):
        loss = model(**{k: v.to(test_device()) for k, v in batch.items()}).loss
        (loss / gas).backward()
        losses.append(loss.detach().float().cpu())
        if (i + 1) % gas:
            continue
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        if mixed:
            for m, p in zip(masters, trainable):
                m.grad = p.grad.float().to(m.device)
        opt.step()
        opt.zero_grad()
        model.zero_grad(set_to_none=True)
        if mixed:
            with torch.no_grad():
                for m, p in zip(masters, trainable):
                    p.copy_(m)
    weights = {n: (m if mixed else p).detach().float().cpu() for (n, p), m in
               zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], masters)}
    return torch.stack(losses), weights


def engine_run(engine, model, data):
    losses = []
    for batch in data:
        loss = model(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float().cpu())
    trained = {s.name for s in engine.shards if s.trainable}
    weights = {n: v for n, v in engine.full_state_dict(master=True).items() if n in trained}
    return torch.stack(losses), weights


def assert_same(got, want, **tolerance):
    (losses, weights), (ref_losses, ref_weights) = got, want
    tolerance = tolerance or exact()
    torch.testing.assert_close(losses, ref_losses, **tolerance)
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, msg=lambda m: f"{name}: {m}", **tolerance)


@pytest.mark.parametrize("where,precision", [("cpu", "fp32"), ("nvme", "fp32"), ("nvme", "bf16"), ("auto", "bf16")])
def test_a_lora_with_modules_to_save_in_your_own_loop_equals_plain_peft(tmp_path, where, precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = lora(base_model(dtype))
    data = batches()
    reference = copy.deepcopy(model)
    with offload.initialize(model, config(where, tmp_path, precision=precision)) as engine:
        got = engine_run(engine, model, data)
        plan = engine.placement()
    on_device = {s.state for s in plan.shards if s.trainable}
    assert len(on_device) == 1, plan.format()  # one reference optimizer: all on the device or none
    want = plain_run(reference, data, mixed=precision == "bf16", state_on_device=Tier.DEVICE in on_device)
    assert_same(got, want)
    frozen = [s for s in plan.shards if not s.trainable]
    assert frozen and all(s.state is None for s in frozen)
    assert {s.name for s in plan.shards if s.trainable} == set(want[1])


def test_accumulation_and_clipping_of_a_lora_equal_plain_peft(tmp_path):
    model, data = lora(base_model()), batches(8)
    want = plain_run(copy.deepcopy(model), data, gas=2, clip=0.05)
    with offload.initialize(model, config("nvme", tmp_path, gas=2, clip=0.05)) as engine:
        got = engine_run(engine, model, data)
    assert_same(got, want, rtol=1.3e-6, atol=1e-7)  # the global norm sums in another order


def test_an_ia3_adapter_equals_plain_peft(tmp_path):
    model, data = ia3(base_model()), batches()
    want = plain_run(copy.deepcopy(model), data)
    with offload.initialize(model, config("cpu", tmp_path)) as engine:
        got = engine_run(engine, model, data)
    assert_same(got, want)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_lora_under_hugging_face_gradient_checkpointing_equals_plain_peft(tmp_path, reentrant):
    def prepared():
        model = lora(base_model())
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
        model.train()
        return model
    data = batches(4)
    want = plain_run(prepared(), data)
    model = prepared()
    with offload.initialize(model, config("nvme", tmp_path)) as engine:
        got = engine_run(engine, model, data)
    assert_same(got, want)


def trainer_args(out, **kw):
    return transformers.TrainingArguments(
        str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, learning_rate=LR,
        weight_decay=WD, max_grad_norm=0.5, optim="adamw_torch", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=test_device().type == "cpu", seed=0, data_seed=0, disable_tqdm=True,
        dataloader_drop_last=True, **kw)


def trainer_rows():
    return [{"input_ids": r, "labels": r} for b in batches(8) for r in b["input_ids"]]


def test_trainer_with_a_lora_equals_plain_trainer(tmp_path):
    """Trainer makes its optimizer over the trainable parameters (decay and no-decay groups);
    the engine's optimizer takes their place, as examples/hf_trainer.py passes it."""
    plain = transformers.Trainer(model=lora(base_model()), args=trainer_args(tmp_path / "plain"),
                                 train_dataset=trainer_rows())
    plain.train()
    want = [e["loss"] for e in plain.state.log_history if "loss" in e]
    model = lora(base_model())
    decay = transformers.trainer_pt_utils.get_parameter_names(model, [torch.nn.LayerNorm, transformers.models.llama.
                                                                      modeling_llama.LlamaRMSNorm])
    decay = [n for n in decay if "bias" not in n]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": WD},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    engine, optimizer, _, _ = offload.deepspeed.initialize(model=model, model_parameters=groups,
                                                           config=config("nvme", tmp_path / "nvme"))
    with engine:
        schedule = transformers.get_linear_schedule_with_warmup(optimizer, 0, 4)
        trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path / "run"),
                                       train_dataset=trainer_rows(), optimizers=(optimizer, schedule))
        trainer.train()
        got = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        weights = {n: v for n, v in engine.full_state_dict(master=True).items() if "lora_" in n}
    assert got == want
    ref = {n: p.detach().cpu() for n, p in plain.model.named_parameters() if "lora_" in n}
    assert weights.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(weights[name], value, msg=lambda m: f"{name}: {m}", **exact())


def test_an_accelerate_loop_with_a_lora_equals_plain_pytorch(tmp_path):
    import accelerate

    def loop(model, optimizer):
        accelerator = accelerate.Accelerator(cpu=test_device().type == "cpu", gradient_accumulation_steps=2)
        loader = torch.utils.data.DataLoader(trainer_rows(), batch_size=2, shuffle=False)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses = []
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.5)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach().cpu())
        accelerator.free_memory()
        return torch.stack(losses)

    plain = lora(base_model())
    want = loop(plain, torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=LR,
                                         weight_decay=WD))
    model = lora(base_model())
    with offload.initialize(model, config("nvme", tmp_path)) as engine:
        got = loop(model, engine.optimizer)
        weights = engine.full_state_dict(master=True)
    torch.testing.assert_close(got, want, **exact())
    for name, p in plain.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(weights[name], p.detach().cpu(), msg=lambda m: f"{name}: {m}", **exact())


@pytest.mark.parametrize("how", ["offload.init", "weights"])
def test_a_lora_on_a_base_built_under_offload_init_or_loaded_with_weights_equals_plain_peft(tmp_path, how):
    """offload.init: the base built into its homes, PEFT wraps it (copying lm_head for
    modules_to_save from its real values), initialize adopts it. weights: the base built
    with other values, its Hugging Face directory given to initialize, whose keys name the
    base's parameters, not PEFT's (Note [weights of a PEFT model]).
    On a GPU the initialisation a model runs after construction (Hugging Face's
    post_init) runs on the gathered parameters there, drawing from the GPU's RNG
    (docs/guide/gpus.md): the start differs from a CPU build by the RNG, so plain
    PEFT starts from the built model's values and training must then agree."""
    data = batches(4)
    plain = lora(base_model())
    cfg = config("nvme", tmp_path / "nvme")
    if how == "weights":
        base_model().save_pretrained(tmp_path / "base")
    with offload.init(cfg):
        base = base_model()
    model = lora(base)
    if how == "weights":
        with torch.no_grad():
            for p in base.parameters():
                if not p.requires_grad:
                    p.fill_(0.5)  # written home: the weights must replace it
        engine = offload.initialize(model, cfg, weights=tmp_path / "base")
    else:
        engine = offload.initialize(model, cfg)
    with engine:
        start = {n: v.cpu() for n, v in engine.full_state_dict().items()}
        assert start.keys() == {n for n, _ in plain.named_parameters()}
        if test_device().type == "cpu":  # built as plain PyTorch builds it, bit for bit
            for name, value in plain.named_parameters():
                torch.testing.assert_close(start[name], value.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        plain.load_state_dict(start, strict=False)
        got = engine_run(engine, model, data)
    assert_same(got, plain_run(plain, data))


def test_the_adapter_saves_with_save_pretrained_and_merges_after_close(tmp_path):
    model, data = lora(base_model()), batches(3)
    plain = copy.deepcopy(model)
    plain_run(plain, data)
    with offload.initialize(model, config("nvme", tmp_path / "nvme")) as engine:
        engine_run(engine, model, data)
        model.save_pretrained(tmp_path / "adapter")  # reads the trained adapter through the engine
    reloaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "adapter")
    ref = {n: p for n, p in plain.named_parameters() if "lora_" in n or "modules_to_save" in n}
    for name, p in reloaded.named_parameters():
        if name in ref:
            torch.testing.assert_close(p.detach(), ref[name].detach().cpu(), msg=lambda m: f"{name}: {m}",
                                       **exact())
    merged, plain_merged = model.merge_and_unload(), plain.merge_and_unload()
    for (name, p), (_, q) in zip(merged.named_parameters(), plain_merged.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach().cpu(), msg=lambda m: f"{name}: {m}", **exact())
    assert all(isinstance(p.data, torch.Tensor) and p.device.type == "cpu" for p in merged.parameters())


def test_a_lora_checkpoint_without_the_base_resumes_exactly(tmp_path):
    data = batches(6)
    cfg = config("nvme", tmp_path / "nvme", precision="bf16")
    model = lora(base_model(torch.bfloat16))
    second = copy.deepcopy(model)
    with offload.initialize(model, cfg) as engine:
        engine_run(engine, model, data[:3])
        engine.save_checkpoint(tmp_path / "whole", tag="t")
        engine.save_checkpoint(tmp_path / "ck", tag="t", exclude_frozen_parameters=True)
        want = engine_run(engine, model, data[3:])
        frozen_bytes = sum(s.part_numel * 2 for s in engine.shards if not s.trainable)

    def size(root):
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    # At least the base's bytes fewer (each swap file left out also carries an aligned header).
    assert size(tmp_path / "whole") - size(tmp_path / "ck") >= frozen_bytes
    with offload.initialize(second, cfg) as engine:
        engine.load_checkpoint(tmp_path / "ck")
        got = engine_run(engine, second, data[3:])
    assert_same(got, want, rtol=0, atol=0)
    assert Tier.NVME in engine.placement().state_tiers
