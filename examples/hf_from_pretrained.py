"""Load a Hugging Face checkpoint straight onto NVMe and fine-tune it with offload.

Needs transformers: `pip install transformers` (or `pip install -e ".[hf]"`
from a checkout), then

    python examples/hf_from_pretrained.py [--how from_pretrained|weights] [--steps N]

A tiny random Llama is saved with `save_pretrained` into a temporary
directory (standing in for a downloaded model), then loaded two ways, each
with parameters and Adam state on NVMe (a temporary directory):

  from_pretrained  `AutoModelForCausalLM.from_pretrained(dir)` inside
                   `offload.init(config)`: every parameter goes to its NVMe
                   file as transformers loads it; initialize adopts them.
  weights          `AutoModelForCausalLM.from_config(...)` inside
                   `offload.init`, then `offload.initialize(model, config,
                   weights=dir)`: the safetensors files are read one tensor
                   at a time into the homes.

(A model built on the meta device also works with `weights=dir`, once its
non-persistent buffers, such as Llama's rotary `inv_freq`, have values:
those are not in the checkpoint, and initialize says which are missing.)
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import offload


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def save_tiny_llama(directory: Path, seed: int = 0) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config()).save_pretrained(directory)
    return directory


def offload_config(nvme_dir: Path, lr: float = 3e-3) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,  # every parameter on NVMe
            "offload_param": {"device": "nvme", "nvme_path": str(nvme_dir)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_dir)},
        },
    }


def batches(steps: int, vocab: int = 96, seq: int = 12, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (4, seq), generator=gen) for _ in range(steps)]


def load(model_dir: Path, config: dict, how: str):
    from transformers import AutoModelForCausalLM

    if how == "from_pretrained":
        with offload.init(config):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return offload.initialize(model, config)
    if how == "weights":
        with offload.init(config):
            model = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)
        return offload.initialize(model, config, weights=model_dir)
    raise ValueError(f"how: expected 'from_pretrained' or 'weights', got {how!r}")


def train(engine, data) -> list[float]:
    engine.train()  # from_pretrained leaves the model in eval mode
    losses = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


INSTALL_HINT = 'pip install transformers (or pip install -e ".[hf]" from a checkout)'


def main(argv=None) -> dict:
    # Nothing above imports transformers at module level, so --help works without it.
    parser = argparse.ArgumentParser(description=f"{__doc__.splitlines()[0]} Needs transformers: {INSTALL_HINT}.")
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--how", choices=["from_pretrained", "weights"], default="from_pretrained",
                        help="load through from_pretrained under offload.init, or initialize(weights=dir)")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401  (checked here: the first use is deep in save_tiny_llama)
    except ImportError as exc:
        parser.exit(2, f"{parser.prog}: needs transformers, which is not importable ({exc}); "
                       f"{INSTALL_HINT}\n")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_llama(Path(tmp) / "tiny-llama")
        config = offload_config(Path(tmp) / "nvme")
        with load(model_dir, config, args.how) as engine:
            losses = train(engine, batches(args.steps))
            on_nvme = engine.memory_report()["nvme"]["now"]
    for i, loss in enumerate(losses):
        print(f"step {i}: loss {loss:.4f}")
    summary = {"how": args.how, "losses": losses, "nvme_bytes": on_nvme}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
