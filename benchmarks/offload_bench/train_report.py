"""What `offload bench train` prints and draws from its results (offload_bench/train.py runs them).

The per-contender figures line and the closing table (precision and model in
its title), the last step's breakdown and each timed step's critical path for
ours (Note [critical path] in offload_bench/train_timeline.py), the NVMe
roofline against this disk's bandwidth, the sim's hidden share of transfers,
and train.png / train_copies.png. Imports stay inside the functions: the
offload CLI imports train.py, and through it this module, for every command.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path


def disk_gbps(directory: Path, nbytes: int = 512 << 20) -> dict:
    """This disk's write and read bandwidth through our own store (direct I/O)."""
    import torch

    from offload.aio import aligned_tensor
    from offload.aio.swap_store import SwapStore
    from offload.aio.swap_config import SwapConfig

    directory.mkdir(parents=True, exist_ok=True)
    store = SwapStore(SwapConfig.for_tensors(str(directory), [nbytes], atomic=False))
    buf = aligned_tensor(nbytes, torch.uint8).fill_(7)
    try:
        store.swap_out("probe", buf, borrow=True).wait()  # swap files are rewritten in place: time that
        t = time.perf_counter()
        store.swap_out("probe", buf, borrow=True).wait()
        write = nbytes / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        store.swap_in("probe", out=buf).wait()
        read = nbytes / (time.perf_counter() - t) / 1e9
    finally:
        store.remove("probe")
        store.close()
    return {"write_gbps": round(write, 3), "read_gbps": round(read, 3)}


def roofline(results: dict, nvme_root: Path) -> dict:
    """The I/O roofline of each NVMe contender of ours: max(in-memory compute time,
    time to move its bytes at this disk's bandwidth, reads and writes in turn)."""
    disk = disk_gbps(nvme_root / "probe")
    shutil.rmtree(nvme_root / "probe", ignore_errors=True)
    compute = (results.get("torch") or {}).get("median_s")
    out = {"disk": disk, "in_memory_s": compute, "contenders": {}}
    for name, r in results.items():
        if "bytes_read_per_step" not in r or "median_s" not in r:
            continue
        io_s = r["bytes_read_per_step"] / disk["read_gbps"] / 1e9 + r["bytes_written_per_step"] / disk["write_gbps"] / 1e9
        roof = max(compute or 0.0, io_s)
        out["contenders"][name] = {"io_s": round(io_s, 4), "roofline_s": round(roof, 4),
                                   "step_over_roofline": round(r["median_s"] / roof, 3) if roof else None}
    return out


def print_breakdown(results: dict, roof_report: dict | None = None) -> None:
    """Ours: the last step's seconds per kind, the timed steps' median critical path
    (Note [critical path] in train_timeline.py) and, after NVMe runs, the roofline."""
    from offload_bench.common import log

    for name, r in results.items():
        if "timeline" not in r:
            continue
        sec = r["timeline"]["seconds"]
        line = ", ".join(f"{k} {v:.3f}" for k, v in sec.items())
        log(f"   {name} last step {r['timeline']['wall_s']:.3f} s: {line} (read/write overlap compute; "
            f"'wait' is what compute waited)")
        path = r.get("critical_path_median")
        if path:
            parts = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in path.items()
                              if k not in ("wall_s", "waits"))
            waits = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.3f}"
                              for k, v in path.get("waits", {}).items())
            log(f"   {name} critical path, median of {len(r['timeline_per_step'])} timed steps: "
                f"{path['wall_s']:.3f} s = {parts}" + (f" (waits: {waits})" if waits else ""))
        roof = (roof_report or {}).get("contenders", {}).get(name)
        if roof:
            log(f"   {name}: {r['bytes_read_per_step'] / 1e9:.3f} GB read + {r['bytes_written_per_step'] / 1e9:.3f} "
                f"GB written per step; I/O alone {roof['io_s']:.3f} s at {roof_report['disk']}; roofline "
                f"{roof['roofline_s']:.3f} s; step / roofline = {roof['step_over_roofline']}")


def plot(results: dict, out_dir: str, title: str):
    from offload_bench.common import pyplot, save_png

    plt = pyplot("train.png")
    if plt is None:
        return None
    names = [n for n, r in results.items() if "median_s" in r]
    if not names:
        return None
    colors = ["#888888" if n == "torch" else "#1f77b4" if n.startswith("offload") else "#d62728" for n in names]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    secs = [results[n]["median_s"] for n in names]
    rss = [results[n]["peak_rss_bytes"] / 2**30 for n in names]
    for ax, vals, label, fmt in ((a1, secs, "s / step (median)", "{:.3g}"), (a2, rss, "peak RSS (GiB)", "{:.2f}")):
        bars = ax.bar(names, vals, color=colors)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=25)
        for b, v in zip(bars, vals):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_png(fig, out_dir, "train.png")


