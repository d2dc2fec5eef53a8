#!/usr/bin/env python
"""Train a small causal LM with its parameters and optimizer state on NVMe, and keep the result.

    python examples/finetune.py                       # GPT, NVMe offload under runs/nvme, 1-2 min on 2 cores
    python examples/finetune.py --resume              # continue from the latest checkpoint (or start)
    python examples/finetune.py --resume --steps 160  # train on past the first run's 120 steps
    python examples/finetune.py --resume --stop-at 60 # a job in sessions: stop at step 60, --resume later
    python examples/finetune.py --offload cpu         # parameters and Adam state in host memory
    python examples/finetune.py --offload auto        # planned: RAM first, NVMe for what does not fit
    python examples/finetune.py --model hf            # a small LlamaForCausalLM (pip install transformers)

The corpus is the running Python's own standard library sources, byte level
(vocabulary 256), so nothing is downloaded. A progress bar (stderr) shows the
loss, tokens/s and what each memory tier holds.

What a run leaves (the defaults; --ckpt-dir and --out move them):
  runs/finetune/checkpoints/global_step{N}/  engine checkpoints every --save-every
                                             steps and at the end, the last
                                             --keep-last of them; `latest` names the newest
  runs/finetune/model.safetensors            the trained weights (fp32): they load into
                                             the plain model, safetensors.torch.load_model(
                                             GPT(GPTConfig(**json.load(open(".../config.json")))), path)
                                             (--model hf: LlamaForCausalLM.from_pretrained(".../finetune"))
  runs/finetune/config.json                  that model config
  runs/finetune/summary.json                 the run's summary and its per-step losses
The swap directory (runs/nvme) is removed however the run ends.

--resume continues from the checkpoint `latest` names: weights, Adam state,
LR schedule and RNG (engine.load_checkpoint), and from this script's
client_state the batch sampler's position, the losses and evaluations so
far, so a run stopped and resumed trains exactly as one that was not. With
no checkpoint there, --resume says so and starts at step 0, so the same
command starts a job and continues it. A run without --resume starts over:
the checkpoints an earlier run left in --ckpt-dir are removed once this run
has saved its first (until then --resume would still continue them).
The LR schedule (warmup, then cosine) spans the first run's --steps; a
resumed run with a larger --steps goes on at the schedule's final rate.

stdout ends with a few readable lines, then the summary as one JSON line
(summary.json, less its per-step losses, evaluations and sessions). The exit status is 1
if the training loss did not fall (first step against the mean of the last
ones, over the whole run, resumed parts included), 2 for bad arguments,
missing sources or a checkpoint that cannot be resumed, 130 on Ctrl-C
(the checkpoints already written stay: resume from them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import resource
import shutil
import sys
import time

import torch
from torch import nn

import offload
from offload.checkpoint_io import CheckpointError
from offload_bench.corpus import VOCAB_SIZE, BatchSampler, StdlibSourcesNotFound, load_corpus, split_corpus
from offload_bench.gpt import GPT, GPTConfig, lm_loss

MIB = 1 << 20
# Flags that define what is trained and on which batches: a resumed run must
# be given the same ones, or it would not be the run its checkpoint continues.
RUN_FLAGS = ("model", "hidden", "layers", "heads", "seq_len", "batch_size", "grad_accum", "lr",
             "weight_decay", "clip", "precision", "seed", "corpus_bytes", "eval_batches")
CLIENT_STATE_VERSION = 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=["gpt", "hf"], default="gpt",
                   help="gpt: offload_bench.gpt.GPT; hf: transformers' LlamaForCausalLM built from a config")
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=120,
                   help="optimizer steps in all (a resumed run trains up to this step)")
    t.add_argument("--stop-at", type=int, default=None,
                   help="end this run at this step (checkpoint saved), leaving the rest of --steps "
                        "to a later --resume: a job split over time-limited sessions")
    t.add_argument("--batch-size", type=int, default=8, help="micro batch (sequences)")
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--grad-accum", type=int, default=1, help="micro batches per optimizer step")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warmup, then cosine)")
    t.add_argument("--warmup", type=int, default=None,
                   help="warmup steps (default: 10%% of --steps; a resumed run keeps its checkpoint's)")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: off)")
    t.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    t.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("offload")
    o.add_argument("--offload", choices=["nvme", "cpu", "none", "auto"], default="nvme",
                   help="where parameters and optimizer state live between uses")
    o.add_argument("--nvme-path", default=os.path.join("runs", "nvme"),
                   help="swap directory for --offload nvme or auto (removed at the end if created by this run)")
    o.add_argument("--compile", metavar="BACKEND", default=None,
                   help="compile each transformer block with torch.compile's BACKEND (inductor, aot_eager), its "
                        "parameters gathered at the block's boundary: the config's compile section")
    c = p.add_argument_group("checkpoints and output")
    c.add_argument("--ckpt-dir", default=os.path.join("runs", "finetune", "checkpoints"),
                   help="engine checkpoints: <dir>/global_step{N}/ and <dir>/latest")
    c.add_argument("--save-every", type=int, default=40,
                   help="checkpoint every N optimizer steps (0: only at the end; there is always one there)")
    c.add_argument("--keep-last", type=int, default=2,
                   help="checkpoints kept: older global_step* directories go once a newer one is complete")
    c.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --ckpt-dir (none there: start at step 0)")
    c.add_argument("--out", default=os.path.join("runs", "finetune", "model.safetensors"),
                   help="the trained weights (fp32 safetensors); config.json and summary.json go beside it")
    d = p.add_argument_group("data and evaluation")
    d.add_argument("--corpus-bytes", type=int, default=4 << 20,
                   help="bytes of stdlib source to use (the last 5%% are held out)")
    d.add_argument("--eval-every", type=int, default=0,
                   help="validation loss every N steps (0: only before and after training)")
    d.add_argument("--eval-batches", type=int, default=4)
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "hidden", "layers", "heads",
                 "eval_batches", "keep_last"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("save_every", "eval_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.stop_at is not None and args.stop_at < 1:
        p.error("--stop-at must be >= 1")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    return args


# ---- model -----------------------------------------------------------------
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

    class LlamaLogits(LlamaForCausalLM):
        """forward(ids) returns the logits tensor. A subclass rather than a wrapper
        module, so the state-dict names, and so the saved weights, are
        LlamaForCausalLM's: the output directory loads with from_pretrained."""

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids=idx, use_cache=False).logits

    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaLogits(config)  # from the config: random weights, no download


