"""QLoRA as users run it (Note [quantized frozen weights] in offload/partition/quantized.py):
a Hugging Face Llama loaded with bitsandbytes 4-bit (nf4 with double quantization, and
fp4) or 8-bit, prepared by peft's prepare_model_for_kbit_training, with LoRA on q_proj and v_proj,
trains through the engine exactly as plain PEFT QLoRA on plain PyTorch, in the user's own
loop and with Trainer, with the base homed on the host, on NVMe and by the auto plan; the
homes hold the packed bytes to the byte; 8-bit (LLM.int8()) bases the same; what cannot be
paged is refused by name before anything moves. Skipped without transformers, peft and bitsandbytes."""
import copy

import pytest
import torch

import offload
from offload.aio.memory import _unshared
from offload.partition.quantized import page_modules, quantized_home, quantized_kind, state_bytes, unpage
from offload.tiers import Tier
from tests.integrations.test_peft import engine_run  # the same loop through the engine
from tests.support.layer_under_test import exact, test_device

pytestmark = [pytest.mark.any_device]  # Note [the device a test runs on] (tests/conftest.py)
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

LR, WD = 2e-3, 0.01


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory):
    """A small bf16 Llama on disk, as from_pretrained reads a hub model (hidden size 64:
    a multiple of bitsandbytes' 64-element blocks)."""
    path = tmp_path_factory.mktemp("base")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def qlora(path, quant_type="nf4", double=True):
    """A QLoRA as PEFT documents it: the base in 4-bit (quant_type "int8": 8-bit), prepared
    for k-bit training, LoRA on top."""
    if quant_type == "int8":
        quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                       bnb_4bit_use_double_quant=double,
                                                       bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                              device_map=str(test_device()), dtype=torch.bfloat16)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.0, init_lora_weights="gaussian"))
    model.train()
    return model


def batches(n=4, batch=2):
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 64, (n * batch, 12), generator=gen)
    return [{"input_ids": rows[i:i + batch], "labels": rows[i:i + batch]} for i in range(0, len(rows), batch)]


def config(where, path):
    side = {"device": where, "nvme_path": str(path)} if where in ("nvme", "auto") else {"device": where}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": dict(side), "offload_optimizer": dict(side)}}


