"""Training a model whose training state is larger than this machine's RAM.

    python benchmarks/large_model.py [--layers 12 --hidden 4096] [--steps 3] [--placement nvme|auto] [--out DIR]

A GPT (vocab 8192, hidden 4096, 12 layers by default: 2.48B parameters) is
built under `offload.init` straight onto NVMe (parameters) and trained for a
few steps with AdamW state on NVMe too, fp32 throughout. Its training state,
16 bytes per parameter (weight, gradient, two moments), is about 40 GB, over
1.5x this machine's 24 GiB of RAM; the whole run must stay under a quarter of
RAM. Sizes are kept to the machine by the config: reads ahead of one shard
(sub_group_size), a gradient backlog of one shard (reduce_bucket_size).
--placement auto plans instead (Note [automatic placement]): what the default
host budget holds stays in RAM, the overflow on NVMe.

Prints JSON (parameters, training-state bytes, RAM, build time, step times,
bytes moved per step, peak RSS, the last step's timeline) and writes
large_model.json and large_model.png under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nvme-dir", default=None, help="swap directory (default: a temporary one here)")
    p.add_argument("--placement", choices=("nvme", "auto"), default="nvme",
                   help="nvme: everything on NVMe (default); auto: the planner's split")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import offload
    from offload_bench.gpt import GPT, GPTConfig, lm_loss

    gcfg = GPTConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                     max_seq=args.seq, tie_embeddings=False)
    n_params = gcfg.num_params()
    largest = max(gcfg.mlp_ratio * args.hidden * args.hidden, args.vocab * args.hidden)
    nvme = Path(args.nvme_dir) if args.nvme_dir else Path(tempfile.mkdtemp(prefix="offload-large-", dir=os.getcwd()))
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": args.placement, "nvme_path": str(nvme)},
            "offload_optimizer": {"device": args.placement, "nvme_path": str(nvme)},
            "sub_group_size": largest,
            "reduce_bucket_size": largest,
        },
    }
    ram = psutil.virtual_memory().total
    result = {"benchmark": "large_model", "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
              "params": n_params, "training_state_bytes": 16 * n_params, "ram_bytes": ram,
              "state_over_ram": round(16 * n_params / ram, 3), "config": config,
              "cpu_count": os.cpu_count(), "torch": torch.__version__}
    print(f"GPT {n_params / 1e9:.2f}B params, training state {16 * n_params / 2**30:.1f} GiB, "
          f"RAM {ram / 2**30:.1f} GiB", file=sys.stderr, flush=True)
    try:
        t = time.perf_counter()
        torch.manual_seed(0)
        with offload.init(config):
            model = GPT(gcfg)
        result["build_s"] = round(time.perf_counter() - t, 1)
        result["peak_rss_after_build"] = _vm_hwm()
        t = time.perf_counter()
        engine = offload.initialize(model, config)
        result["initialize_s"] = round(time.perf_counter() - t, 1)
        result["placement"] = {k: v for k, v in engine.placement().to_dict().items() if k != "shards"}
        print(engine.placement().summary(), file=sys.stderr, flush=True)
        print(f"built in {result['build_s']} s, initialized in {result['initialize_s']} s", file=sys.stderr,
              flush=True)
        gen = torch.Generator().manual_seed(1)
        times, losses, moved = [], [], []
        with engine:
            for step in range(args.steps):
                tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
                before = [(s.stats.bytes_read, s.stats.bytes_written) for s in engine._stores]
                t = time.perf_counter()
                loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                times.append(time.perf_counter() - t)
                losses.append(float(loss.detach()))
                moved.append((sum(s.stats.bytes_read - r for s, (r, _) in zip(engine._stores, before)),
                              sum(s.stats.bytes_written - w for s, (_, w) in zip(engine._stores, before))))
                print(f"step {step}: {times[-1]:.1f} s, loss {losses[-1]:.4f}, read {moved[-1][0] / 1e9:.1f} GB, "
                      f"written {moved[-1][1] / 1e9:.1f} GB, RSS {psutil.Process().memory_info().rss / 2**30:.2f} GiB",
                      file=sys.stderr, flush=True)
            tl = engine.timeline()
            result["memory_report"] = engine.memory_report()
            # Training's peak: close() gives the parameters back to the model
            # where they fit in memory (9.9 GB at 2.48B), which the process's
            # peak after it includes.
            result["peak_rss_training_bytes"] = _vm_hwm()
        result.update(step_times_s=[round(x, 2) for x in times], median_step_s=round(statistics.median(times), 2),
                      losses=[round(x, 4) for x in losses],
                      bytes_read_per_step=moved[-1][0], bytes_written_per_step=moved[-1][1],
                      timeline_seconds={k: round(v, 2) for k, v in tl["seconds"].items()},
                      peak_rss_bytes=_vm_hwm())
        result["peak_rss_over_ram"] = round(result["peak_rss_bytes"] / ram, 3)
        result["peak_rss_training_over_ram"] = round(result["peak_rss_training_bytes"] / ram, 3)
    finally:
        if not args.nvme_dir:
            shutil.rmtree(nvme, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "large_model.json").write_text(text)
        _plot(result, out / "large_model.png")
    return 0


def _plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(range(len(result["step_times_s"])), result["step_times_s"], color="#1f77b4")
    a1.set_xlabel("step")
    a1.set_ylabel("seconds")
    names = ["RAM", "training state", "peak RSS (training)"]
    vals = [result["ram_bytes"] / 2**30, result["training_state_bytes"] / 2**30,
            result["peak_rss_training_bytes"] / 2**30]
    bars = a2.bar(names, vals, color=["#888888", "#d62728", "#1f77b4"])
    for b, v in zip(bars, vals):
        a2.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    a2.set_ylabel("GiB")
    where = ("planned over RAM and NVMe ('auto')" if result["config"]["zero_optimization"]["offload_param"]["device"]
             == "auto" else "on NVMe")
    fig.suptitle(f"GPT {result['params'] / 1e9:.2f}B params, parameters and Adam state {where}, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
