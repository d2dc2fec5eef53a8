"""`offload bench soak`: a long NVMe run that must leave no trace as it goes.

A small GPT (vocab 256, hidden 128, 2 layers, untied head: 0.46M
parameters; batch 4, sequence 64, fp32) is trained with parameters and AdamW
state on NVMe (a temporary directory, or --nvme-dir) through the user's own
loop, as docs/guide/huggingface.md shows: `model(x)`, `loss.backward()`,
`engine.optimizer.step()`, `engine.optimizer.zero_grad()`. Every
--checkpoint-every steps `engine.save_checkpoint(dir, tag)` runs and the
checkpoints older than the last --keep are deleted, as a user's script does;
at --load-at the checkpoint just saved is loaded back (`load_checkpoint`), so
the load path runs mid-soak too.

Every --sample-every steps (after the step, and after the checkpoint at a
checkpoint step) it samples: resident memory (RSS), open file descriptors,
threads (Python's and the OS's count), the swap directory's and the
checkpoint directory's disk usage (allocated blocks, as du) and file counts,
and the number of objects the garbage collector tracks. Flat means, after
--warmup steps:
  - RSS grows by at most --rss-tolerance-mib MiB and --rss-tolerance-pct %
    from the sample at --warmup to the last one (the smaller of the two);
  - fds, threads, swap bytes and files, checkpoint bytes and files never
    exceed, at a later checkpoint, what they were right after the first
    checkpoint past the warmup (the checkpoint series: the first with --keep
    checkpoints on disk), i.e. nothing grows across checkpoint cycles.
For each series the JSON has its start, end, min, max, range and the fitted
slope per 100 steps. After `engine.close()`: nothing is left under the swap
directory, and the open fds are back to their count before `initialize`.
A failed check is named on stderr and in the JSON, and the exit status is 1.
JSON on stdout (progress on stderr), soak.json and soak.png under --out.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = dict(vocab_size=256, hidden=128, layers=2, heads=4, max_seq=64, tie_embeddings=False)

# Series sampled every --sample-every steps: name -> (unit shown, divisor for the figure).
SERIES = {
    "rss": ("MiB", 2**20),
    "fds": ("", 1),
    "threads_python": ("", 1),
    "threads_os": ("", 1),
    "swap_bytes": ("MiB", 2**20),
    "swap_files": ("", 1),
    "checkpoint_bytes": ("MiB", 2**20),
    "checkpoint_files": ("", 1),
    "gc_objects": ("", 1),
}
# Those that must not grow at all across checkpoint cycles (RSS has its tolerance;
# gc_objects is reported to find a leak's cause, not judged).
NO_GROWTH = ("fds", "threads_python", "threads_os", "swap_bytes", "swap_files",
             "checkpoint_bytes", "checkpoint_files")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept on disk; older ones are deleted")
    p.add_argument("--load-at", type=int, default=None,
                   help="step after whose checkpoint load_checkpoint runs (default: the checkpoint "
                        "step nearest half way; 0: never)")
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument("--warmup", type=int, default=None,
                   help="steps before the flatness checks start (default: --checkpoint-every)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-tolerance-mib", type=float, default=20.0)
    p.add_argument("--rss-tolerance-pct", type=float, default=5.0)
    p.add_argument("--nvme-dir", default=None,
                   help="swap root (default: a fresh temporary directory under the current directory, "
                        "removed at the end); checkpoints go beside it in the temporary directory")
    p.add_argument("--out", default="bench_out", help="directory for soak.json and soak.png (default bench_out)")


def _du(root: Path) -> tuple[int, int]:
    """(allocated bytes, regular files) under root, recursively; (0, 0) if it is gone."""
    size = files = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            size += st.st_blocks * 512
            files += 1
    return size, files


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself holds


def _sample(step: int, process, swap_root: Path, ckpt_root: Path) -> dict:
    swap_bytes, swap_files = _du(swap_root)
    ckpt_bytes, ckpt_files = _du(ckpt_root)
    return {"step": step, "rss": process.memory_info().rss, "fds": _fds(),
            "threads_python": threading.active_count(), "threads_os": process.num_threads(),
            "swap_bytes": swap_bytes, "swap_files": swap_files,
            "checkpoint_bytes": ckpt_bytes, "checkpoint_files": ckpt_files,
            "gc_objects": len(gc.get_objects())}


def _summary(samples: list[dict], warmup: int, full: int) -> dict:
    """Per series, over the samples from step `warmup` on (the checkpoint directory's from step `full`,
    the first with --keep checkpoints on disk): start, end, min, max, range, slope per 100 steps."""
    out = {}
    for name in SERIES:
        kept = [s for s in samples if s["step"] >= (full if name.startswith("checkpoint_") else warmup)]
        steps = [s["step"] for s in kept]
        values = [s[name] for s in kept]
        slope = statistics.linear_regression(steps, values).slope if len(set(steps)) > 1 else 0.0
        out[name] = {"start": values[0], "end": values[-1], "min": min(values), "max": max(values),
                     "range": max(values) - min(values), "slope_per_100_steps": round(100 * slope, 3)}
    return out


def _full_from(args, warmup: int) -> int:
    """The first step after the warmup with --keep checkpoints on disk."""
    return max(warmup, args.keep * args.checkpoint_every)


def _checks(samples: list[dict], summary: dict, args, warmup: int, checkpoint_steps: list[int]) -> list[str]:
    """The failed flatness checks, each naming its series and the figures."""
    failed = []
    rss = summary["rss"]
    allowed = min(args.rss_tolerance_mib * 2**20, rss["start"] * args.rss_tolerance_pct / 100)
    if rss["end"] - rss["start"] > allowed:
        failed.append(f"rss grew {(rss['end'] - rss['start']) / 2**20:.1f} MiB from step {warmup} to the end "
                      f"(allowed {allowed / 2**20:.1f} MiB: {args.rss_tolerance_mib:g} MiB and "
                      f"{args.rss_tolerance_pct:g}%)")
    by_step = {s["step"]: s for s in samples}
    # Right after each checkpoint, once the warmup is over and --keep checkpoints are on disk.
    first = _full_from(args, warmup)
    cycles = [by_step[c] for c in checkpoint_steps if c >= first and c in by_step]
    for name in NO_GROWTH:
        if len(cycles) < 2:
            break
        base = cycles[0][name]
        grown = [(s["step"], s[name]) for s in cycles[1:] if s[name] > base]
        if grown:
            failed.append(f"{name} grew across checkpoint cycles: {base} after the checkpoint at step "
                          f"{cycles[0]['step']}, then " + ", ".join(f"{v} at step {st}" for st, v in grown))
    return failed


def run(args) -> int:
    import psutil
    import torch

    import offload
    from offload_bench.common import log, machine_info, write_json
    from offload_bench.gpt import GPT, GPTConfig, lm_loss

    every = args.checkpoint_every
    if min(args.steps, every, args.sample_every, args.keep) < 1 or every % args.sample_every:
        log("--steps, --checkpoint-every, --sample-every and --keep must be positive, and "
            f"--checkpoint-every ({every}) a multiple of --sample-every ({args.sample_every})")
        return 2
    warmup = args.warmup if args.warmup is not None else every
    checkpoint_steps = list(range(every, args.steps + 1, every))
    load_at = args.load_at if args.load_at is not None else \
        (checkpoint_steps[(len(checkpoint_steps) - 1) // 2] if checkpoint_steps else 0)
    if load_at and load_at not in checkpoint_steps:
        log(f"--load-at ({load_at}) must be a checkpoint step ({', '.join(map(str, checkpoint_steps))}) or 0")
        return 2

    work = Path(tempfile.mkdtemp(prefix="offload-soak-", dir=os.getcwd()))
    swap_root = Path(args.nvme_dir) if args.nvme_dir else work / "swap"
    ckpt_root = work / "checkpoints"
    gcfg = GPTConfig(**MODEL)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(swap_root)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap_root)},
        },
    }
    report = {"benchmark": "soak", "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
              "machine": machine_info(), "model": MODEL, "params": gcfg.num_params(), "config": config,
              "loop": "model(x); loss.backward(); engine.optimizer.step(); engine.optimizer.zero_grad()",
              "steps": args.steps, "checkpoint_every": every, "keep": args.keep, "load_at": load_at,
              "sample_every": args.sample_every, "warmup": warmup}
    process = psutil.Process()
    samples, losses, step_times = [], [], []
    try:
        torch.manual_seed(args.seed)
        model = GPT(gcfg)
        gc.collect()
        before = {"fds": _fds(), "threads_python": threading.active_count(), "threads_os": process.num_threads(),
                  "rss": process.memory_info().rss}
        engine = offload.initialize(model, config)
        gen = torch.Generator().manual_seed(args.seed + 1)
        started = time.perf_counter()
        samples.append(_sample(0, process, swap_root, ckpt_root))
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, gcfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
            t = time.perf_counter()
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad()
            step_times.append(time.perf_counter() - t)
            losses.append(float(loss.detach()))
            if step % every == 0:
                engine.save_checkpoint(ckpt_root, tag=f"step{step}")
                for old in checkpoint_steps:  # as a user's script does: keep the last --keep
                    if old <= step - args.keep * every:
                        shutil.rmtree(ckpt_root / f"step{old}", ignore_errors=True)
                if step == load_at:
                    engine.load_checkpoint(ckpt_root, tag=f"step{step}")
            if step % args.sample_every == 0:
                samples.append(_sample(step, process, swap_root, ckpt_root))
                if step % every == 0:
                    s = samples[-1]
                    log(f"step {step}: loss {losses[-1]:.4f}, RSS {s['rss'] / 2**20:.1f} MiB, fds {s['fds']}, "
                        f"threads {s['threads_os']}, swap {s['swap_bytes'] / 2**20:.2f} MiB in "
                        f"{s['swap_files']} files, checkpoints {s['checkpoint_bytes'] / 2**20:.2f} MiB in "
                        f"{s['checkpoint_files']} files, {time.perf_counter() - started:.0f} s")
        report["train_seconds"] = round(time.perf_counter() - started, 1)
        engine.close()
        del engine
        gc.collect()
        swap_left = _du(swap_root)
        report["after_close"] = {
            "swap_root_exists": swap_root.exists(), "swap_bytes": swap_left[0], "swap_files": swap_left[1],
            "swap_entries": sorted(os.listdir(swap_root)) if swap_root.exists() else [],
            "fds": _fds(), "threads_python": threading.active_count(), "threads_os": process.num_threads(),
            "rss": process.memory_info().rss}
        report["before_initialize"] = before
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = _summary(samples, warmup, _full_from(args, warmup))
    failed = _checks(samples, summary, args, warmup, checkpoint_steps)
    after = report["after_close"]
    if after["swap_files"] or after["swap_entries"]:
        failed.append(f"swap directory not empty after close: {after['swap_files']} files, "
                      f"entries {after['swap_entries']}")
    if after["fds"] > before["fds"]:
        failed.append(f"fds after close ({after['fds']}) above their count before initialize ({before['fds']})")
    report.update(median_step_s=round(statistics.median(step_times), 4),
                  losses={"first": round(losses[0], 4), "at_load": round(losses[load_at - 1], 4) if load_at else None,
                          "last": round(losses[-1], 4)},
                  summary=summary, flat=not failed, failed=failed, samples=samples)
    write_json(report, args.out, "soak.json")
    _plot(report, args.out)
    for line in failed:
        log(f"NOT FLAT: {line}")
    return 1 if failed else 0


def _plot(report: dict, out_dir) -> None:
    from offload_bench.common import pyplot, save_png

    plt = pyplot("soak.png")
    if plt is None:
        return
    panels = [("RSS (MiB)", ["rss"]), ("open fds", ["fds"]), ("threads", ["threads_os", "threads_python"]),
              ("swap directory (MiB, du)", ["swap_bytes"]), ("checkpoint directory (MiB, du)", ["checkpoint_bytes"]),
              ("files", ["swap_files", "checkpoint_files"])]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    steps = [s["step"] for s in report["samples"]]
    for ax, (title, names) in zip(axes.flat, panels):
        for name in names:
            ax.plot(steps, [s[name] / SERIES[name][1] for s in report["samples"]], label=name, linewidth=1.2)
        for c in range(report["checkpoint_every"], report["steps"] + 1, report["checkpoint_every"]):
            ax.axvline(c, color="#cccccc", linewidth=0.6, zorder=0)
        if report["load_at"]:
            ax.axvline(report["load_at"], color="#d62728", linewidth=0.8, linestyle="--", zorder=0)
        ax.axvspan(0, report["warmup"], color="#eeeeee", zorder=-1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if len(names) > 1:
            ax.legend(fontsize=8)
    m = report["machine"]
    fig.suptitle(f"soak: {report['steps']} steps, GPT {report['params'] / 1e6:.2f}M params and AdamW on NVMe, "
                 f"checkpoint every {report['checkpoint_every']} (grey), load at {report['load_at']} (red), "
                 f"warmup shaded; {'flat' if report['flat'] else 'NOT FLAT'}\n"
                 f"{m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}, {m['date']}", fontsize=10)
    fig.tight_layout()
    save_png(fig, out_dir, "soak.png")