def plain_run(model, data):
    """Plain PEFT QLoRA: torch's AdamW over the adapters (fp32: prepare_model_for_kbit_training
    keeps the non-quantized parameters in fp32, as the engine's fp32 compute dtype does)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    losses = []
    for batch in data:
        loss = model(**{k: v.to(test_device()) for k, v in batch.items()}).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().cpu())
    return torch.stack(losses), {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(got, want):
    (losses, weights), (ref_losses, ref_weights) = got, want
    torch.testing.assert_close(losses, ref_losses, **exact())
    assert weights.keys() == ref_weights.keys() and weights
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, msg=lambda m: f"{name}: {m}", **exact())


def quantized_params(model):
    return [(n, p) for n, p in model.named_parameters() if quantized_kind(p) is not None]


@pytest.mark.parametrize("where,quant_type,double", [("cpu", "nf4", True), ("nvme", "nf4", True),
                                                      ("auto", "nf4", True), ("nvme", "fp4", False),
                                                      ("cpu", "int8", False), ("nvme", "int8", False)])
def test_a_qlora_in_your_own_loop_equals_plain_peft(saved_base, tmp_path, where, quant_type, double):
    data = batches()
    want = plain_run(qlora(saved_base, quant_type, double), data)
    model = qlora(saved_base, quant_type, double)
    base = quantized_params(model)
    assert len(base) == 14
    packed = {n: p.detach().clone() for n, p in base}
    with offload.initialize(model, config(where, tmp_path)) as engine:
        got = engine_run(engine, model, data)
        plan = engine.placement()
        # The homes hold the packed bytes, untouched by training.
        for name, value in packed.items():
            assert torch.equal(dict(model.named_parameters())[name].detach(), value), name
    assert_same(got, want)
    assert {s.name for s in plan.shards if s.trainable} == set(want[1])
    # The plan counts a quantized home at its own size: 1 byte a packed element (two weights
    # in 4-bit, one in 8-bit).
    quantized = {s.name: s for s in plan.shards if s.itemsize is not None}
    assert set(quantized) == set(packed) and all(s.itemsize == 1 and s.state is None for s in quantized.values())
    # Closing gives the layers and weights their own classes, quantization state and all.
    layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    value = packed["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    if quant_type == "int8":
        assert type(layer) is bnb.nn.Linear8bitLt and type(layer.weight) is bnb.nn.Int8Params
        assert layer.state.CB.data_ptr() == layer.weight.data_ptr() and layer.state.SCB is not None
    else:
        assert type(layer) is bnb.nn.Linear4bit and type(layer.weight) is bnb.nn.Params4bit
        assert layer.weight.quant_state is not None
    assert torch.equal(layer.weight.data, value)
    # And it computes as before: bitsandbytes' own forward on the given-back values.
    with torch.no_grad():
        again = model(**{k: v.to(test_device()) for k, v in data[0].items()}).loss
    assert torch.isfinite(again)


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_quantized_homes_hold_their_packed_bytes_to_the_byte(saved_base, tmp_path, where):
    model = qlora(saved_base)
    base = quantized_params(model)
    quantized = sum(p.numel() for _, p in base)  # uint8: one byte each
    others = sum(p.numel() * 4 for _, p in model.named_parameters() if quantized_kind(p) is None)
    side = sum(state_bytes(p) for _, p in base)
    assert side > 0
    with offload.initialize(model, config(where, tmp_path)) as engine:
        homes = engine.placement().home_bytes()
        tier = Tier.NVME if where == "nvme" else Tier.HOST
        frozen = [s for s in engine.placement().shards if s.itemsize is not None]
        assert sum(s.part_numel for s in frozen) == quantized
        if where == "nvme":
            assert homes[Tier.NVME] == quantized + others  # the adapters' files too (their masters)
        else:  # fp32 host homes of the trainable adapters are their masters (counted with the state)
            trainable = sum(p.numel() * 4 for _, p in model.named_parameters() if p.requires_grad)
            assert homes[tier] == quantized + others - trainable
        # The quantization state is counted whole beside compute, to the byte.
        assert sum(s.side_bytes for s in engine.placement().shards) == side


def test_backward_reads_a_quantized_weight_again_instead_of_keeping_its_buffer(saved_base, tmp_path):
    """bitsandbytes' own matmul keeps a view of the gathered buffer for backward; the paged
    layer saves the weight through autograd's hooks, so after forward no gathered buffer is
    held by anyone but the engine's cache (and backward gathers again)."""
    model = qlora(saved_base)
    with offload.initialize(model, config("nvme", tmp_path)) as engine:
        batch = batches(1)[0]
        loss = model(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        cache = engine.shard_context.gathered_buffers
        if not engine.device_layer.separate_memory:  # the cpu layer gathers NVMe homes into cached host buffers
            assert cache._idle and all(_unshared(buf) for buf in cache._idle)
        engine.backward(loss)
        engine.step()


def assert_layers_agree(plain, paged):
    """The same output and input gradient, bit for bit, from a batch of 3 x 5 rows."""
    x = torch.randn(3, 5, 128, device=test_device())
    outs = []
    for layer in (plain, paged):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), xi.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)


@pytest.mark.parametrize("quant_type,double,bias", [("nf4", True, False), ("nf4", False, True), ("fp4", True, True)])
def test_the_paged_layer_computes_what_bitsandbytes_computes(quant_type, double, bias):
    torch.manual_seed(0)
    plain = bnb.nn.Linear4bit(128, 64, bias=bias, compute_dtype=torch.bfloat16, compress_statistics=double,
                              quant_type=quant_type).to(test_device())
    paged = copy.deepcopy(plain)
    swapped = page_modules(paged, {id(paged.weight)}, test_device())
    assert len(swapped) == 1 and type(paged).__name__ == "Linear4bit"
    assert_layers_agree(plain, paged)
    unpage(swapped)
    assert type(paged) is bnb.nn.Linear4bit