def model_config(model: nn.Module) -> dict:
    """What rebuilds the plain model: GPT(GPTConfig(**it)), or LlamaConfig.from_dict(it)."""
    if isinstance(model, GPT):
        return dataclasses.asdict(model.config)
    return json.loads(model.config.to_json_string())


def planned_warmup(args) -> int:
    return args.warmup if args.warmup is not None else max(2, args.steps // 10)


def engine_config(args, schedule_steps: int, warmup: int) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": args.offload},
            "offload_optimizer": {"device": args.offload}}
    if args.offload in ("nvme", "auto"):
        zero["offload_param"]["nvme_path"] = args.nvme_path
        zero["offload_optimizer"]["nvme_path"] = args.nvme_path
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.weight_decay}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": schedule_steps, "warmup_num_steps": warmup,
                                 "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "zero_optimization": zero,
    }
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.compile:
        cfg["compile"] = {"enabled": True, "backend": args.compile}
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


def nvme_traffic(engine) -> dict[str, int]:
    """Payload bytes this process's engine read from and wrote to its swap files.
    The engine has no public counter for them; its swap stores keep one
    (SwapStats), the same figures benchmarks/large_model.py reads."""
    stores = getattr(engine, "_stores", [])
    return {"read": sum(s.stats.bytes_read for s in stores),
            "written": sum(s.stats.bytes_written for s in stores)}


