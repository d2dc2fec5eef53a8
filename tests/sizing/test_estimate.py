"""offload.estimate: the memory model, HF config counting, and DeepSpeed's estimator."""
import argparse
import json
import re

import pytest
import torch
from torch import nn

from offload import sizing as est_mod
from offload.config import ConfigError, MemoryConfig, Tier
from offload.sizing import estimate, model_sizes

LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
        "vocab_size": 50257}


def cfg(param="cpu", opt="cpu", precision="bf16", **zero):
    d = {"zero_optimization": {"stage": 3, "offload_param": {"device": param},
                               "offload_optimizer": {"device": opt}, **zero}}
    for dev, key in ((param, "offload_param"), (opt, "offload_optimizer")):
        if dev == "nvme":
            d["zero_optimization"][key]["nvme_path"] = "/nvme"
    if precision != "fp32":
        d[precision] = {"enabled": True}
    return d


def test_known_model_counts():
    s = model_sizes(LLAMA_7B)
    assert s.num_params == 6_738_415_616  # Llama-2-7B
    assert s.largest_layer_params == 32000 * 4096
    assert s.persistent_params == 65 * 4096  # 2 norms per layer + final norm
    assert model_sizes(GPT2).num_params == 124_439_808  # GPT-2 small
    assert model_sizes({**LLAMA_7B, "tie_word_embeddings": True}).num_params == 6_738_415_616 - 32000 * 4096


def test_bytes_per_tier_closed_form():
    n, L, P = 1_000_000, 10_000, 500
    e = estimate(n, config=cfg("nvme", "nvme", sub_group_size=1000), largest_layer_params=L, persistent_params=P,
                 world_size=4, num_nodes=2, group_size="world")
    shard = n // 4
    assert e.nvme == shard * (2 + 4 + 8)
    in_flight = (3 * 12 + 4 * 12 + 3 * 4 + 3 * 2) * (L // 4)  # Note [memory model]; bf16 homes on NVMe
    assert e.host == shard * 4 + 2 * L * 2 + in_flight
    assert e.device == 2 * L * 2 + P * 2
    assert (e.minimum_device, e.minimum_host, e.minimum_nvme) == (e.device, 2 * e.host, 2 * e.nvme)
    assert all(sum(e.breakdown[t].values()) == getattr(e, t) for t in ("device", "host", "nvme"))
    f = estimate(n, config=cfg("none", "none", "fp32"), largest_layer_params=L, persistent_params=0)
    assert f.device == n * (4 + 4 + 8) + 2 * L * 4 and f.host == 0 and f.nvme == 0  # fp32: no extra master
    g = estimate(n, config=cfg("nvme", "nvme"), largest_layer_params=L, persistent_params=0)
    # NVMe state in flight grows with the largest layer, not the model (nor sub_group_size)
    assert g.breakdown["host"]["optimizer state buffers in flight"] == 3 * 12 * L


def test_model_config_and_auto_threshold(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_7B))
    e = estimate(model_config=path, config=cfg("cpu", "cpu", stage3_param_persistence_threshold="auto"))
    assert e.num_params == 6_738_415_616 and e.persistent_params == 65 * 4096
    e2 = estimate(model_config=LLAMA_7B, config=cfg("cpu", "cpu", stage3_param_persistence_threshold=1))
    assert e2.persistent_params == 0
    with pytest.raises(ConfigError, match=r"model config: missing 'intermediate_size'"):
        estimate(model_config={k: v for k, v in LLAMA_7B.items() if k != "intermediate_size"})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=r"model config '.*bad\.json': invalid JSON"):
        estimate(model_config=tmp_path / "bad.json")


def test_heuristic_and_errors():
    e = estimate(1_600_000)
    assert e.largest_layer_params == 100_000 and any("num_params / 16" in n for n in e.notes)
    assert "num_params / 16" in e.format()
    with pytest.raises(ConfigError, match="give num_params or model_config"):
        estimate()
    with pytest.raises(ConfigError, match="not both"):
        estimate(10, model_config=LLAMA_7B)
    with pytest.raises(ConfigError, match=r"world_size: 3 is not a multiple of num_nodes 2"):
        estimate(10, world_size=3, num_nodes=2)
    with pytest.raises(ConfigError, match=r"largest_layer_params: 11 is not an integer in \[0, 10\] "
                                          r"\(from 0 to the model's parameter count\)"):
        estimate(10, largest_layer_params=11)


