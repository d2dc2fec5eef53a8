"""Several ranks on one host, each planning its share of it (Note [the node's share] in offload/node.py).

    python benchmarks/node_share.py [--ranks 2] [--params 1.4e9] [--steps 2] [--device cpu|sim]
                                    [--check-torch] [--out DIR]

Starts `--ranks` processes with torchrun (gloo, the cpu layer), data parallel over one
stack of fp32 linear layers (`--params` parameters, built under offload.init, each
rank holding its partition: 16 bytes a parameter / ranks) with `offload_param` and
`offload_optimizer` on "auto" and an nvme_path, and no memory.host_budget: the
default, HOST_SHARE of the host's available memory, now split among the host's
ranks. Sized so that one rank's training state fits HOST_SHARE of the whole host
(the budget each rank took before) but the ranks' together do not fit its RAM.

--device sim runs the ranks on the simulated asynchronous device (OFFLOAD_DEVICE=sim).
--check-torch builds the model plainly (not under offload.init) and has every rank
train plain PyTorch on the global batch beside it: the losses (the mean over ranks
of each step's loss) against torch's, for a small --params.

Prints JSON (each rank's plan: host budget, bytes held on the host and on NVMe, its
cores and Adam threads, step times, peak RSS; the node's sum of peak RSS against its RAM;
the plan the code before this split made: each rank 75% of the host) and writes
node_share.json and node_share.png under --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args) -> None:
    import psutil
    import torch
    import torch.distributed as dist

    import offload
    from offload import _native
    from offload.placement import HOST_SHARE
    from offload.tiers import Tier

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width = 4096
    layers = max(1, round(args.params / (width * width)))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3,
                                 "offload_param": {"device": "auto", "nvme_path": args.nvme},
                                 "offload_optimizer": {"device": "auto", "nvme_path": args.nvme}}}
    available = psutil.virtual_memory().available
    torch.manual_seed(0)  # one model, data parallel

    def stack():
        return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])

    reference = None
    if args.check_torch:
        model = stack()
        reference = copy.deepcopy(model)
    else:
        with offload.init(cfg):
            model = stack()
    batches = [torch.randn(4, width, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    x = batches[rank]  # each rank its batch
    times, losses = [], []
    with offload.initialize(model, cfg) as engine:
        plan = engine.placement()
        bound = sorted(engine._host_worker.submit(os.sched_getaffinity, 0).result())
        for _ in range(args.steps):
            t = time.perf_counter()
            loss = model(x).square().mean()
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        held = plan.held_bytes()
        mine = {"rank": rank, "params": sum(p.numel() for p in model.parameters()),
                "host_budget": plan.budgets.host, "held_host": held[Tier.HOST], "held_nvme": held[Tier.NVME],
                # getattr: the same script runs on code from before the node's share (no engine.node)
                "local_ranks": getattr(getattr(engine, "node", None), "local_ranks", None),
                "cores": list(getattr(getattr(engine, "node", None), "cores", ())),
                "adam_threads": getattr(engine.optimizer, "step_threads", None), "torch_threads": torch.get_num_threads(),
                "step_times_s": [round(t, 3) for t in times], "median_step_s": round(statistics.median(times), 3),
                "host_available_at_start": available,
                "before_host_budget": int(HOST_SHARE * available),
                "adam_thread_cores": bound, "kernel_worker_cores": _native.native.kernel_thread_cores()
                if _native.available() and hasattr(_native.native, "kernel_thread_cores") else None,
                "losses": losses}
    if reference is not None:  # plain PyTorch on the global batch: every rank's micro-batch, averaged
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-4, foreach=False)
        mine["torch_losses"] = []
        for _ in range(args.steps):
            loss = sum(reference(b).square().mean() for b in batches) / world
            loss.backward()
            opt.step()
            opt.zero_grad()
            mine["torch_losses"].append(loss.item())
    from offload.process_memory import peak_rss_bytes

    mine["peak_rss"] = peak_rss_bytes()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(args.result).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--params", type=float, default=1.4e9, help="the model's parameters (each rank holds 1/ranks)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "sim"], default="cpu")
    p.add_argument("--check-torch", action="store_true")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nvme", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, str(HERE))
    import psutil

    from offload_bench.common import machine_info, pyplot, save_png, write_json

    with tempfile.TemporaryDirectory(prefix="offload-node-share-", dir=os.getcwd()) as tmp:
        result = Path(tmp) / "ranks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
               str(Path(__file__).resolve()), "--worker", "--nvme", str(Path(tmp) / "swap"), "--result", str(result),
               "--params", str(args.params), "--steps", str(args.steps)] + (["--check-torch"] if args.check_torch else [])
        t = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, "OFFLOAD_DEVICE": args.device})
        wall = time.perf_counter() - t
        ranks = json.loads(result.read_text()) if result.exists() else []
    ram = psutil.virtual_memory().total
    report = {"benchmark": "node_share", "command": " ".join(["node_share.py"] + (argv or sys.argv[1:])),
              "machine": machine_info(), "exit_status": proc.returncode, "wall_s": round(wall, 1), "ram": ram,
              "ranks": ranks,
              "device": args.device,
              "node_peak_rss_sum": sum(r["peak_rss"] for r in ranks),
              "adam_threads_sum": sum(r["adam_threads"] or 0 for r in ranks),
              "cores": len(os.sched_getaffinity(0)),
              "max_loss_diff_vs_torch": (max(abs(a - b) for a, b in zip(ranks[0]["losses"], ranks[0]["torch_losses"]))
                                         if ranks and "torch_losses" in ranks[0] else None),
              "node_host_budget_sum": sum(r["host_budget"] for r in ranks),
              "before_host_budget_sum": sum(r["before_host_budget"] for r in ranks),
              "training_state_bytes_per_rank": [16 * r["params"] // len(ranks) for r in ranks]}
    write_json(report, args.out, "node_share.json")
    plt = pyplot("node_share.png")
    if plt is not None and ranks:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        gib = 2 ** 30
        names = [f"rank {r['rank']}" for r in ranks] + ["node"]
        host = [r["held_host"] / gib for r in ranks] + [sum(r["held_host"] for r in ranks) / gib]
        nvme = [r["held_nvme"] / gib for r in ranks] + [sum(r["held_nvme"] for r in ranks) / gib]
        ax.bar(names, host, label="planned in RAM")
        ax.bar(names, nvme, bottom=host, label="planned on NVMe")
        ax.axhline(ram / gib, color="k", linestyle="--", label="the host's RAM")
        ax.plot(names, [r["peak_rss"] / gib for r in ranks] + [report["node_peak_rss_sum"] / gib], "o",
                color="C3", label="peak RSS")
        ax.set_ylabel("GiB")
        ax.set_title(f"{len(ranks)} ranks on one host, each its share ({report['machine'].get('cpu', '')})")
        ax.legend(fontsize=8)
        save_png(fig, args.out, "node_share.png")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
