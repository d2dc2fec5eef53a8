"""LoRA fine-tune of a Hugging Face Llama through offload: pay for what trains.

Needs transformers and peft: `pip install -e ".[peft]"` (or `pip install transformers
accelerate peft`), then

    python examples/lora_finetune.py [--model DIR] [--steps N] [--bf16] [--offload auto|cpu|nvme]
                                     [--compare] [--out DIR]

The route:

    with offload.init(config):                        # a base larger than RAM is built into its homes
        base = AutoModelForCausalLM.from_pretrained(dir)   # (or from_config: random weights)
    model = peft.get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    engine = offload.initialize(model, config)        # the frozen base: its home alone, no Adam state
    ... your loop: engine(...), engine.backward(loss), engine.step() ...
    model.save_pretrained(out)                        # the adapter, as PEFT writes it
    engine.close(); model.merge_and_unload()          # the merged weights (when they fit in RAM)

The base model's weights are frozen by PEFT: each costs its home in the compute
dtype (2 bytes a parameter in bf16) and nothing else; the adapters and their
Adam state cost what a full fine-tune's parameters do (Note [frozen parameters]
in offload/placement.py). With --offload auto (the default) the plan keeps the
adapters, their state and as much of the base as fits in RAM, the rest on NVMe
under --nvme-path. `engine.placement().format()` prints the plan.

Without --model, a small Llama (vocabulary 256, random weights) is trained
byte-level on the running Python's standard library sources. --compare also
trains a copy with plain PEFT on plain PyTorch on the same batches and prints
both losses. The last stdout line is a JSON summary.
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch

import offload


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local Hugging Face causal LM directory (default: a small random Llama)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (the base in bf16, fp32 Adam state)")
    p.add_argument("--offload", choices=["auto", "cpu", "nvme"], default="auto",
                   help="where the base, the adapters and their state live (default auto: planned over RAM "
                        "and NVMe)")
    p.add_argument("--nvme-path", help="swap directory (default: a temporary one, removed at the end)")
    p.add_argument("--out", default="runs/lora", help="where the adapter is saved")
    p.add_argument("--compare", action="store_true", help="also train with plain PEFT and compare losses")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def offload_config(args, nvme: str) -> dict:
    where = {"device": args.offload, **({"nvme_path": nvme} if args.offload in ("nvme", "auto") else {})}
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": dict(where), "offload_optimizer": dict(where)},
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    return config


def build_base(args):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    return LlamaForCausalLM(config).to(dtype)


def with_lora(base, args):
    import peft

    torch.manual_seed(args.seed + 1)
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0, init_lora_weights="gaussian")
    # autocast_adapter_dtype=False: the adapters in the base's dtype, as the engine computes
    # every parameter in its compute dtype (PEFT would keep bf16 adapters in fp32).
    return peft.get_peft_model(base, config, autocast_adapter_dtype=False)


def byte_batches(args, vocab: int) -> list[torch.Tensor]:
    from offload_bench.corpus import load_corpus

    data = load_corpus(max_bytes=1 << 20).long() % vocab
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, data.numel() - args.seq_len, (args.steps, args.batch_size), generator=gen)
    return [torch.stack([data[s:s + args.seq_len] for s in row.tolist()]) for row in starts]


def train(model, step, data) -> list[float]:
    model.train()
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        step(loss)
        losses.append(float(loss.detach()))
    return losses


def plain_losses(model, args, data) -> list[float]:
    """Plain PEFT on plain PyTorch: AdamW over the adapters (in bf16, an fp32 master of each,
    as the engine keeps)."""
    from offload.optim import CPUAdam

    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in trainable]
    opt = CPUAdam(masters, lr=args.lr, weight_decay=0.0)

    def step(loss):
        loss.backward()
        for m, p in zip(masters, trainable):
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(masters, trainable):
                p.copy_(m)
    return train(model, step, data)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # offload_bench's corpus
    with tempfile.TemporaryDirectory(prefix="offload-lora-") as tmp:
        nvme = args.nvme_path or tmp
        config = offload_config(args, nvme)
        with offload.init(config):
            base = build_base(args)
        model = with_lora(base, args)
        reference = copy.deepcopy(model) if args.compare else None  # real values: a plain copy
        data = byte_batches(args, model.config.vocab_size)
        engine = offload.initialize(model, config)
        with engine:
            print(engine.placement().format())
            losses = train(model, lambda loss: (engine.backward(loss), engine.step()), data)
            memory = engine.memory_report()
            model.save_pretrained(args.out)  # the adapter: adapter_config.json, adapter_model.safetensors
        summary = {"losses": losses, "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                   "parameters": sum(p.numel() for p in model.parameters()),
                   "peak_bytes": {tier: memory[tier]["peak"] for tier in ("device", "host", "nvme")},
                   "adapter": str(Path(args.out).resolve())}
        if reference is not None:
            summary["plain_losses"] = plain_losses(reference, args, data)
            for i, (a, b) in enumerate(zip(losses, summary["plain_losses"])):
                print(f"step {i + 1}: offload {a:.6f}  plain {b:.6f}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