@pytest.mark.parametrize("threshold,bias", [(0.0, False), (6.0, True)])
def test_the_paged_8bit_layer_computes_what_bitsandbytes_computes(threshold, bias):
    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 64, bias=bias)
    plain = bnb.nn.Linear8bitLt(128, 64, bias=bias, has_fp16_weights=False, threshold=threshold)
    plain.load_state_dict(dense.state_dict())
    plain = plain.to(test_device())  # quantizes
    paged = copy.deepcopy(plain)
    swapped = page_modules(paged, {id(paged.weight)}, test_device())
    assert len(swapped) == 1 and paged.state.CB is None and paged.weight.CB is None
    assert_layers_agree(plain, paged)
    unpage(swapped)
    assert type(paged) is bnb.nn.Linear8bitLt and paged.state.CB.data_ptr() == paged.weight.data_ptr()


def test_a_trainable_quantized_weight_is_refused_before_anything_moves(tmp_path):
    """A packed weight stored in bf16 (bitsandbytes' quant_storage, as FSDP QLoRA loads it)
    can be marked trainable; bitsandbytes cannot train it, and the engine says so."""
    layer = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", quant_storage=torch.bfloat16).to(test_device())
    model = torch.nn.Sequential(layer, torch.nn.Linear(64, 8))
    layer.weight.requires_grad_(True)
    before = layer.weight.detach().view(torch.uint8).clone()  # bf16 words of packed codes: compare bytes
    with pytest.raises(ValueError, match="0.weight is a quantized .* requires_grad=True.*LoRA"):
        offload.initialize(model, config("nvme", tmp_path))
    assert type(layer.weight) is bnb.nn.Params4bit and torch.equal(layer.weight.detach().view(torch.uint8), before)
    assert type(layer) is bnb.nn.Linear4bit


def test_trainer_and_accelerate_moving_the_model_keep_the_packed_bytes(saved_base, tmp_path):
    """Params4bit has its own .to(), which re-wraps its data: model.to(its device) must
    neither rewrap the placeholder nor write it home."""
    model = qlora(saved_base)
    name, weight = quantized_params(model)[0]
    before, state = weight.detach().clone(), weight.quant_state
    with offload.initialize(model, config("cpu", tmp_path)):
        model.to(test_device())
        assert dict(model.named_parameters())[name] is weight and weight.quant_state is state
        assert torch.equal(weight.detach(), before)
        with pytest.raises(RuntimeError, match=f"{name} .Params4bit. is placed by the engine"):
            weight.to("meta")


def test_a_4bit_weight_outside_a_linear4bit_is_refused(tmp_path):
    layer = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4").to(test_device())
    holder = torch.nn.Module()
    holder.table = layer.weight  # a 4-bit weight as another module's parameter
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), holder)
    model[1].register_parameter("table", layer.weight)
    with pytest.raises(TypeError, match="table is a bitsandbytes-4bit weight held by a Module.*Linear4bit"):
        offload.initialize(model, config("cpu", tmp_path))


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_a_qlora_with_trainer_equals_plain_trainer(saved_base, tmp_path, method):
    rows = [{"input_ids": r, "labels": r} for b in batches(8) for r in b["input_ids"]]

    def args(out):
        return transformers.TrainingArguments(
            str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=LR,
            weight_decay=WD, max_grad_norm=0.0, optim="adamw_torch", logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=test_device().type == "cpu", seed=0, data_seed=0, disable_tqdm=True,
            dataloader_drop_last=True, lr_scheduler_type="constant")

    plain = transformers.Trainer(model=qlora(saved_base, method), args=args(tmp_path / "plain"), train_dataset=rows)
    plain.train()
    want = [e["loss"] for e in plain.state.log_history if "loss" in e]
    model = qlora(saved_base, method)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cfg = config("nvme", tmp_path / "nvme")
    cfg["gradient_accumulation_steps"] = 2
    engine, optimizer, _, _ = offload.deepspeed.initialize(model=model, model_parameters=[p for _, p in named],
                                                           config=cfg)
    with engine:
        trainer = transformers.Trainer(model=model, args=args(tmp_path / "run"), train_dataset=rows,
                                       optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                                                               lambda _: 1.0)))
        trainer.train()
        got = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        weights = {n: v for n, v in engine.full_state_dict(master=True).items() if "lora_" in n}
    assert got == want and len(got) == 3
    ref = {n: p.detach().cpu() for n, p in plain.model.named_parameters() if "lora_" in n}
    assert weights.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(weights[name], value, msg=lambda m: f"{name}: {m}", **exact())