def test_budgets():
    e = estimate(10**6, config=cfg("cpu", "cpu"), largest_layer_params=1000)
    assert e.check_budgets(MemoryConfig()) == []
    problems = e.check_budgets(MemoryConfig(device_budget=1000, host_budget="1GiB"))
    assert len(problems) == 1 and problems[0].startswith("memory.device_budget: ")


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    est_mod.add_arguments(parser)
    (tmp_path / "ds.json").write_text(json.dumps(cfg("nvme", "nvme")))
    assert est_mod.run(parser.parse_args(["--params", "7B", "--config", str(tmp_path / "ds.json"),
                                          "--largest-layer", "131e6", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] == 7 * 10**9 and out["largest_layer_params"] == 131 * 10**6
    assert out["offload_param"] == "nvme" and out["minimum_nvme"] == 7 * 10**9 * 14
    (tmp_path / "m.json").write_text(json.dumps(GPT2))
    assert est_mod.run(parser.parse_args(["--model-config", str(tmp_path / "m.json")])) == 0
    assert "minimum: device" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert est_mod.run(parser.parse_args(["--params", "1e6", "--config", str(tmp_path / "bad.json")])) == 2
    assert "zero_optimization.stage" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--params", "seven"])


def test_cli_messages_name_the_flags_typed(capsys):
    """What the command prints names --largest-layer, not the keyword largest_layer_params."""
    parser = argparse.ArgumentParser()
    est_mod.add_arguments(parser)
    assert est_mod.run(parser.parse_args(["--params", "1M"])) == 0
    out = capsys.readouterr().out
    assert "note: largest layer not given: assumed --params / 16 (give --largest-layer or --model-config" in out
    assert "(give --persistent-params, or --model-config to count them)" in out
    assert est_mod.run(parser.parse_args(["--params", "1M", "--largest-layer", "2M"])) == 2
    assert capsys.readouterr().err.startswith("offload estimate: --largest-layer: 2000000 is not an integer")
    assert est_mod.run(parser.parse_args(["--params", "1M", "--world-size", "3", "--num-nodes", "2"])) == 2
    assert "--world-size: 3 is not a multiple of --num-nodes 2" in capsys.readouterr().err
    for line in est_mod.estimate(10**6).notes:  # the Python API names its own keywords
        assert "--" not in line
    assert any("give largest_layer_params or model_config" in n for n in est_mod.estimate(10**6).notes)


# ---------------------------------------------------------------- DeepSpeed cross-check

@pytest.fixture(scope="module")
def ds_stage3():
    return pytest.importorskip("deepspeed.runtime.zero.stage3",
                               reason="deepspeed is not importable: the comparison with its estimator needs it")


# (cpu_offload, cpu_offload_params) in DeepSpeed's terms -> our devices
DS_CASES = [(True, True, "cpu", "cpu"), (True, False, "none", "cpu"), (False, False, "none", "none")]


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (8, 1), (4, 2)])
@pytest.mark.parametrize("cpu_offload, cpu_offload_params, param, opt", DS_CASES)
def test_matches_deepspeed_estimator(ds_stage3, gpus, nodes, cpu_offload, cpu_offload_params, param, opt):
    # See docs/CONFIG.md "Estimate vs DeepSpeed": with the same largest layer and no persistent
    # parameters, the device figures are equal and DeepSpeed's host figure is ours x 1.5
    # (additional_buffer_factor), except without optimizer offload, where DeepSpeed's host figure
    # is zero.Init's staging of the largest layer (4 B x L x GPUs per node x 1.5), which we do not hold.
    n, L = 7_000_000_000, 131_072_000
    ds_host, ds_device, ds_largest = ds_stage3.estimate_zero3_model_states_mem_needs(
        n, L, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=cpu_offload,
        cpu_offload_params=cpu_offload_params, zero_init=True, additional_buffer_factor=1.5)
    ours = estimate(n, config=cfg(param, opt, "bf16"), largest_layer_params=L, persistent_params=0,
                    world_size=gpus * nodes, num_nodes=nodes, group_size="world")  # DeepSpeed's is flat
    world = gpus * nodes
    assert n % world == 0
    assert ours.minimum_device == ds_device
    assert ds_largest == ours.breakdown["device"]["gathered layers (2 x largest layer, bf16)"]
    if cpu_offload:
        assert ds_host == int(ours.minimum_host * 1.5)
    else:
        assert ours.minimum_host == 0 and ds_host == int(L * 4 * gpus * 1.5)


def build_gpt2(c):
    """A GPT-2 with HF's module tree (Conv1D weights are [in, out]), tied lm_head."""
    h, inner = c["n_embd"], c.get("n_inner") or 4 * c["n_embd"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.attn = nn.Module()
            self.attn.c_attn, self.attn.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.mlp = nn.Module()
            self.mlp.c_fc, self.mlp.c_proj = nn.Linear(h, inner), nn.Linear(inner, h)

    m = nn.Module()
    m.wte, m.wpe = nn.Embedding(c["vocab_size"], h), nn.Embedding(c["n_positions"], h)
    m.h = nn.ModuleList(Block() for _ in range(c["n_layer"]))
    m.ln_f = nn.LayerNorm(h)
    m.lm_head = nn.Linear(h, c["vocab_size"], bias=False)
    m.lm_head.weight = m.wte.weight
    return m


def build_llama(c):
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.Module()
            for name, out in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
                setattr(self.self_attn, name, nn.Linear(h, out, bias=False))
            self.self_attn.o_proj = nn.Linear(h, h, bias=False)
            self.mlp = nn.Module()
            self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
            self.mlp.down_proj = nn.Linear(inter, h, bias=False)
            self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(h), nn.RMSNorm(h)

    m = nn.Module()
    m.embed_tokens = nn.Embedding(c["vocab_size"], h)
    m.layers = nn.ModuleList(Layer() for _ in range(c["num_hidden_layers"]))
    m.norm = nn.RMSNorm(h)
    m.lm_head = nn.Linear(h, c["vocab_size"], bias=False)
    if c.get("tie_word_embeddings"):
        m.lm_head.weight = m.embed_tokens.weight
    return m


TINY_GPT2 = {"model_type": "gpt2", "n_embd": 48, "n_layer": 3, "n_positions": 40, "vocab_size": 101}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 97}