def figures_line(r: dict) -> str:
    """Step time, tokens/s, TFLOPS (model FLOPs), peak RSS and, on cuda, peak GPU memory."""
    line = (f"{r['median_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.3g} TFLOPS, "
            f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    if "peak_gpu_bytes" in r:
        line += f", peak GPU {r['peak_gpu_bytes'] / 2**30:.2f} GiB"
    return line


def print_table(results: dict, title: str) -> None:
    """The closing table on stderr: one row per contender, its figures or why it has none.
    The title names the model, its depth, the batch and the precision every contender ran in."""
    from offload_bench.common import log

    gpu = any("peak_gpu_bytes" in r for r in results.values())
    head = ["contender", "s/step", "tokens/s", "TFLOPS", "peak RSS GiB"] + (["peak GPU GiB"] if gpu else [])
    rows = []
    for name, r in results.items():
        if "median_s" not in r:
            why = r.get("reason") or r.get("error") or "no figures"
            rows.append([name, ("skipped: " if "reason" in r else "") + why])
            continue
        row = [name, f"{r['median_s']:.4g}", f"{r['tokens_per_s']:.0f}", f"{r['tflops']:.3g}",
               f"{r['peak_rss_bytes'] / 2**30:.2f}"]
        if gpu:
            row.append(f"{r['peak_gpu_bytes'] / 2**30:.2f}" if "peak_gpu_bytes" in r else "-")
        rows.append(row)
    widths = [max(len(row[i]) for row in [head] + rows if len(row) == len(head))
              for i in range(len(head))]
    log(f"== {title}")
    for row in [head] + rows:
        if len(row) < len(head):  # a contender without figures: its reason across the columns
            log(f"   {row[0]:<{widths[0]}}  {row[1]}")
        else:
            log("   " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                  for i, (cell, w) in enumerate(zip(row, widths))))


def print_hidden(results: dict) -> None:
    """--device sim: the share of the transfer time hidden behind compute."""
    from offload_bench.common import log

    for name, r in results.items():
        sim = r.get("sim")
        if sim is None:
            continue
        if "error" in sim:
            log(f"   {name}: {sim['error']}")
            continue
        for label, key in ((f"host<->device copies at {sim['gbps']:g} GB/s", "host_device"),
                           ("NVMe reads", "nvme_reads")):
            f, median = sim[key], sim["median_hidden_fraction"][key]
            if median is None:
                log(f"   {name} {label}: none in a timed step")
                continue
            log(f"   {name} {label}: {median:.1%} of the transfer time hidden behind compute (median of "
                f"{len(sim['per_step'])} timed steps; the last: {f['hidden_fraction']:.1%}, {f['busy_s']:.4f} s "
                f"busy, {f['exposed_s']:.4f} s of it with compute blocked)")
        f = sim["host_device"]
        log(f"   {name}: {f['copies']} copies, {f['bytes'] / 1e9:.3f} GB, {f['modeled_s']:.4f} s at the "
            f"modeled bandwidth (a sim copy also spends its memcpy and poison fill); compute blocked on "
            f"the device {f['compute_blocked_s']:.4f} s of the {f['step_s']:.3f} s step")
        if "note" in sim:
            log(f"   {name}: {sim['note']}")


def plot_copies(results: dict, out_dir: str, title: str):
    """The last step's copies per stream, per offload contender (--device sim)."""
    from offload_bench.common import pyplot, save_png

    runs = [(n, r["sim"]) for n, r in results.items() if "host_device" in r.get("sim", {})]
    if not runs or not any(sim["host_device"]["timeline"] for _, sim in runs):
        return None
    plt = pyplot("train_copies.png")
    if plt is None:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.5 + 1.2 * len(runs)), squeeze=False)
    for ax, (name, sim) in zip(axes[:, 0], runs):
        copies = sim["host_device"]["timeline"]
        f = sim["host_device"]
        streams = sorted({c["stream"] for c in copies})
        for row, stream in enumerate(streams):
            bars = [(c["start_s"], (f["step_s"] if c["end_s"] is None else c["end_s"]) - c["start_s"])
                    for c in copies if c["stream"] == stream]
            ax.broken_barh(bars, (row - 0.4, 0.8), color="#1f77b4")
        ax.broken_barh([(start, end - start) for start, end in f["compute_blocked"]],
                       (len(streams) - 0.4, 0.8), color="#d62728")
        ax.set_yticks(range(len(streams) + 1), streams + ["compute blocked"])
        ax.set_xlim(0, f["step_s"])
        share = "n/a" if f["hidden_fraction"] is None else f"{f['hidden_fraction']:.0%}"
        ax.set_title(f"{name}: {share} of the copies' busy time hidden behind compute", fontsize=9)
    axes[-1, 0].set_xlabel("seconds from the step's start")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_png(fig, out_dir, "train_copies.png")
