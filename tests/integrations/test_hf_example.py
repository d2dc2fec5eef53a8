"""examples/hf_from_pretrained.py: a Hugging Face directory loaded onto NVMe
(from_pretrained under offload.init, and weights=dir) trains exactly like
plain transformers + torch AdamW. Needs transformers (the [hf] extra); the
same directory-loading path without transformers is tested in
tests/engine/test_init_and_load.py."""
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)

pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "hf_from_pretrained", Path(__file__).resolve().parents[2] / "examples" / "hf_from_pretrained.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def _plain(model_dir, data, lr):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses


@pytest.mark.parametrize("how", ["from_pretrained", "weights"])
def test_example_matches_plain_transformers(tmp_path, how):
    model_dir = example.save_tiny_llama(tmp_path / "tiny-llama", seed=1)
    config = example.offload_config(tmp_path / "nvme")
    data = example.batches(4, seed=2)
    ref_model, ref_losses = _plain(model_dir, data, lr=config["optimizer"]["params"]["lr"])
    with example.load(model_dir, config, how) as engine:
        losses = example.train(engine, data)
        weights = engine.full_state_dict(master=True)
        assert engine.memory_report()["nvme"]["now"] > 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
    assert not list((tmp_path / "nvme").rglob("*.swp"))


def test_example_main_prints_losses(capsys):
    summary = example.main(["--steps", "3"])
    assert len(summary["losses"]) == 3 and summary["nvme_bytes"] > 0
    assert "step 2: loss" in capsys.readouterr().out