def postfix(loss: float, tok_s: float, engine) -> str:
    now, rss = tiers(engine)
    mem = " ".join(f"{label} {now[t]['now'] / MIB:.1f}"
                   for label, t in (("dev", "device"), ("host", "host"), ("nvme", "nvme")))
    return f"loss {loss:.3f} | {tok_s:,.0f} tok/s | MiB {mem} | rss {rss / MIB:.0f}"


# ---- the swap directory ----------------------------------------------------------
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
    """Removes the swap directories this run created, where empty. offload removes
    its own directory inside them (at close, at exit, or when Ctrl-C or an error
    stops offload.initialize()); another job may still be using the same path."""
    _remove_if_empty(new_dirs)


# ---- checkpoints -------------------------------------------------------------
class CannotResume(Exception):
    """A checkpoint this run must not continue: another script's, or other training flags."""


def latest_tag(ckpt_dir: str) -> str | None:
    """The tag `latest` names: the newest complete checkpoint (Note [checkpoint layout])."""
    try:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def prune_checkpoints(ckpt_dir: str, keep: list[str]) -> list[str]:
    """Removes every global_step{N} directory in ckpt_dir but those named in `keep`:
    this run's older ones, an earlier run's, a later one a resumed run has left
    behind. A save in progress is `.global_step{N}.tmp` until complete: never touched."""
    removed = sorted(name for name in os.listdir(ckpt_dir)
                     if re.fullmatch(r"global_step\d+", name) and name not in keep
                     and os.path.isdir(os.path.join(ckpt_dir, name)))
    for name in removed:
        shutil.rmtree(os.path.join(ckpt_dir, name))
    return removed


def new_run_state(args, warmup: int) -> dict:
    """This script's part of a checkpoint (its client_state): with the engine's own
    state, what makes a resumed run draw the same batches and report the whole run."""
    return {"version": CLIENT_STATE_VERSION,
            "flags": {name: getattr(args, name) for name in RUN_FLAGS},
            "schedule": {"steps": args.steps, "warmup": warmup},  # the LR schedule's plan
            "step": 0, "sampler": None, "losses": [], "evals": [], "train_seconds": 0.0,
            "runs": [],  # one {"from", "to", "seconds"} per process that trained
            "checkpoints": []}  # the tags this run saved, oldest first


def check_resumable(state, args, where: str) -> None:
    if not isinstance(state, dict) or state.get("version") != CLIENT_STATE_VERSION:
        raise CannotResume(f"{where} was not written by this script (client_state version "
                           f"{state.get('version') if isinstance(state, dict) else None!r}, "
                           f"expected {CLIENT_STATE_VERSION})")
    saved = state["flags"]
    differ = [f"--{k.replace('_', '-')} {saved[k]} (this run: {getattr(args, k)})"
              for k in RUN_FLAGS if saved.get(k) != getattr(args, k)]
    if args.warmup is not None and args.warmup != state["schedule"]["warmup"]:
        differ.append(f"--warmup {state['schedule']['warmup']} (this run: {args.warmup})")
    if differ:
        raise CannotResume(f"{where} was trained with " + ", ".join(differ)
                           + ": pass the same flags to --resume, or a new --ckpt-dir to start over")


def save(engine, args, state: dict, say) -> str:
    """A checkpoint of the engine and `state` at its step; once it is complete (save_checkpoint
    returns after `latest` names it), the run's oldest beyond --keep-last and any other go."""
    tag = f"global_step{state['step']}"  # the engine's default tag, named here to be listed
    state["checkpoints"] = [t for t in state["checkpoints"] if t != tag] + [tag]
    engine.save_checkpoint(args.ckpt_dir, tag=tag, client_state=state)
    removed = prune_checkpoints(args.ckpt_dir, keep=state["checkpoints"][-args.keep_last:])
    say(f"step {state['step']}: saved {os.path.join(args.ckpt_dir, tag)}"
        + (f" (removed {', '.join(removed)})" if removed else ""))
    return tag