@pytest.mark.parametrize("model_config, build", [
    (TINY_GPT2, build_gpt2), (TINY_LLAMA, build_llama), ({**TINY_LLAMA, "tie_word_embeddings": True}, build_llama),
    ({**TINY_LLAMA, "vocab_size": 7}, build_llama),  # largest layer is an MLP projection
])
def test_model_config_counts_match_deepspeed_model_to_params(ds_stage3, model_config, build):
    # DeepSpeed's estimate_zero3_model_states_mem_needs_all_live counts a live model with
    # model_to_params (distinct parameters; the largest module's own parameters). Our counts from
    # the config.json must agree, and so must the estimates built on them, except for the
    # persistent parameters (a term DeepSpeed's estimator leaves out).
    torch.manual_seed(0)
    model = build(model_config)
    total, largest = ds_stage3.model_to_params(model)
    sizes = model_sizes(model_config)
    assert (sizes.num_params, sizes.largest_layer_params) == (total, largest)
    threshold = 10 * sizes.hidden_size
    assert sizes.persistent_params == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
                                          if p.numel() < threshold)
    ours = estimate(model_config=model_config,
                    config=cfg("cpu", "cpu", "bf16", stage3_param_persistence_threshold="auto"))
    assert ours.persistent_params == sizes.persistent_params
    ds_host, ds_device, _ = ds_stage3.estimate_zero3_model_states_mem_needs(
        total, largest, 1, 1, cpu_offload=True, cpu_offload_params=True, zero_init=True)
    assert ours.minimum_device - ds_device == 2 * sizes.persistent_params
    assert ds_host == int(ours.minimum_host * 1.5)


