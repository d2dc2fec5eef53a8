#!/usr/bin/env python
"""Train a small causal LM with its parameters and optimizer state on NVMe.

    python examples/finetune.py                       # GPT, NVMe offload under runs/nvme, < 2 min on 2 cores
    python examples/finetune.py --offload cpu         # parameters and Adam state in host memory
    python examples/finetune.py --model hf            # a small LlamaForCausalLM (pip install transformers)

The corpus is the running Python's own standard library sources, byte level
(vocabulary 256), so nothing is downloaded. A progress bar (stderr) shows the
loss, tokens/s and what each memory tier holds; the last line on stdout is a
JSON summary. The exit status is 1 if the training loss did not fall, 2 for
bad arguments or missing sources, 130 on Ctrl-C. The engine is closed (its swap
files removed) however the run ends.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import time

import torch
from torch import nn

import offload
from offload.data import VOCAB_SIZE, BatchSampler, StdlibSourcesNotFound, load_corpus, split_corpus
from offload.models import GPT, GPTConfig
from offload.models.gpt import lm_loss

MIB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=["gpt", "hf"], default="gpt",
                   help="gpt: offload.models.GPT; hf: transformers' LlamaForCausalLM built from a config")
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=120, help="optimizer steps")
    t.add_argument("--batch-size", type=int, default=8, help="micro batch (sequences)")
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--grad-accum", type=int, default=1, help="micro batches per optimizer step")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warmup, then cosine)")
    t.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps)")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: off)")
    t.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    t.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("offload")
    o.add_argument("--offload", choices=["nvme", "cpu", "none"], default="nvme",
                   help="where parameters and optimizer state live between uses")
    o.add_argument("--nvme-path", default=os.path.join("runs", "nvme"),
                   help="swap directory for --offload nvme (removed at the end if created by this run)")
    d = p.add_argument_group("data and evaluation")
    d.add_argument("--corpus-bytes", type=int, default=4 << 20,
                   help="bytes of stdlib source to use (the last 5%% are held out)")
    d.add_argument("--eval-every", type=int, default=0,
                   help="validation loss every N steps (0: only before and after training)")
    d.add_argument("--eval-batches", type=int, default=4)
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "hidden", "layers", "heads",
                 "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    if args.warmup is None:
        args.warmup = max(2, args.steps // 10)
    return args


# ---- model -----------------------------------------------------------------
class LogitsOnly(nn.Module):
    """Wraps a transformers causal LM so that forward(ids) returns the logits tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


def build_model(args) -> nn.Module:
    if args.model == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB_SIZE, hidden=args.hidden, layers=args.layers,
                             heads=args.heads, max_seq=args.seq_len))
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise SystemExit(f"--model hf needs transformers, which is not importable ({exc}); "
                         f"run `pip install transformers`, "
                         f"or use --model gpt") from None
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LogitsOnly(LlamaForCausalLM(config))  # from the config: random weights, no download


def engine_config(args) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": args.offload},
            "offload_optimizer": {"device": args.offload}}
    if args.offload == "nvme":
        zero["offload_param"]["nvme_path"] = args.nvme_path
        zero["offload_optimizer"]["nvme_path"] = args.nvme_path
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.weight_decay}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.steps, "warmup_num_steps": args.warmup,
                                 "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "zero_optimization": zero,
    }
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# ---- measuring -------------------------------------------------------------
@torch.no_grad()
def evaluate(engine, val: torch.Tensor, args) -> float:
    """Mean loss over the same held-out batches every time (their own seeded sampler)."""
    sampler = BatchSampler(val, args.batch_size, args.seq_len, seed=args.seed + 1)
    engine.eval()
    try:
        losses = [lm_loss(engine(x), y).item() for x, y in (sampler.sample() for _ in range(args.eval_batches))]
    finally:
        engine.train()
    return sum(losses) / len(losses)


def tiers(engine) -> dict:
    report = engine.memory_report()
    return {tier: report[tier] for tier in ("device", "host", "nvme")}, report["process_rss"]