# ---- the run -----------------------------------------------------------------
def train(args, engine, sampler, state: dict, end: int, val_data) -> float:
    """Trains from state["step"] to `end`, saving checkpoints on the way and at `end`;
    returns this run's training seconds. `state` is updated in place."""
    from tqdm import tqdm

    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    start = state["step"]
    if not state["evals"]:
        state["evals"].append({"step": 0, "val_loss": evaluate(engine, val_data, args)})
    print(f"step {start}: val loss {state['evals'][-1]['val_loss']:.4f}; training steps {start + 1}-{end} "
          f"of {tokens_per_step} tokens", file=sys.stderr, flush=True)
    state["runs"].append({"from": start, "to": start, "seconds": 0.0})  # this process's share
    seconds = 0.0
    bar = tqdm(initial=start, total=end, desc="train", unit="step", disable=args.no_progress,
               dynamic_ncols=True, file=sys.stderr)
    try:
        for step in range(start + 1, end + 1):
            t0 = time.perf_counter()
            step_loss = 0.0
            for _ in range(args.grad_accum):
                x, y = sampler.sample()
                loss = lm_loss(engine(x), y)
                engine.backward(loss)
                engine.step()  # a no-op until the accumulation boundary
                step_loss += loss.item() / args.grad_accum
            seconds += time.perf_counter() - t0
            if not math.isfinite(step_loss):
                raise FloatingPointError(f"loss is {step_loss} at step {step}")
            state["losses"].append(step_loss)
            bar.update(1)
            bar.set_postfix_str(postfix(step_loss, (step - start) * tokens_per_step / seconds, engine),
                                refresh=False)
            if step == end:
                break  # evaluated and saved below, with everything this run adds
            if args.eval_every and step % args.eval_every == 0:
                state["evals"].append({"step": step, "val_loss": evaluate(engine, val_data, args)})
                bar.write(f"step {step}: val loss {state['evals'][-1]['val_loss']:.4f}")
            if args.save_every and step % args.save_every == 0:
                _record(state, step, sampler, seconds)
                save(engine, args, state, bar.write)
    finally:
        bar.close()
    state["evals"].append({"step": end, "val_loss": evaluate(engine, val_data, args)})
    _record(state, end, sampler, seconds)
    save(engine, args, state, lambda line: print(line, file=sys.stderr))
    return seconds


def _record(state: dict, step: int, sampler, seconds: float) -> None:
    """Brings `state` to `step`: where the sampler is, and this process's training time."""
    state["step"] = step
    state["sampler"] = sampler.generator.get_state()
    state["runs"][-1].update(to=step, seconds=round(seconds, 3))
    state["train_seconds"] = sum(r["seconds"] for r in state["runs"])


def start_or_resume(engine, args, sampler) -> tuple[dict, str | None]:
    """The run state to continue, and the checkpoint it came from (None: a new run)."""
    tag = latest_tag(args.ckpt_dir)
    if tag is None or not args.resume:
        if tag is not None:
            print(f"starting over: the checkpoints in {args.ckpt_dir} (latest {tag}) are removed once "
                  f"this run saves its first; pass --resume to continue them instead", file=sys.stderr)
        elif args.resume:
            print(f"--resume: no checkpoint in {args.ckpt_dir} (no 'latest' there): starting at step 0",
                  file=sys.stderr)
        return new_run_state(args, planned_warmup(args)), None
    where = os.path.join(args.ckpt_dir, tag)
    _, state = engine.load_checkpoint(args.ckpt_dir)  # verified first; CheckpointError changes nothing
    check_resumable(state, args, where)
    sampler.generator.set_state(state["sampler"])
    print(f"resuming from {where}: step {state['step']}, LR schedule of {state['schedule']['steps']} steps",
          file=sys.stderr)
    return state, where