@pytest.mark.parametrize("method,double", [("nf4", True), ("fp4", False), ("int8", False)])
def test_the_closed_form_of_a_quantized_home_is_what_bitsandbytes_makes(method, double):
    for out_features, in_features in [(64, 64), (100, 30), (3, 7), (512, 1024)]:
        if method == "int8":
            layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=False, has_fp16_weights=False)
        else:
            layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, quant_type=method,
                                      compress_statistics=double)
        weight = layer.to(test_device()).weight
        assert quantized_home(out_features, in_features, method, double) == (weight.numel(), state_bytes(weight))


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_the_estimate_of_a_qlora_holds_what_initialize_homes(saved_base, tmp_path, method):
    """`offload estimate --model-config --trainable adapter_config.json --frozen-quant` counts
    the quantized homes and their state as the engine holds them, to the byte."""
    from offload.sizing import estimate

    adapter = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    est = estimate(model_config=saved_base / "config.json", trainable=adapter, frozen_quant=method,
                   config=config("cpu", tmp_path))
    host = est.breakdown["host"]
    model = qlora(saved_base, "int8" if method == "int8" else "nf4")
    base = quantized_params(model)
    assert host[f"parameter shards, frozen, quantized ({method})"] == sum(p.numel() for _, p in base)
    assert est.breakdown["device"]["quantization state (whole beside compute)"] == sum(state_bytes(p) for _, p in base)
    assert est.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    with offload.initialize(model, config("cpu", tmp_path)) as engine:
        held = engine.placement().home_bytes()[Tier.HOST]
    frozen_dense = host["parameter shards, frozen (fp32, 4 B/param, nothing else)"]
    assert held == frozen_dense + sum(p.numel() for _, p in base)  # the adapters' homes are their masters


# ---- a base quantized as offload.init builds it (the `frozen` section) ------------------

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)


def build_bf16():
    """LlamaForCausalLM in bf16 from torch's own init (Hugging Face's second pass skipped,
    as for random weights in benchmarks/offload_bench/lora.py): the same values inside and
    outside offload.init."""
    from unittest import mock

    torch.manual_seed(0)
    with mock.patch.object(transformers.PreTrainedModel, "initialize_weights", lambda self: None):
        return transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**SHAPE), dtype=torch.bfloat16)


def frozen_config(where, path, method):
    cfg = config(where, path)
    cfg["frozen"] = {"quantize": method, "double_quant": True, "compute_dtype": "bf16"}
    return cfg


def add_lora(model):
    torch.manual_seed(3)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.0, init_lora_weights="gaussian"))
    model.train()
    return model


