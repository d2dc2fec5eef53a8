"""examples/lora_finetune.py: a LoRA of a Hugging Face Llama through the engine, built
under offload.init, trains exactly like plain PEFT on plain PyTorch (fp32 and bf16,
planned or on NVMe), and the adapter it saves loads with peft. Needs transformers and
peft (the [test] extra)."""
import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

_spec = importlib.util.spec_from_file_location(
    "lora_finetune", Path(__file__).resolve().parents[2] / "examples" / "lora_finetune.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


@pytest.mark.parametrize("flags", [["--offload", "auto"], ["--offload", "nvme", "--bf16"]])
def test_the_example_matches_plain_peft_and_its_adapter_loads(tmp_path, flags):
    out = tmp_path / "adapter"
    summary = example.main(["--steps", "3", "--compare", "--out", str(out), "--nvme-path", str(tmp_path / "nvme"),
                            *flags])
    assert summary["losses"] == summary["plain_losses"]
    assert 0 < summary["trainable"] < summary["parameters"] / 10
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    args = example.parse_args(flags)
    model = peft.PeftModel.from_pretrained(example.build_base(args), out)
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(torch.isfinite(p).all() for p in adapters.values())
    assert not list((tmp_path / "nvme").rglob("*.swp"))  # the swap files went with the engine
