"""Fine-tune a Hugging Face causal LM with transformers.Trainer through offload.

Needs transformers and accelerate: `pip install transformers accelerate`, then

    python examples/hf_trainer.py [--model DIR] [--steps N] [--compare] [--out DIR]

The route (docs/guide/huggingface.md says why it is this one):

    engine = offload.initialize(model, config,               # parameters and Adam state on NVMe
                                param_groups=decay_groups(model))
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=(engine.optimizer, scheduler))
    trainer.train(); trainer.save_model(out)                 # real weights; from_pretrained loads them

The model stays the user's model: its own forward gathers the parameters,
`loss.backward()` (Accelerate's) moves gradients into the partitions,
Trainer's clip_grad_norm_ and zero_grad act on them, and `engine.optimizer`
(a torch.optim.Optimizer) runs the engine's update when Trainer steps it.
Gradient accumulation and clipping are Trainer's (its arguments), so the
offload config leaves both at their defaults.

Without --model, a small LlamaForCausalLM (vocabulary 256, random weights)
is built from a LlamaConfig and trained byte-level on the running Python's
standard library sources. --compare also trains a copy with plain Trainer
(torch AdamW) on the same batches and prints both losses, step by step.
The last stdout line is a JSON summary.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

import offload


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local Hugging Face causal LM directory (default: a small random Llama)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--offload", choices=["nvme", "cpu", "auto"], default="nvme",
                   help="where parameters and optimizer state live; auto: planned over RAM and NVMe")
    p.add_argument("--nvme-path", help="swap directory (default: a temporary one, removed at the end)")
    p.add_argument("--out", default="runs/hf_trainer", help="where Trainer writes and the model is saved")
    p.add_argument("--compare", action="store_true", help="also train with plain Trainer and compare losses")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=args.seq_len))


def byte_windows(args, count: int, vocab: int) -> list[dict]:
    """`count` windows of seq_len bytes of the stdlib sources (ids modulo the vocabulary)."""
    from offload_bench.corpus import load_corpus

    data = load_corpus(max_bytes=1 << 20).long() % vocab
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, data.numel() - args.seq_len, (count,), generator=gen)
    return [{"input_ids": data[s:s + args.seq_len], "labels": data[s:s + args.seq_len]} for s in starts.tolist()]


def training_args(args, out: Path, device: torch.device):
    """Trainer's arguments; `device` is where the engine computes (a GPU unless there is
    none): Trainer puts each batch there, and its model.to(device) leaves the engine's
    parameters as they are (Note [reading a parameter outside the engine])."""
    from transformers import TrainingArguments

    return TrainingArguments(
        str(out), per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, learning_rate=args.lr, weight_decay=0.01, max_grad_norm=args.max_grad_norm,
        lr_scheduler_type="linear", warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[],
        # torch's default AdamW (its fused variant rounds differently), which offload's update equals
        # bit for bit: so --compare's plain Trainer is the same arithmetic.
        optim="adamw_torch",
        use_cpu=device.type == "cpu", seed=args.seed, data_seed=args.seed, disable_tqdm=True, dataloader_drop_last=True)


def decay_groups(model, weight_decay: float = 0.01) -> list[dict]:
    """Trainer's split: weight decay except on biases and norm weights (its own rule)."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def offload_config(args, nvme: str) -> dict:
    where = {"device": args.offload, **({"nvme_path": nvme} if args.offload in ("nvme", "auto") else {})}
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_param": dict(where), "offload_optimizer": dict(where)},
    }


def losses_of(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("examples/hf_trainer.py needs transformers and accelerate: pip install transformers accelerate",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    model = build_model(args)
    data = byte_windows(args, args.steps * args.batch_size * args.grad_accum, model.config.vocab_size)
    reference = copy.deepcopy(model) if args.compare else None

    with tempfile.TemporaryDirectory(prefix="offload-hf-trainer-") as tmp:
        # Trainer's own parameter groups (no weight decay on biases and norms), so the
        # engine's update is the one plain Trainer would make: DeepSpeed's form of initialize.
        engine = offload.initialize(model, offload_config(args, args.nvme_path or tmp),
                                    param_groups=decay_groups(model))
        with engine:
            schedule = transformers.get_linear_schedule_with_warmup(engine.optimizer, 0, args.steps)
            trainer = transformers.Trainer(model=model, args=training_args(args, out / "trainer", engine.device),
                                           train_dataset=data, optimizers=(engine.optimizer, schedule))
            trainer.train()
            trainer.save_model(out / "model")  # model.state_dict(): the trained weights
            losses = losses_of(trainer)
            sample = data[0]["input_ids"][None]
            with torch.no_grad():
                logits = model(input_ids=sample.to(engine.device)).logits.cpu()
            device = engine.device
            nvme_bytes = sum(store.stats.bytes_written + store.stats.bytes_read for store in engine.swap_stores)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    with torch.no_grad():
        reloaded_diff = float((loaded.to(device)(input_ids=sample.to(device)).logits.cpu() - logits).abs().max())
    summary = {"steps": args.steps, "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
               "saved_model": str(out / "model"), "reloaded_max_abs_logit_diff": reloaded_diff,
               "offload": args.offload, "nvme_bytes_moved": nvme_bytes}
    if reference is not None:
        # On the engine's device: on a GPU its AdamW steps there, so the losses agree to
        # fp32 rounding rather than bit for bit (the engine's Adam runs on the host).
        plain = transformers.Trainer(model=reference, args=training_args(args, out / "plain", device),
                                     train_dataset=data)
        plain.train()
        summary["plain_losses"] = losses_of(plain)
        summary["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(losses, summary["plain_losses"]))
        for step, (a, b) in enumerate(zip(losses, summary["plain_losses"]), 1):
            print(f"step {step:3d}  offload {a:.6f}  plain Trainer {b:.6f}", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