@pytest.mark.parametrize("where,method", [("cpu", "nf4"), ("nvme", "nf4"), ("auto", "nf4"), ("nvme", "int8")])
def test_a_base_quantized_as_offload_init_builds_it_equals_plain_qlora(tmp_path, where, method):
    """frozen.quantize: each Linear (but lm_head) becomes bitsandbytes' layer as it is attached,
    quantized from the values it was built with, and goes home packed; the QLoRA on it trains
    exactly as plain PEFT QLoRA on the same bf16 weights loaded with BitsAndBytesConfig."""
    build_bf16().save_pretrained(tmp_path / "bf16")
    data = batches()
    want = plain_run(qlora(tmp_path / "bf16", method), data)
    cfg = frozen_config(where, tmp_path / "nvme", method)
    with offload.init(cfg) as builder:
        model = build_bf16()
    layer = model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == ("Linear8bitLt" if method == "int8" else "Linear4bit")
    assert type(model.lm_head) is torch.nn.Linear  # skip_modules' default, as transformers
    built = list(builder.shards)
    quantized = [s for s in builder.shards if quantized_kind(s.param) is not None]
    assert len(quantized) == 14 and all(s.dtype in (torch.uint8, torch.int8) for s in quantized)
    # No prepare_model_for_kbit_training: the config's fp32 compute dtype makes the rest fp32.
    model = add_lora(model)
    with offload.initialize(model, cfg) as engine:
        # initialize adopts the packed homes as they were built: nothing is re-quantized or rewritten.
        packed = [s for s in engine.shards if s.dtype in (torch.uint8, torch.int8)]
        assert len(packed) == 14 and all(any(s is b for b in built) for s in packed)
        got = engine_run(engine, model, data)
    assert_same(got, want)


def test_frozen_quantize_outside_offload_init_is_refused_before_anything_moves(tmp_path):
    model = add_lora(build_bf16())
    weight = model.base_model.model.model.layers[0].mlp.up_proj.weight
    before = weight.detach().clone()
    with pytest.raises(ValueError, match="frozen.quantize is 'nf4' but 14 frozen nn.Linear weights .*offload.init"):
        offload.initialize(model, frozen_config("cpu", tmp_path, "nf4"))
    assert type(weight) is torch.nn.Parameter and torch.equal(weight.detach(), before)


def test_the_frozen_section_names_what_it_takes():
    from offload.config import Config, ConfigError

    assert Config.load({"frozen": {"quantize": "nf4"}}).frozen.skip_modules == ("lm_head",)
    with pytest.raises(ConfigError, match="frozen.quantize: 'nf3' is not one of 'nf4', 'fp4', 'int8', or null"):
        Config.load({"frozen": {"quantize": "nf3"}})
    with pytest.raises(ConfigError, match="frozen.compute_dtype"):
        Config.load({"frozen": {"quantize": "nf4", "compute_dtype": "float32"}})
    with pytest.raises(ConfigError, match="frozen.skip_modules"):
        Config.load({"frozen": {"skip_modules": "lm_head"}})


def test_nvme_bytes_a_step_are_the_quantized_homes_read(saved_base, tmp_path, monkeypatch):
    """Closed form (Note [frozen parameters] in offload/placement.py): a step reads each NVMe
    home once for forward and once more where backward needs its value, in its own bytes: a
    4-bit home ceil(n/2) bytes a read. The first layer's q/k/v are read once (their input,
    the frozen embedding's output, wants no gradient); every other quantized weight twice.
    The swap stores' byte count agrees with the reads to the byte, and on a device with
    memory of its own (the sim) the bus carries those bytes up, and the gradients down."""
    from offload.transfers import nvme_home

    reads = {}
    original = nvme_home.ParamStore.read_full  # a gather's read (read_part is the optimizer's)

    def counted(self, shard, out):
        reads[shard.name] = reads.get(shard.name, 0) + 1
        return original(self, shard, out)
    monkeypatch.setattr(nvme_home.ParamStore, "read_full", counted)
    model = qlora(saved_base)
    cfg = config("nvme", tmp_path)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with offload.initialize(model, cfg) as engine:
        stores, counters = engine.swap_stores, engine.device_layer.counters
        for batch in batches(2):
            reads.clear()
            before, copied = sum(s.stats.bytes_read for s in stores), counters.bytes_copied
            loss = model(**{k: v.to(engine.device) for k, v in batch.items()}).loss
            engine.backward(loss)
            engine.step()
            read = sum(s.stats.bytes_read for s in stores) - before
            copied = counters.bytes_copied - copied
        shards = {s.name: s for s in engine.shards}
        separate = engine.device_layer.separate_memory
    assert read == sum(n * shards[name].part_numel * shards[name].dtype.itemsize for name, n in reads.items())
    if separate:  # the sim: what was read goes up the bus as read; the adapters' fp32 gradients come down
        assert copied == read + sum(s.part_numel * 4 for s in shards.values() if s.trainable)
    quantized = {name: n for name, n in reads.items() if shards[name].dtype == torch.uint8}
    assert len(quantized) == 14
    once = {f"base_model.model.model.layers.0.self_attn.{p}" for p in ("q_proj.base_layer.weight", "k_proj.weight",
                                                                       "v_proj.base_layer.weight")}
    assert quantized == {name: 1 if name in once else 2 for name in quantized}
    assert all(shards[name].part_numel == shards[name].numel for name in quantized)  # packed: n / 2 bytes