def write_outputs(args, state: dict, model: nn.Module) -> dict[str, str]:
    """The weights of the newest checkpoint as one safetensors file, with config.json beside it."""
    out_dir = os.path.dirname(args.out)
    os.makedirs(out_dir or ".", exist_ok=True)
    # From the checkpoint's fp32 masters, one tensor at a time: the exact trained
    # weights, under the plain model's state-dict names (offload/checkpoint_io/consolidation.py).
    tag = latest_tag(args.ckpt_dir)  # this run's last save, or the checkpoint it resumed at
    offload.consolidate(args.ckpt_dir, args.out, tag=tag, progress=False)
    paths = {"weights": args.out, "config": os.path.join(out_dir, "config.json"),
             "summary": os.path.join(out_dir, "summary.json"),
             "checkpoint": os.path.join(args.ckpt_dir, tag)}
    with open(paths["config"], "w") as f:
        json.dump(model_config(model), f, indent=1)
    return paths


def summarize(args, state: dict, model: nn.Module, run_steps: int, run_seconds: float, report: dict,
              traffic: dict, paths: dict, resumed_from: str | None, wall: float) -> dict:
    losses = state["losses"]
    tail = max(1, min(10, len(losses) // 4))
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    summary = {
        "model": args.model, "model_config": model_config(model),
        "params": sum(p.numel() for p in model.parameters()),
        "offload": args.offload, "precision": args.precision, "compile": args.compile,
        "steps": state["step"], "steps_this_run": run_steps, "resumed_from": resumed_from,
        "lr_schedule_steps": state["schedule"]["steps"],
        "tokens": state["step"] * tokens_per_step, "tokens_this_run": run_steps * tokens_per_step,
        "first_loss": round(losses[0], 4), "last_loss": round(sum(losses[-tail:]) / tail, 4),
        "last_loss_mean_of": tail,
        "val_loss_before": round(state["evals"][0]["val_loss"], 4),
        "val_loss_after": round(state["evals"][-1]["val_loss"], 4),
        "tokens_per_s": round(run_steps * tokens_per_step / run_seconds, 1) if run_seconds else None,
        "train_seconds": round(run_seconds, 2), "train_seconds_all_runs": round(state["train_seconds"], 2),
        "wall_seconds": round(wall, 2),
        "peak_mib": {t: round(report[t]["peak"] / MIB, 2) for t in ("device", "host", "nvme")},
        "peak_rss_mib": round(peak_rss() / MIB, 1),
        "nvme_mib": {k: round(v / MIB, 1) for k, v in traffic.items()},
        **paths,
    }
    if args.eval_every:
        summary["evals"] = [{"step": e["step"], "val_loss": round(e["val_loss"], 4)} for e in state["evals"]]
    return summary


def print_summary(s: dict, args) -> None:
    """The readable lines, then the JSON summary as the last line of stdout."""
    this_run = (f"{s['steps_this_run']} steps this run ({s['steps'] - s['steps_this_run']} -> {s['steps']})"
                if s["steps_this_run"] else f"no steps this run (already at step {s['steps']})")
    speed = (f", {s['tokens_this_run']:,} tokens in {s['train_seconds']:.1f} s = {s['tokens_per_s']:,.0f} tokens/s"
             if s["tokens_per_s"] else "")
    peaks = ", ".join(f"{t} {s['peak_mib'][t]:.1f}" for t in ("device", "host", "nvme"))
    lines = [
        f"trained {s['steps']} of {args.steps} steps: {this_run}{speed}",
        f"  train loss  {s['first_loss']:.3f} (step 1) -> {s['last_loss']:.3f} "
        f"(mean of the last {s['last_loss_mean_of']} steps)",
        f"  val loss    {s['val_loss_before']:.3f} (step 0) -> {s['val_loss_after']:.3f} (step {s['steps']})",
        f"  memory      peak RSS {s['peak_rss_mib']:.0f} MiB; engine peaks (MiB): {peaks}",
    ]
    if args.offload in ("nvme", "auto"):
        lines.append(f"  NVMe I/O    {s['nvme_mib']['read']:,.1f} MiB read, {s['nvme_mib']['written']:,.1f} MiB "
                     f"written this run ({args.nvme_path}, swap files removed)")
    lines += [
        f"  weights     {s['weights']} (fp32 safetensors; model config: {s['config']})",
        f"  checkpoint  {s['checkpoint']} (continue: --resume --steps N)",
        f"  summary     {s['summary']}",
    ]
    print("\n".join(lines))
    print(json.dumps(s), flush=True)


def main(argv=None) -> int:
    wall_start = time.perf_counter()
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
    # <nvme-path> and its parents where missing (offload removes its own directory in it)
    created = _created_parents(args.nvme_path) if args.offload in ("nvme", "auto") else []
    print(f"{args.model}: {n_params / 1e6:.2f}M parameters, offload {args.offload}"
          + (f" ({args.nvme_path})" if args.offload in ("nvme", "auto") else "")
          + f", corpus {data.numel() / MIB:.1f} MiB of stdlib source, {args.precision}, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    engine = None
    try:
        # The schedule given here is a new run's; resuming replaces it with the checkpoint's.
        engine = offload.initialize(model, engine_config(args, args.steps, planned_warmup(args)))
        if engine.is_compiled:
            print(f"compiled {len(engine.compiled_blocks)} blocks ({args.compile})", file=sys.stderr)
        sampler = BatchSampler(train_data, args.batch_size, args.seq_len, seed=args.seed)
        try:
            state, resumed_from = start_or_resume(engine, args, sampler)
        except (CheckpointError, CannotResume) as exc:
            print(f"error: cannot resume: {exc}", file=sys.stderr)
            return 2
        start = state["step"]
        end = min(args.steps, args.stop_at or args.steps)
        run_seconds = 0.0
        if start < end:
            if end > state["schedule"]["steps"]:
                print(f"steps past {state['schedule']['steps']} run at the LR schedule's final rate",
                      file=sys.stderr)
            run_seconds = train(args, engine, sampler, state, end, val_data)
        else:
            print(f"already at step {start} (--steps {args.steps}"
                  + (f", --stop-at {args.stop_at}" if args.stop_at else "")
                  + "): nothing to train; pass a larger --steps to train on", file=sys.stderr)
        report, traffic = engine.memory_report(), nvme_traffic(engine)
        paths = write_outputs(args, state, model)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # Ctrl-C inside a library's cleanup can surface as another error raised while
        # handling it (tqdm's write lock: "cannot release un-acquired lock"): still Ctrl-C.
        if not _interrupted(exc):
            raise
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if engine is not None:
            engine.close()  # removes the swap files, also on error and Ctrl-C
        _cleanup(created, engine_made=engine is not None)

    summary = summarize(args, state, model, state["step"] - start, run_seconds, report, traffic, paths,
                        resumed_from, time.perf_counter() - wall_start)
    with open(paths["summary"], "w") as f:
        json.dump({**summary, "train_losses": [round(x, 6) for x in state["losses"]],
                   "evals": state["evals"], "runs": state["runs"]}, f, indent=1)
    print_summary(summary, args)
    # Over the whole run, resumed parts included: a resumed run of a few steps
    # is judged by where the run began, not by its own noisy first step.
    losses, tail = state["losses"], summary["last_loss_mean_of"]
    first, last = losses[0], sum(losses[-tail:]) / tail
    if not last < first:
        print(f"error: the training loss did not fall (first {first:.4f}, mean of the last {tail} "
              f"steps {last:.4f})", file=sys.stderr)
        return 1
    return 0


def _interrupted(exc: BaseException) -> bool:
    """Whether `exc` was raised while a KeyboardInterrupt was being handled."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
