"""The activation estimate (Note [activation estimate] in offload/sizing/activations.py)
against what the engine measures: the saved-activation peak its saver charges in a real
step, for a GPT, a Hugging Face Llama and a Hugging Face Mixtral (mixture of experts),
each at two sequence lengths; and `offload estimate --seq-len` on the command line."""
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload
from offload.sizing.activations import activation_bytes
from tests.support.models import TinyGPT

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _measured(model, *inputs, **kwargs) -> int:
    """The saver's peak of saved-activation bytes over one real step of the engine."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}}
    with offload.initialize(model, cfg) as engine:
        saver = engine.activation_checkpointing.saver
        saver.reset_peak()
        out = engine(*inputs, **kwargs)
        engine.backward(out if isinstance(out, torch.Tensor) else out.loss)
        return saver.device_peak


class GPTWithLoss(nn.Module):
    """TinyGPT and its next-token loss in one forward, as the engine then charges the loss's
    saved tensors too (outside the model's call they are plain PyTorch's)."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT(vocab=VOCAB, hidden=48, heads=4, layers=3, seq=256)

    def forward(self, x, y):
        return F.cross_entropy(self.gpt(x).reshape(-1, VOCAB), y.reshape(-1))


def _hf(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    return transformers.MixtralForCausalLM, transformers.MixtralConfig(**common, num_local_experts=4,
                                                                       num_experts_per_tok=2)


@pytest.mark.parametrize("seq", [32, 128])
@pytest.mark.parametrize("kind", ["gpt", "llama", "mixtral"])
def test_the_estimate_is_within_ten_percent_of_the_engines_measured_peak(kind, seq, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cpu")
    gen = torch.Generator().manual_seed(seq)
    x = torch.randint(0, VOCAB, (4, seq), generator=gen)
    if kind == "gpt":
        with torch.device("meta"):
            on_meta = GPTWithLoss()
        y = torch.randint(0, VOCAB, (4, seq), generator=gen)
        estimated = activation_bytes(on_meta, x, y)
        torch.manual_seed(0)
        measured = _measured(GPTWithLoss(), x, y)
    else:
        cls, config = _hf(kind)
        with torch.device("meta"):
            on_meta = cls(config)
        estimated = activation_bytes(on_meta.train(), x, labels=x)
        torch.manual_seed(0)
        measured = _measured(cls(config), x, labels=x)
    assert abs(estimated.whole - measured) <= 0.10 * measured, (estimated, measured)
    assert estimated.blocks == (3 if kind == "gpt" else 2)
    assert estimated.outside + estimated.blocks * estimated.block >= estimated.whole  # no block over-counted
    assert estimated.checkpointed < estimated.whole


def test_offload_estimate_prints_the_activations_at_a_sequence_length(tmp_path, capsys):
    _, config = _hf("llama")
    config.save_pretrained(tmp_path)
    from offload.sizing import main

    assert main(["--model-config", str(tmp_path), "--seq-len", "64", "--batch-size", "2", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)["activations"]
    assert main(["--model-config", str(tmp_path), "--seq-len", "256", "--batch-size", "2", "--json"]) == 0
    long = json.loads(capsys.readouterr().out)["activations"]
    assert long["whole"] > 4 * short["whole"] * 0.9 and long["blocks"] == 2
    assert main(["--model-config", str(tmp_path), "--seq-len", "64"]) == 0
    assert "saved activations per rank, micro batch 1 x 64 tokens" in capsys.readouterr().out
    assert main(["--params", "7B", "--seq-len", "64"]) == 2
    assert "--seq-len: the activation estimate runs the model's forward: give --model-config" in \
        capsys.readouterr().err
    assert main(["--model-config", str(tmp_path), "--batch-size", "2"]) == 2
    assert main(["--model-config", str(tmp_path), "--seq-len", "0"]) == 2