def test_a_qlora_checkpoint_without_the_base_resumes_exactly_and_knows_its_base(saved_base, tmp_path):
    """exclude_frozen_parameters=True leaves the packed base out and fingerprints its bytes:
    the run resumes exactly on the same quantized base, and another base is refused by name."""
    data = batches(6)
    cfg = config("nvme", tmp_path / "nvme")
    model = qlora(saved_base)
    with offload.initialize(model, cfg) as engine:
        engine_run(engine, model, data[:3])
        engine.save_checkpoint(tmp_path / "ck", tag="t", exclude_frozen_parameters=True)
        want = engine_run(engine, model, data[3:])
    second = qlora(saved_base)
    with offload.initialize(second, cfg) as engine:
        engine.load_checkpoint(tmp_path / "ck")
        got = engine_run(engine, second, data[3:])
    assert_same(got, want)
    other = qlora(saved_base, "fp4", double=False)  # the same shapes, other packed bytes
    with offload.initialize(other, cfg) as engine:
        with pytest.raises(Exception, match=r"frozen parameter '.*q_proj.base_layer.weight' has other values than"
                                            r".*resumes only on the same frozen base"):
            engine.load_checkpoint(tmp_path / "ck")


def test_save_pretrained_and_merge_and_unload_after_close_do_what_peft_does(saved_base, tmp_path):
    """The adapter saves during training as PEFT saves it; after engine.close() the layers are
    bitsandbytes' own again, and merge_and_unload() (PEFT's dequantize, add, quantize again)
    gives the same merged base as plain PEFT QLoRA's."""
    data = batches()
    plain = qlora(saved_base)
    plain_run(plain, data)
    model = qlora(saved_base)
    with offload.initialize(model, config("nvme", tmp_path / "nvme")) as engine:
        engine_run(engine, model, data)
        model.save_pretrained(tmp_path / "adapter")
    plain.save_pretrained(tmp_path / "plain_adapter")
    from safetensors.torch import load_file

    saved, want = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("adapter", "plain_adapter"))
    assert saved.keys() == want.keys() and saved
    for key in want:
        torch.testing.assert_close(saved[key], want[key], rtol=0, atol=0)
    merged, plain_merged = model.merge_and_unload(), plain.merge_and_unload()
    for (name, p), (_, q) in zip(merged.named_parameters(), plain_merged.named_parameters()):
        assert type(p) is type(q), name
        assert torch.equal(p.detach(), q.detach()), name


def test_buffers_lent_to_autograd_are_not_kept_by_the_cache(saved_base, tmp_path):
    """A frozen weight read again in backward on the CPU leaves its gathered buffer to autograd
    (Note [frozen holds in backward]); the buffer cache must let go of it too. It kept each
    one: a Llama-3-70B-wide QLoRA with its base on NVMe grew 3 GiB a step until killed."""
    model = qlora(saved_base)
    with offload.initialize(model, config("nvme", tmp_path)) as engine:
        cache = engine.shard_context.gathered_buffers
        for batch in batches(3):
            loss = model(**{k: v.to(engine.device) for k, v in batch.items()}).loss
            engine.backward(loss)
            engine.step()
            if cache is not None:  # the cpu layer (the sim's buffers are the layer's)
                assert cache._lent == {}