def test_cli_prints_the_auto_plan_per_tier_within_the_budgets(tmp_path, capsys):
    """"auto" (Note [automatic placement]): the plan an engine would make, per tier."""
    parser = argparse.ArgumentParser()
    est_mod.add_arguments(parser)
    d = cfg("auto", "auto", precision="fp32")
    for key in ("offload_param", "offload_optimizer"):
        d["zero_optimization"][key]["nvme_path"] = "/nvme"
    d["memory"] = {"host_budget": "60GB", "device_budget": "24GB"}
    (tmp_path / "auto.json").write_text(json.dumps(d))
    (tmp_path / "m.json").write_text(json.dumps(LLAMA_7B))
    args = ["--model-config", str(tmp_path / "m.json"), "--config", str(tmp_path / "auto.json")]
    assert est_mod.run(parser.parse_args(args + ["--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["placement"]
    assert out["offload_param"] == out["offload_optimizer"] == "auto" and plan["auto"]
    held = plan["held_bytes"]
    assert held["device"] > 0 and held["host"] > 0 and held["nvme"] > 0  # a 7B model over three tiers
    assert out["host"] <= 60 * 10**9 and out["device"] <= 24 * 10**9  # the budgets hold, with everything else
    # state goes on the device only beside a device home, with the room the homes left
    assert all(s["home"] == "device" for s in plan["shards"] if s["state"] == "device")
    assert held["device"] <= 12 * 10**9  # DEVICE_SHARE of the 24 GB budget
    assert est_mod.run(parser.parse_args(args)) == 0
    text = capsys.readouterr().out
    assert "offload_param=auto" in text and "placement (auto)" in text and "moved per step nvme" in text


# ---------------------------------------------------------------- the trainable share (Note [trainable share])

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "tie_word_embeddings": False}
LLAMA3_8B_BASE = 8_030_261_248  # Meta-Llama-3-8B's parameter count
# What peft's LoraConfig(r=8, target_modules=["q_proj", "v_proj"]).save_pretrained writes (abridged:
# the keys that do not change the count are left out but for a few, which must be ignored).
LORA_QV = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
           "target_modules": ["v_proj", "q_proj"], "modules_to_save": None, "bias": "none",
           "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
           "use_dora": False, "lora_bias": False, "target_parameters": None, "inference_mode": False}
# Per layer, q_proj is 4096 -> 4096 and v_proj 4096 -> 1024 (8 KV heads of 128): lora_A r x in, lora_B out x r.
LORA_QV_PARAMS = 32 * (8 * (4096 + 4096) + 8 * (4096 + 1024))
LLAMA3_8B_L = 128256 * 4096  # the embedding and the untied lm_head
LLAMA3_8B_NORMS = (2 * 32 + 1) * 4096


def closed_form(n, t, largest, persistent, c, param, opt, world=1, largest_trainable=None):
    """Note [memory model], written out again: {tier: bytes per rank} for n parameters
    of which t train (the frozen n - t cost their compute copy only)."""
    lt = -(-min(largest, t) // world) if largest_trainable is None else -(-largest_trainable // world)
    tier = {"none": "device", "cpu": "host", "nvme": "nvme"}
    shard, tshard = -(-n // world), -(-t // world)
    b = {"device": 2 * largest * c + persistent * c, "host": 0, "nvme": 0}
    b[tier[param]] += shard * c
    b["device" if opt == "none" else "host"] += tshard * 4
    b[tier[opt]] += tshard * (8 + (4 if c != 4 else 0))
    if param == "nvme":
        b["host"] += 2 * largest * c
    if opt == "nvme":  # state in flight: 3 buffers, 4 idle ones, 3 masters; new values to NVMe in bf16
        b["host"] += (3 * 12 + 4 * 12 + 3 * 4) * lt + (3 * c * lt if c != 4 and param == "nvme" else 0)
    return b


def write_adapter(tmp_path, adapter, name="adapter_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(adapter))
    return path


def test_a_lora_adapter_adds_r_times_in_plus_out_per_adapted_module_and_freezes_the_base(tmp_path):
    assert model_sizes(LLAMA3_8B).num_params == LLAMA3_8B_BASE
    s = model_sizes(LLAMA3_8B, adapter=write_adapter(tmp_path, LORA_QV))
    assert LORA_QV_PARAMS == 3_407_872  # what peft prints for this adapter on Llama-3-8B
    assert (s.trainable_params, s.num_params) == (LORA_QV_PARAMS, LLAMA3_8B_BASE + LORA_QV_PARAMS)
    # each adapter parameter (at most 8 x 4096) is under the 'auto' threshold 10 x 4096: kept whole
    assert s.persistent_params == LLAMA3_8B_NORMS + LORA_QV_PARAMS
    assert s.largest_layer_params == LLAMA3_8B_L
    # the folder save_pretrained wrote is accepted too, and so is the dict
    assert model_sizes(LLAMA3_8B, adapter=tmp_path) == s
    assert model_sizes(LLAMA3_8B, adapter=LORA_QV).trainable_params == LORA_QV_PARAMS


def test_modules_to_save_count_twice_and_bias_frees_the_biases_peft_frees():
    # qwen2 has q/k/v biases: bias "lora_only" frees the adapted q_proj's and v_proj's, "all" every one
    qwen = {**LLAMA3_8B, "model_type": "qwen2", "num_hidden_layers": 2}
    base = model_sizes(qwen).num_params
    lora = 2 * (8 * (4096 + 4096) + 8 * (4096 + 1024))
    for bias, freed in (("none", 0), ("lora_only", 2 * (4096 + 1024)), ("all", 2 * (4096 + 1024 + 1024))):
        s = model_sizes(qwen, adapter={**LORA_QV, "bias": bias})
        assert (s.trainable_params, s.num_params) == (lora + freed, base + lora)
    s = model_sizes(qwen, adapter={**LORA_QV, "modules_to_save": ["lm_head"]})
    assert (s.trainable_params, s.num_params) == (lora + LLAMA3_8B_L, base + lora + LLAMA3_8B_L)
    # "all-linear": every projection but the output layer, r x (in + out) each
    h, kv, inter = 4096, 1024, 14336
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h)
    assert model_sizes(qwen, adapter={**LORA_QV, "target_modules": "all-linear", "r": 4}).trainable_params == \
        2 * 4 * per_layer


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param, opt", [("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "cpu"), ("none", "cpu"),
                                        ("none", "none")])
def test_lora_bytes_per_tier_equal_the_closed_form(tmp_path, precision, param, opt):
    c = 4 if precision == "fp32" else 2
    n, t = LLAMA3_8B_BASE + LORA_QV_PARAMS, LORA_QV_PARAMS
    e = estimate(model_config=LLAMA3_8B, config=cfg(param, opt, precision),
                 trainable=write_adapter(tmp_path, LORA_QV))
    assert (e.num_params, e.trainable_params, e.frozen_params) == (n, t, LLAMA3_8B_BASE)
    # the largest trainable module: q_proj's lora_A or lora_B, 8 x 4096
    want = closed_form(n, t, LLAMA3_8B_L, LLAMA3_8B_NORMS + t, c, param, opt, largest_trainable=8 * 4096)
    assert {tier: getattr(e, tier) for tier in ("device", "host", "nvme")} == want
    assert all(sum(e.breakdown[tier].values()) == getattr(e, tier) for tier in ("device", "host", "nvme"))