def peak_rss() -> int:
    """The process's peak resident set, in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def postfix(loss: float, tok_s: float, engine) -> str:
    now, rss = tiers(engine)
    mem = " ".join(f"{label} {now[t]['now'] / MIB:.1f}"
                   for label, t in (("dev", "device"), ("host", "host"), ("nvme", "nvme")))
    return f"loss {loss:.3f} | {tok_s:,.0f} tok/s | MiB {mem} | rss {rss / MIB:.0f}"


# ---- the run -----------------------------------------------------------------
def _created_parents(path: str) -> list[str]:
    """The directories `path` needs that do not exist yet, deepest first."""
    missing, p = [], os.path.abspath(path)
    while not os.path.exists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return missing


def _remove_if_empty(dirs: list[str]) -> None:
    for d in dirs:  # deepest first; stops at the first that is not empty
        try:
            os.rmdir(d)
        except FileNotFoundError:
            continue
        except OSError:
            break


def _cleanup(new_dirs: list[str], engine_made: bool) -> None:
    """Removes the swap directories this run created. engine.close() removes its rank
    directory itself; when Ctrl-C or an error stops offload.initialize() before it
    returns there is no engine to close, so its rank directory (new_dirs[0], made by
    this run) goes here."""
    if new_dirs and not engine_made:
        shutil.rmtree(new_dirs[0], ignore_errors=True)
    _remove_if_empty(new_dirs)


def train(args, engine, train_data, val_data) -> dict:
    from tqdm import tqdm

    sampler = BatchSampler(train_data, args.batch_size, args.seq_len, seed=args.seed)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    val_before = evaluate(engine, val_data, args)
    evals = [{"step": 0, "val_loss": val_before}]
    print(f"step 0: val loss {val_before:.4f}; training {args.steps} steps of {tokens_per_step} tokens",
          file=sys.stderr, flush=True)
    losses = []
    train_seconds = 0.0
    bar = tqdm(total=args.steps, desc="train", unit="step", disable=args.no_progress,
               dynamic_ncols=True, file=sys.stderr)
    try:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            step_loss = 0.0
            for _ in range(args.grad_accum):
                x, y = sampler.sample()
                loss = lm_loss(engine(x), y)
                engine.backward(loss)
                engine.step()  # a no-op until the accumulation boundary
                step_loss += loss.item() / args.grad_accum
            train_seconds += time.perf_counter() - t0
            if not math.isfinite(step_loss):
                raise FloatingPointError(f"loss is {step_loss} at step {step}")
            losses.append(step_loss)
            bar.update(1)
            bar.set_postfix_str(postfix(step_loss, step * tokens_per_step / train_seconds, engine),
                                refresh=False)
            if args.eval_every and step % args.eval_every == 0 and step != args.steps:
                evals.append({"step": step, "val_loss": evaluate(engine, val_data, args)})
                bar.write(f"step {step}: val loss {evals[-1]['val_loss']:.4f}")
    finally:
        bar.close()
    val_after = evaluate(engine, val_data, args)
    evals.append({"step": args.steps, "val_loss": val_after})
    tail = max(1, min(10, len(losses) // 4))
    return {"losses": losses, "tail": tail, "val_before": val_before, "val_after": val_after,
            "evals": evals, "train_seconds": train_seconds,
            "tokens": args.steps * tokens_per_step}


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    try:
        data = load_corpus(args.corpus_bytes)
    except StdlibSourcesNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    train_data, val_data = split_corpus(data, val_fraction=0.05)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    # the swap directory offload makes (<nvme-path>/rank0) and the parents it needs
    created = _created_parents(os.path.join(args.nvme_path, "rank0")) if args.offload == "nvme" else []
    print(f"{args.model}: {n_params / 1e6:.2f}M parameters, offload {args.offload}"
          + (f" ({args.nvme_path})" if args.offload == "nvme" else "")
          + f", corpus {data.numel() / MIB:.1f} MiB of stdlib source, {args.precision}, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    engine = None
    try:
        engine = offload.initialize(model, engine_config(args))
        result = train(args, engine, train_data, val_data)
        report = engine.memory_report()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if engine is not None:
            engine.close()  # removes the swap files, also on error and Ctrl-C
        _cleanup(created, engine_made=engine is not None)

    losses, tail = result["losses"], result["tail"]
    first, last = losses[0], sum(losses[-tail:]) / tail
    summary = {
        "model": args.model, "params": n_params, "offload": args.offload, "precision": args.precision,
        "steps": args.steps, "tokens": result["tokens"],
        "first_loss": round(first, 4), "last_loss": round(last, 4), "last_loss_mean_of": tail,
        "val_loss_before": round(result["val_before"], 4), "val_loss_after": round(result["val_after"], 4),
        "tokens_per_s": round(result["tokens"] / result["train_seconds"], 1),
        "train_seconds": round(result["train_seconds"], 2),
        "wall_seconds": round(time.perf_counter() - start, 2),
        "peak_mib": {t: round(report[t]["peak"] / MIB, 2) for t in ("device", "host", "nvme")},
        "peak_rss_mib": round(peak_rss() / MIB, 1),
    }
    if args.eval_every:
        summary["evals"] = [{"step": e["step"], "val_loss": round(e["val_loss"], 4)} for e in result["evals"]]
    print(json.dumps(summary), flush=True)
    if not last < first:
        print(f"error: the training loss did not fall (first {first:.4f}, mean of the last {tail} "
              f"steps {last:.4f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
