"""offload.estimate: the memory model, HF config counting, and DeepSpeed's estimator."""
import argparse
import json

import pytest
import torch
from torch import nn

from offload import estimate as est_mod
from offload.config import ConfigError, MemoryConfig
from offload.estimate import estimate, model_sizes

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
                 world_size=4, num_nodes=2)
    shard = n // 4
    assert e.nvme == shard * (2 + 4 + 8)
    assert e.host == shard * 4 + 2 * L * 2 + 2 * 1000 * 16
    assert e.device == 2 * L * 2 + P * 2
    assert (e.minimum_device, e.minimum_host, e.minimum_nvme) == (e.device, 2 * e.host, 2 * e.nvme)
    assert all(sum(e.breakdown[t].values()) == getattr(e, t) for t in ("device", "host", "nvme"))
    f = estimate(n, config=cfg("none", "none", "fp32"), largest_layer_params=L, persistent_params=0)
    assert f.device == n * (4 + 4 + 8) + 2 * L * 4 and f.host == 0 and f.nvme == 0  # fp32: no extra master
    g = estimate(n, config=cfg("nvme", "nvme"), largest_layer_params=L, persistent_params=0)
    assert "2 x 1000000 elements" in " ".join(g.breakdown["host"])  # sub group capped by the shard


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
                    world_size=gpus * nodes, num_nodes=nodes)
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