def test_a_count_a_fraction_and_a_percentage_give_the_same_share(tmp_path):
    n, L = 1_000_000, 10_000
    for trainable in (11_000, 11_000.0, "11K", "1.1e4", "0.011", 0.011, "1.1%", " 1.1 % "):
        e = estimate(n, config=cfg("nvme", "nvme", sub_group_size=1000), largest_layer_params=L,
                     persistent_params=0, world_size=4, num_nodes=2, trainable=trainable, group_size="world")
        assert (e.trainable_params, e.frozen_params) == (11_000, n - 11_000), trainable
        want = closed_form(n, 11_000, L, 0, 2, "nvme", "nvme", world=4)
        assert (e.device, e.host, e.nvme) == (want["device"], want["host"], want["nvme"])
        assert (e.minimum_host, e.minimum_nvme) == (2 * e.host, 2 * e.nvme)
    # all of it is a full fine-tune, to the byte and to the label
    full = estimate(n, config=cfg("cpu", "cpu"), largest_layer_params=L)
    assert estimate(n, config=cfg("cpu", "cpu"), largest_layer_params=L, trainable="100%") == full
    assert full.trainable_params == n and "gradient accumulation (fp32, 4 B/param)" in full.breakdown["host"]
    lora = estimate(n, config=cfg("cpu", "cpu"), largest_layer_params=L, trainable=0.5)
    assert lora.breakdown["host"]["parameter shards, frozen (bf16, 2 B/param, nothing else)"] == n // 2 * 2
    assert lora.breakdown["host"]["gradient accumulation (fp32, 4 B/trainable param)"] == n // 2 * 4


def test_a_lora_needs_a_seventh_of_a_full_fine_tunes_nvme():
    """Llama-3-8B, bf16, parameters and optimizer on NVMe: 14 B/param vs about 2 B/param."""
    full = estimate(model_config=LLAMA3_8B, config=cfg("nvme", "nvme"))
    lora = estimate(model_config=LLAMA3_8B, config=cfg("nvme", "nvme"), trainable=LORA_QV)
    assert full.nvme == 14 * LLAMA3_8B_BASE
    assert lora.nvme == 2 * (LLAMA3_8B_BASE + LORA_QV_PARAMS) + 12 * LORA_QV_PARAMS
    assert 2 < lora.nvme / LLAMA3_8B_BASE < 2.01 and full.nvme / lora.nvme > 6.9
    assert full.host > 25 * lora.host  # no fp32 gradient of the base, tiny swap buffers
    assert full.device == lora.device - 2 * LORA_QV_PARAMS  # the adapters are persistent: whole on the device


def test_cli_takes_trainable_and_prints_the_trainable_and_frozen_counts(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    est_mod.add_arguments(parser)
    (tmp_path / "m.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "ds.json").write_text(json.dumps(cfg("nvme", "nvme")))
    adapter = write_adapter(tmp_path, LORA_QV)
    args = ["--model-config", str(tmp_path / "m.json"), "--config", str(tmp_path / "ds.json")]
    assert est_mod.run(parser.parse_args(args + ["--trainable", str(adapter), "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_params"], out["trainable_params"], out["frozen_params"]) == \
        (LLAMA3_8B_BASE + LORA_QV_PARAMS, LORA_QV_PARAMS, LLAMA3_8B_BASE)
    assert out["nvme"] == 2 * (LLAMA3_8B_BASE + LORA_QV_PARAMS) + 12 * LORA_QV_PARAMS
    assert est_mod.run(parser.parse_args(args + ["--trainable", str(tmp_path)])) == 0
    text = capsys.readouterr().out
    assert "8.03B params (3.41M trainable, 8.03B frozen)" in text
    assert "parameter shards, frozen (bf16, 2 B/param, nothing else)" in text
    assert "note: --trainable: LoRA from the adapter config" in text and "r=8, 64 modules adapted" in text
    assert est_mod.run(parser.parse_args(["--params", "1M", "--trainable", "1.1%", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["trainable_params"], out["frozen_params"]) == (11_000, 989_000)
    assert est_mod.run(parser.parse_args(["--params", "1M"])) == 0
    assert "1.00M params (1.00M trainable, 0 frozen)" in capsys.readouterr().out


def bad_trainable_cases(tmp_path):
    """(trainable, extra estimate() arguments, what the message says after the argument's name);
    all but an adapter's content and a count too large also list the forms accepted."""
    write_adapter(tmp_path, {**LORA_QV, "peft_type": "IA3"}, "ia3.json")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    model = {"model_config": LLAMA3_8B}
    return [
        ("-5", {}, "'-5' is negative"), (-5, {}, "-5 is negative"), ("-0.1", {}, "is negative"),
        ("1.5", {}, "is not a fraction between 0 and 1"), ("2.0", {}, "is not a fraction between 0 and 1"),
        ("0.0", {}, "is not a fraction between 0 and 1"), (1.5, {}, "neither a whole count nor a fraction"),
        (0, {}, "is no parameter"), ("0", {}, "is not a positive whole count"), (True, {}, "is a bool"),
        ("150%", {}, "is not a percentage above 0 and at most 100"), ("x%", {}, "is not a percentage"),
        ("2M", {}, "2000000 trainable parameters is more than the model's 1000000"),
        (10**7, {}, "is more than the model's 1000000"), ("1e-9", {}, "is not a positive whole count"),
        ("seven", {}, "is not a count, a fraction, or a file or folder that exists"),
        (str(tmp_path / "missing.json"), model, "No such file or directory"),
        (str(tmp_path / "broken.json"), model, "invalid JSON at line 1"),
        (str(tmp_path / "list.json"), model, "the top level is not a JSON object"),
        (str(tmp_path / "binary.json"), model, "not a text (JSON) file"),
        (str(tmp_path / "ia3.json"), model, "peft_type 'IA3' is not supported"),
        (LORA_QV, {}, "a PEFT adapter config needs"),
        ({**LORA_QV, "r": 0}, model, "r: 0 is not a positive integer"),
        ({**LORA_QV, "bias": "some"}, model, "bias: 'some' is not 'none', 'all' or 'lora_only'"),
        ({**LORA_QV, "target_modules": ["qproj"]}, model, "matches no Linear or Embedding module"),
        ({**LORA_QV, "target_modules": ["input_layernorm"]}, model, "a normalization layer"),
        ({**LORA_QV, "target_modules": ["self_attn"]}, model, "a module holding others"),
        ({**LORA_QV, "target_modules": "(q_proj"}, model, "is not a valid regular expression"),
        ({**LORA_QV, "target_parameters": ["experts.gate_up_proj"]}, model, "is not counted by the estimate"),
    ]


def test_each_bad_trainable_raises_naming_the_argument_and_what_it_accepts(tmp_path):
    for trainable, kwargs, says in bad_trainable_cases(tmp_path):
        kwargs = kwargs or {"num_params": 10**6}
        with pytest.raises(ConfigError) as info:
            estimate(trainable=trainable, **kwargs)
        msg = str(info.value)
        assert msg.startswith("trainable: ") and says in msg, (trainable, msg)
        lists_forms = not isinstance(trainable, dict) and not says.startswith(("peft_type", "2000000", "is more"))
        assert lists_forms is ("expected a count of trainable parameters (8M, 3.4e6), a fraction of the model "
                               "(0.011, or 1.1%) or a PEFT LoRA adapter_config.json" in msg), msg
    with pytest.raises(ConfigError, match=r"peft_type 'IA3' is not supported: trainable counts LORA adapters "
                                          r"only; give trainable the trainable count \(e.g. 8M\) or fraction"):
        estimate(model_config=LLAMA3_8B, trainable={**LORA_QV, "peft_type": "IA3"})


def test_cli_messages_name_trainable_as_typed(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    est_mod.add_arguments(parser)
    (tmp_path / "m.json").write_text(json.dumps(LLAMA3_8B))
    for trainable, kwargs, says in bad_trainable_cases(tmp_path):
        if not isinstance(trainable, str):
            continue
        source = ["--model-config", str(tmp_path / "m.json")] if kwargs else ["--params", "1M"]
        assert est_mod.run(parser.parse_args(source + [f"--trainable={trainable}"])) == 2
        err = capsys.readouterr().err
        assert err.startswith("offload estimate: --trainable: ") and says in err, (trainable, err)
    write_adapter(tmp_path, LORA_QV)
    assert est_mod.run(parser.parse_args(["--params", "1M", "--trainable", str(tmp_path)])) == 2
    assert "--trainable: a PEFT adapter config needs --model-config" in capsys.readouterr().err


def test_an_auto_plan_marks_the_adapters_trainable_and_the_base_frozen():
    d = cfg("auto", "auto")
    for key in ("offload_param", "offload_optimizer"):
        d["zero_optimization"][key]["nvme_path"] = "/nvme"
    d["memory"] = {"host_budget": "8GB", "device_budget": "2GB"}
    e = estimate(model_config=LLAMA3_8B, config=d, trainable=LORA_QV)
    shards = e.placement.shards
    trainable = [s for s in shards if s.trainable]
    assert sum(s.part_numel for s in trainable) == LORA_QV_PARAMS and len(trainable) == 4 * 32
    assert all(".lora_" in s.name for s in trainable)
    assert sum(s.part_numel for s in shards) == e.num_params
    # the engine's own host reservations shrink with the frozen base: nothing on NVMe but frozen homes
    assert all(s.state is not Tier.NVME for s in shards) and e.placement.state_bytes()[Tier.NVME] == 0
    # the breakdown is initialize's own check (engine/budgets.py tier_needs): the adapters' gradients,
    # each held until its update during backward (host state beside a GPU), the largest one first
    assert e.breakdown["host"] == e.needs["host"] and e.breakdown["device"] == e.needs["device"]
    held = e.breakdown["host"]["fp32 gradients awaiting their overlapped update"]
    assert 4 * max(s.part_numel for s in trainable) <= held < 4 * LORA_QV_PARAMS
    assert "optimizer state" in e.breakdown["host"] and "fp32 gradients" not in e.breakdown["host"]
    assert e.host <= 8 * 10**9
    assert "frozen   " in e.format()
    # a count says how many, not which: the plan takes them from the tail, a parameter split in two
    n = estimate(10**9, config=d, largest_layer_params=10**8, trainable="3%")
    shards = n.placement.shards
    assert sum(s.part_numel for s in shards if s.trainable) == 3 * 10**7
    assert [s.trainable for s in shards[-2:]] == [False, True] and shards[-1].name == "layer9.trainable"
    assert any("takes them from the model's tail" in line for line in n.notes)


# (model builder, extra config keys, LoraConfig keywords): each counted by peft itself below.
PEFT_CASES = [
    ("llama", {}, dict(r=8, target_modules=["q_proj", "v_proj"])),
    ("llama", {}, dict(r=4, target_modules="all-linear", bias="all")),
    ("llama", {"tie_word_embeddings": True},
     dict(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head", "embed_tokens"])),
    ("llama", {}, dict(r=8, target_modules=["q_proj", "embed_tokens"], use_dora=True)),
    ("llama", {}, dict(r=8, target_modules=["q_proj"], lora_bias=True)),
    ("llama", {}, dict(r=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1],
                       rank_pattern={"v_proj": 2})),
    ("llama", {}, dict(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["mlp"])),
    ("llama", {}, dict(r=8, target_modules=r".*(q|v)_proj", exclude_modules=r".*layers\.0.*")),
    ("llama", {"attention_bias": True}, dict(r=8, target_modules="all-linear", bias="lora_only")),
    ("llama", {"attention_bias": True},
     dict(r=8, target_modules=["q_proj"], bias="all", modules_to_save=["o_proj"])),
    ("gpt2", {}, dict(r=8, target_modules=None, modules_to_save=["lm_head"])),
    ("gpt2", {}, dict(r=4, target_modules="all-linear", bias="all")),
    ("gpt2", {}, dict(r=8, target_modules=["c_attn", "wte", "lm_head"], modules_to_save=["c_proj"])),
    ("gpt2", {}, dict(r=8, target_modules=["c_attn"], modules_to_save=["lm_head", "ln_f"], bias="all")),
    ("gpt2", {}, dict(r=8, target_modules=["attn.c_proj"], bias="lora_only", use_dora=True)),
]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # peft's and transformers' advice
@pytest.mark.parametrize("kind, extra, lora", PEFT_CASES)
def test_adapter_counts_match_peft_on_the_same_model(tmp_path, kind, extra, lora):
    """peft applies each saved LoraConfig to the HF model the config.json describes and
    counts what trains and what there is: the estimate counts the same from the two files."""
    peft = pytest.importorskip("peft", reason="peft is not importable: the cross-check needs it")
    transformers = pytest.importorskip("transformers")
    config = {**(TINY_LLAMA if kind == "llama" else {**TINY_GPT2, "n_head": 4}), **extra}
    hf_config = (transformers.LlamaConfig if kind == "llama" else transformers.GPT2Config)(
        **{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel)(hf_config)
    peft.LoraConfig(**lora).save_pretrained(str(tmp_path))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**lora))
    want = (sum(p.numel() for p in wrapped.parameters() if p.requires_grad),
            sum(p.numel() for p in wrapped.parameters()))
    s = model_sizes(config, adapter=tmp_path / "adapter_config.json")
    assert (s.trainable_params, s.num_params) == want


def test_offload_estimate_is_the_function_whichever_way_it_was_reached():
    """offload.estimate is a plain function, before and after its package (offload.sizing)
    is imported: no module made callable."""
    import inspect

    import offload
    import offload.sizing  # noqa: F401 - importing the package must not rebind the name

    assert inspect.isfunction(offload.estimate) and offload.estimate is estimate
    assert offload.estimate(10**6).format() == estimate(10**6).format()


def test_cli_counts_a_quantized_frozen_base(tmp_path, capsys):
    """--frozen-quant: each frozen Linear weight but lm_head at its bitsandbytes size (the
    closed form tests/integrations/test_qlora.py checks against bitsandbytes itself)."""
    from offload.partition.quantized import quantized_home

    parser = argparse.ArgumentParser()
    est_mod.add_arguments(parser)
    (tmp_path / "m.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "ds.json").write_text(json.dumps(cfg("cpu", "cpu")))
    adapter = write_adapter(tmp_path, LORA_QV)
    args = ["--model-config", str(tmp_path / "m.json"), "--config", str(tmp_path / "ds.json"),
            "--trainable", str(adapter), "--json"]
    h, i, layers, kv = 4096, 14336, 32, 1024
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q k v o gate up down: (out, in)
    for method in ("nf4", "fp4", "int8"):
        assert est_mod.run(parser.parse_args(args + ["--frozen-quant", method])) == 0
        out = json.loads(capsys.readouterr().out)
        homes = [quantized_home(o, n, method) for o, n in shapes]
        packed = layers * sum(e for e, _ in homes)
        assert out["breakdown"]["host"][f"parameter shards, frozen, quantized ({method})"] == packed
        assert out["breakdown"]["device"]["quantization state (whole beside compute)"] == \
            layers * sum(s for _, s in homes)
        assert out["num_params"] == LLAMA3_8B_BASE + LORA_QV_PARAMS  # counts stay in weights
    assert est_mod.run(parser.parse_args(["--params", "1M", "--frozen-quant", "nf4"])) == 2
    assert "--frozen-quant: 'nf4' needs one of nf4, fp4, int8 and --model-config" in capsys.readouterr().err


# ---- shard groups and the step-time prediction (Note [hybrid sharding], Note [step-time model]) ----

def test_a_node_sized_shard_group_holds_a_group_share_of_the_state():
    n, L = 1_600_000, 10_000
    flat = estimate(n, config=cfg("cpu", "cpu"), largest_layer_params=L, persistent_params=0,
                    world_size=16, num_nodes=2, group_size="world")
    hybrid = estimate(n, config=cfg("cpu", "cpu"), largest_layer_params=L, persistent_params=0,
                      world_size=16, num_nodes=2)  # the default: a node's 8 ranks
    assert (flat.group_size, hybrid.group_size) == (16, 8)
    for what in ("parameter shards (bf16, 2 B/param)", "gradient accumulation (fp32, 4 B/param)",
                 "fp32 master weights (4 B/param)", "Adam exp_avg + exp_avg_sq (fp32, 8 B/param)"):
        assert hybrid.breakdown["host"][what] == 2 * flat.breakdown["host"][what] == n // 8 * (
            {"p": 2, "g": 4, "f": 4, "A": 8}[what[0]]), what
    assert hybrid.device == flat.device  # the gathered layers are whole either way
    assert "shard groups of 8" in hybrid.format() and "shard groups" not in flat.format()
    assert estimate(n, config=cfg("cpu", "cpu"), largest_layer_params=L, world_size=16, num_nodes=2,
                    group_size=4).group_size == 4
    one_node = estimate(n, config=cfg("cpu", "cpu"), largest_layer_params=L, world_size=8, num_nodes=1)
    assert one_node.group_size == 8  # one node: the flat layout


@pytest.mark.parametrize("group, message", [(3, r"--group-size: .*16 ranks do not divide into groups of 3"),
                                            ("nodes", r"--group-size: 'nodes' is not 'node', 'world'")])
def test_a_shard_group_that_does_not_divide_the_ranks_is_refused(group, message, capsys):
    parser = argparse.ArgumentParser()
    est_mod.add_arguments(parser)
    args = ["--params", "1M", "--world-size", "16", "--num-nodes", "2", "--group-size", str(group)]
    assert est_mod.run(parser.parse_args(args)) == 2
    assert re.search(message, capsys.readouterr().err)


def test_step_time_per_layout_from_the_cli(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg("cpu", "cpu")))
    parser = argparse.ArgumentParser()
    est_mod.add_arguments(parser)
    args = ["--params", "1B", "--largest-layer", "10M", "--world-size", "16",
            "--num-nodes", "2", "--config", str(path), "--step-time", "--link-within", "400GB",
            "--link-across", "12.5GB", "--bus", "50GB", "--tflops", "400", "--adam-rate", "1e9",
            "--tokens", "4096", "--json"]
    assert est_mod.run(parser.parse_args(args)) == 0
    out = json.loads(capsys.readouterr().out)["step_time"]
    flat, hybrid = out["flat"], out["hybrid"]
    # Across nodes, flat: (W-1)/W of the gathers (2 x 2 B) and the fp32 gradients (4 B) a parameter;
    # hybrid: the gradients' all_reduce across the 2 nodes, 2 (R-1)/R x 4 B a parameter, a node's link.
    assert flat["terms"]["across nodes"] == pytest.approx(15 / 16 * 8e9 / 12.5e9)
    assert hybrid["terms"]["across nodes"] == pytest.approx(4e9 / 12.5e9)
    assert hybrid["terms"]["within node"] == pytest.approx(7 / 8 * 8e9 / 400e9)
    assert flat["bound"] == hybrid["bound"] == "across nodes" and hybrid["step"] < flat["step"]
    assert est_mod.run(parser.parse_args(args[:-9] + ["--json"])) == 2  # no --tflops and the rest
    assert "--step-time needs --tflops, --adam-rate, --tokens" in capsys.readouterr().err
