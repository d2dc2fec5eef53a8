"""`offload bench train`: one training run, ours beside DeepSpeed ZeRO-3 and plain torch.

The same GPT (vocab 8192, hidden 1024, 4 layers, untied head: 67.3M
parameters), the same seeded initialisation, the same random token batches
(batch 4, sequence 128, fp32) and, for ours and DeepSpeed, the same
DeepSpeed JSON config (`ds_config`): stage 3, parameters and optimizer
offloaded to the host (`cpu`) or to NVMe (`nvme`), AdamW lr 1e-4. Contenders:

  torch           plain torch in memory, torch.optim.AdamW(fused=True)
  offload-cpu     offload.initialize, offload_param/offload_optimizer cpu
  offload-nvme    ... nvme, under --nvme-dir
  deepspeed-cpu   deepspeed.initialize with the same config
  deepspeed-nvme  ... nvme, under --nvme-dir
  fsdp2-cpu       torch's FSDP2 (fully_shard per block, CPUOffloadPolicy), world
                  size 1 (in the default run with --device cuda)
  offload-nvme-unchecked  offload-nvme with aio.verify_swap_checksums false (not in
                  the default run; beside offload-nvme it measures what the swap
                  files' CRC-32C costs: benchmarks/RESULTS.md, "Swap checksums")

Each contender runs in its own subprocess, one after the other, so its peak
resident memory is its own: VmHWM of that process (the high-water mark of its
address space, which starts afresh at exec; `ru_maxrss` is recorded too, but
Linux carries the parent's RSS at fork into it). A step is forward + loss +
backward + optimizer step; `--warmup` steps untimed, then the median of
`--steps` timed steps. With `--rounds N` the contenders run N times in
rotation (torch, ours, DeepSpeed, torch, ...) and each one's figure is the
median of its round medians: this VM's speed drifts by 10-20% over minutes,
and a rotation spreads the drift over every contender instead of handing it
to whichever ran during a slow spell. A contender that fails has its error in the JSON and
the run goes on. JSON on stdout (progress and the contenders' logs on
stderr), train.json and train.png under --out.

Per contender: median step time, tokens/s, and TFLOPS as model FLOPs, 6 x
parameters x tokens per step over the step time (attention's seq^2 term left
out); with --device cuda also peak GPU memory (torch.cuda.max_memory_allocated).

--device picks where compute runs (offload_bench/train_contenders.py says how
each contender uses it):
  cpu   (default) everything on the host, ours with OFFLOAD_DEVICE=cpu
  cuda  the GPU readiness run: every contender on the GPU, ours with
        OFFLOAD_DEVICE=cuda; refused at once where CUDA is absent
  sim   ours on the simulated device (OFFLOAD_DEVICE=sim, OFFLOAD_SIM_GBPS from
        --sim-gbps): for each offload contender, how much of the last step's
        host<->device copy time and NVMe read time was hidden behind compute
        (Note [hidden transfer time] in offload/device/overlap.py), the copies'
        timeline in the JSON, and train_copies.png where matplotlib is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

DEFAULT_CONTENDERS = ("torch", "offload-cpu", "offload-nvme", "deepspeed-cpu", "deepspeed-nvme")
CONTENDERS = DEFAULT_CONTENDERS + ("offload-nvme-unchecked", "fsdp2-cpu")
DEVICES = ("cpu", "cuda", "sim")
# The default run per --device: the GPU run adds FSDP2; the sim concerns ours
# (DeepSpeed and FSDP2 do not go through our device layer).
DEVICE_CONTENDERS = {"cpu": DEFAULT_CONTENDERS,
                     "cuda": ("torch", "offload-cpu", "offload-nvme", "fsdp2-cpu", "deepspeed-cpu", "deepspeed-nvme"),
                     "sim": ("torch", "offload-cpu", "offload-nvme")}
SIM_CONTENDERS = ("torch", "offload-cpu", "offload-nvme", "offload-nvme-unchecked")
DEFAULT_SIM_GBPS = 25.0

# The benchmark models (--model), and the --quick one. 67m: the default since
# the first benchmark; 1b: 0.94B parameters, the GPU measurement's shape (hidden
# 2048, 16 layers, vocab 32000; run it with --batch 8 --seq 1024).
FULL_MODEL = dict(vocab_size=8192, hidden=1024, layers=4, heads=16, max_seq=128, tie_embeddings=False)
MODELS = {"67m": FULL_MODEL,
          "1b": dict(vocab_size=32000, hidden=2048, layers=16, heads=16, max_seq=1024, tie_embeddings=False)}
QUICK_MODEL = dict(vocab_size=512, hidden=128, layers=2, heads=4, max_seq=32, tie_embeddings=False)
# --deadline: kept back for the disk probe, the plot and train.json; a contender
# that would get less than MIN_CONTENDER_S is not started (recorded as skipped).
DEADLINE_MARGIN_S = 20.0
MIN_CONTENDER_S = 20.0

# What ours and DeepSpeed's aio read alike (DeepSpeed's defaults, but queue depth 32 as in bench io).
AIO = {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 1,
       "single_submit": False, "overlap_events": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contenders", default=None,
                   help=f"comma-separated, in run order (default: {','.join(DEFAULT_CONTENDERS)}; with "
                        f"--device cuda also fsdp2-cpu; with --device sim torch and ours only; "
                        f"also: {','.join(CONTENDERS[len(DEFAULT_CONTENDERS):])})")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where compute runs: cpu (default), cuda (the GPU readiness run), or sim "
                        "(ours on the simulated device, with the hidden share of its transfers)")
    p.add_argument("--sim-gbps", type=float, default=None,
                   help=f"--device sim: host<->device bandwidth in GB/s (default {DEFAULT_SIM_GBPS:g})")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; --quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps, median kept (default 10; --quick: 3)")
    p.add_argument("--batch", type=int, default=None, help="micro batch (default 4; --quick: 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; --quick: 32)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nvme-dir", default=None,
                   help="directory for the nvme contenders' swap files, removed after each "
                        "(default: a fresh temporary directory under the current directory)")
    p.add_argument("--buffer-count", type=int, default=None,
                   help="zero_optimization.offload_param.buffer_count for the nvme runs (default: "
                        "DeepSpeed needs one buffer per parameter swapped in at once; see below)")
    p.add_argument("--buffer-size", type=float, default=None,
                   help="zero_optimization.offload_param.buffer_size, elements (default: the largest parameter)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the contenders this many times in rotation; median of round medians (default 1)")
    p.add_argument("--model", choices=tuple(MODELS), default="67m",
                   help="the GPT trained: 67m (default; vocab 8192, hidden 1024, 4 layers) or 1b (0.94B: "
                        "vocab 32000, hidden 2048, 16 layers; with --batch 8 --seq 1024 as measured on a GPU)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per contender before it is stopped")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="seconds from now by which the whole run ends and train.json is written: each "
                        "contender gets at most what is left (less %.0f s); one that would get under %.0f s is "
                        "skipped (for a machine lent for minutes)" % (DEADLINE_MARGIN_S, MIN_CONTENDER_S))
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile one extra step of the offload contenders; keep the top N functions")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke test")
    p.add_argument("--out", default="bench_out",
                   help="directory for train.json, train.png and the offload contenders' traces (default bench_out)")


# --------------------------------------------------------------------- config

def ds_config(device: str, *, batch: int, lr: float, nvme_path: str | None = None,
              largest_param: int | None = None, buffer_count: int | None = None,
              buffer_size: int | None = None) -> dict:
    """The one config ours and DeepSpeed both get; nvme adds only what nvme needs.

    device "none" is not used here (the torch contender has no config)."""
    cfg = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,  # DeepSpeed otherwise logs every 10 steps
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": device},
            "offload_optimizer": {"device": device},
        },
    }
    if device == "nvme":
        zero = cfg["zero_optimization"]
        zero["offload_param"]["nvme_path"] = nvme_path
        zero["offload_optimizer"]["nvme_path"] = nvme_path
        # DeepSpeed's parameter swapper holds buffer_count buffers of buffer_size
        # elements; a module whose offloaded parameters (plus those prefetched)
        # outnumber the buffers fails with "Not enough swap buffers". Sized
        # from the model: the largest parameter per buffer, and enough buffers.
        zero["offload_param"]["buffer_count"] = buffer_count if buffer_count is not None else 8
        zero["offload_param"]["buffer_size"] = int(buffer_size if buffer_size is not None else largest_param)
        cfg["aio"] = dict(AIO)
    return cfg


def _settings(args) -> dict:
    quick = args.quick
    return {
        "model": QUICK_MODEL if quick else MODELS[args.model],
        "warmup": args.warmup if args.warmup is not None else (1 if quick else 2),
        "steps": args.steps if args.steps is not None else (3 if quick else 10),
        "batch": args.batch if args.batch is not None else (2 if quick else 4),
        "seq": args.seq if args.seq is not None else (32 if quick else 128),
        "lr": args.lr,
        "seed": args.seed,
        "rounds": args.rounds,
    }


# --------------------------------------------------------------------- parent

def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_one(name: str, spec: dict, timeout: int, workdir: Path) -> dict:
    from offload_bench.common import OtherLoad, log

    spec_path = workdir / f"{name}.spec.json"
    spec["result"] = str(workdir / f"{name}.result.json")
    spec_path.write_text(json.dumps(spec))
    import offload

    # the child imports offload and offload_bench from where this process found them
    roots = [str(Path(offload.__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(roots + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # Ours uses the device layer --device names (Note [device layer]), never CUDA by default.
    env["OFFLOAD_DEVICE"] = spec["device"]
    if spec["device"] == "sim":
        env["OFFLOAD_SIM_GBPS"] = repr(spec["sim_gbps"])
    cmd = [sys.executable, "-m", "offload_bench.train_contenders", name, str(spec_path)]
    log(f"== {name}")
    load = OtherLoad()
    t0 = time.perf_counter()
    tail: list[str] = []
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + timeout
        # A contender that goes quiet (a long swap-out, a hang) is stopped on time
        # too: the timer kills its whole session, which ends the read below.
        watchdog = threading.Timer(timeout, _kill_session, args=(proc,))
        watchdog.daemon = True
        watchdog.start()
        try:
            for line in proc.stderr:  # echo the child's log, keep the tail for the JSON on failure
                sys.stderr.write(line)
                tail = (tail + [line.rstrip()])[-40:]
            rc = proc.wait()
        finally:
            watchdog.cancel()
    except OSError as exc:
        return {"name": name, "error": f"could not start: {exc}"}
    wall = round(time.perf_counter() - t0, 1)
    result_path = Path(spec["result"])
    if rc == 0 and result_path.exists():
        res = json.loads(result_path.read_text())
    else:
        timed_out = time.monotonic() > deadline
        err = next((line for line in reversed(tail) if "Error" in line or "error" in line), None)
        res = {"name": name, "error": ("timed out after %d s" % timeout) if timed_out else
               (err or f"exit status {rc}"), "exit_status": rc, "log_tail": tail}
        log(f"!! {name} failed: {res['error']}")
    res["wall_s"] = wall
    res["other_load_share"] = load.share()
    return res


def _kill_session(proc: subprocess.Popen) -> None:
    """Kills a contender and what it started (DeepSpeed's and torch's workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _merge_rounds(rounds: list[dict]) -> dict:
    """One contender's figures over rounds: the last round's details (timeline,
    memory report), the median of the round medians, the highest peak RSS."""
    failed = next((r for r in rounds if "median_s" not in r), None)
    if failed is not None:
        return failed
    if len(rounds) == 1:
        return rounds[0]
    merged = dict(rounds[-1])
    merged["median_s"] = round(statistics.median(r["median_s"] for r in rounds), 4)
    merged["tokens_per_s"] = round(rounds[-1]["tokens_per_s"] * rounds[-1]["median_s"] / merged["median_s"], 1)
    merged["tflops"] = float(f"{rounds[-1]['tflops'] * rounds[-1]['median_s'] / merged['median_s']:.4g}")
    if "peak_gpu_bytes" in merged:
        merged["peak_gpu_bytes"] = max(r["peak_gpu_bytes"] for r in rounds)
    merged["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
    merged["step_times_s"] = [t for r in rounds for t in r["step_times_s"]]
    merged["other_load_share"] = max(r["other_load_share"] for r in rounds)
    merged["rounds"] = [{k: r.get(k) for k in ("median_s", "peak_rss_bytes", "other_load_share", "wall_s")}
                        for r in rounds]
    return merged


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _ratios(results: dict) -> dict:
    def get(name, key):
        r = results.get(name) or {}
        return r.get(key)

    out = {}
    for mode in ("cpu", "nvme"):
        ours, ds = f"offload-{mode}", f"deepspeed-{mode}"
        t = _ratio(get(ours, "median_s"), get(ds, "median_s"))
        m = _ratio(get(ours, "peak_rss_bytes"), get(ds, "peak_rss_bytes"))
        out[f"{ours}/{ds}"] = {"time": t, "peak_rss": m,
                               "faster_and_smaller": (t < 1 and m < 1) if t and m else None}
        out[f"{ours}/torch"] = {"time": _ratio(get(ours, "median_s"), get("torch", "median_s")),
                                "peak_rss": _ratio(get(ours, "peak_rss_bytes"), get("torch", "peak_rss_bytes"))}
        out[f"{ds}/torch"] = {"time": _ratio(get(ds, "median_s"), get("torch", "median_s")),
                              "peak_rss": _ratio(get(ds, "peak_rss_bytes"), get("torch", "peak_rss_bytes"))}
    if "fsdp2-cpu" in results:
        out["offload-cpu/fsdp2-cpu"] = {key: _ratio(get("offload-cpu", f), get("fsdp2-cpu", f)) for key, f in
                                        (("time", "median_s"), ("peak_rss", "peak_rss_bytes"),
                                         ("peak_gpu", "peak_gpu_bytes"))}
    return out


def _disk_gbps(directory: Path, nbytes: int = 512 << 20) -> dict:
    """This disk's write and read bandwidth through our own store (direct I/O)."""
    import torch

    from offload.aio import aligned_tensor
    from offload.aio.swap_store import SwapConfig, SwapStore

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


def _roofline(results: dict, nvme_root: Path) -> dict:
    """The I/O roofline of each NVMe contender of ours: max(in-memory compute time,
    time to move its bytes at this disk's bandwidth, reads and writes in turn)."""
    disk = _disk_gbps(nvme_root / "probe")
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


def _print_breakdown(results: dict, roofline: dict) -> None:
    from offload_bench.common import log

    for name, r in results.items():
        if "timeline" not in r:
            continue
        sec = r["timeline"]["seconds"]
        line = ", ".join(f"{k} {v:.3f}" for k, v in sec.items())
        log(f"   {name} last step {r['timeline']['wall_s']:.3f} s: {line} (read/write overlap compute; "
            f"'wait' is what compute waited)")
        roof = roofline["contenders"].get(name)
        if roof:
            log(f"   {name}: {r['bytes_read_per_step'] / 1e9:.3f} GB read + {r['bytes_written_per_step'] / 1e9:.3f} "
                f"GB written per step; I/O alone {roof['io_s']:.3f} s at {roofline['disk']}; roofline "
                f"{roof['roofline_s']:.3f} s; step / roofline = {roof['step_over_roofline']}")


def _plot(results: dict, out_dir: str, title: str):
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


def _sim_gbps(args) -> float | None:
    if args.device != "sim":
        return None
    return DEFAULT_SIM_GBPS if args.sim_gbps is None else args.sim_gbps


def _refuse_device(args, names: list[str]) -> str | None:
    """Why --device (with --sim-gbps and the contenders) cannot run here, or None;
    asked before anything is made."""
    if args.sim_gbps is not None and args.device != "sim":
        return f"--sim-gbps applies to --device sim only (got --device {args.device})"
    if args.device == "sim":
        if args.sim_gbps is not None and not args.sim_gbps > 0:
            return f"--sim-gbps must be a bandwidth > 0 GB/s, got {args.sim_gbps!r}"
        other = [n for n in names if n not in SIM_CONTENDERS]
        if other:
            return (f"--device sim runs ours on the simulated device; {', '.join(other)} do(es) not go "
                    f"through it (choose from {', '.join(SIM_CONTENDERS)})")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                   else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU")
            return (f"--device cuda: CUDA is not available here ({why}); run it on a GPU machine, "
                    "or use --device cpu (the default) or --device sim")
    return None


def _figures_line(r: dict) -> str:
    """Step time, tokens/s, TFLOPS (model FLOPs), peak RSS and, on cuda, peak GPU memory."""
    line = (f"{r['median_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.3g} TFLOPS, "
            f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    if "peak_gpu_bytes" in r:
        line += f", peak GPU {r['peak_gpu_bytes'] / 2**30:.2f} GiB"
    return line


def _print_hidden(results: dict) -> None:
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


def _plot_copies(results: dict, out_dir: str, title: str):
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


def run(args) -> int:
    from offload_bench.common import log, machine_info, write_json

    contenders = args.contenders if args.contenders is not None else ",".join(DEVICE_CONTENDERS[args.device])
    names = [n.strip() for n in contenders.split(",") if n.strip()]
    bad = [n for n in names if n not in CONTENDERS]
    if bad:
        log(f"unknown contender(s) {bad}; choose from {', '.join(CONTENDERS)}")
        return 2
    refused = _refuse_device(args, names)
    if refused:
        log(refused)
        return 2
    if args.rounds < 1:  # refused before anything is made (the --out and NVMe directories)
        log(f"--rounds must be at least 1, got {args.rounds}")
        return 2
    if args.deadline is not None and not args.deadline > 0:
        log(f"--deadline must be a number of seconds > 0, got {args.deadline:g}")
        return 2
    settings = _settings(args)
    from offload_bench.gpt import GPTConfig

    gcfg = GPTConfig(**settings["model"])
    h, v = gcfg.hidden, gcfg.vocab_size
    largest = max(v * h, gcfg.mlp_ratio * h * h)

    own_nvme = args.nvme_dir is None
    nvme_root = Path(tempfile.mkdtemp(prefix="offload-train-nvme-", dir=os.getcwd())) if own_nvme \
        else Path(args.nvme_dir)
    configs = {mode: ds_config(mode, batch=settings["batch"], lr=settings["lr"],
                               nvme_path=str(nvme_root / "swap") if mode == "nvme" else None,
                               largest_param=largest, buffer_count=args.buffer_count,
                               buffer_size=args.buffer_size)
               for mode in ("cpu", "nvme")}
    report = {
        "benchmark": "train",
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": machine_info(),
        "settings": settings,
        "params": gcfg.num_params(),
        "ds_config": configs,
        "device": args.device,
        "peak_rss_source": "VmHWM of the contender's own process (/proc/self/status)",
        "results": {},
    }
    if args.device == "cuda":
        import torch

        report["machine"]["gpu"] = torch.cuda.get_device_name()
        report["peak_gpu_source"] = ("torch.cuda.max_memory_allocated() over the warmup and timed steps "
                                     "(peak_gpu_bytes_setup: during setup)")
    if args.device == "sim":
        report["sim_gbps"] = _sim_gbps(args)
    results = report["results"]
    workdir = Path(tempfile.mkdtemp(prefix="offload-train-bench-"))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)  # the contenders write traces there
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    run_ends = time.monotonic() + (args.deadline or 0.0)
    try:
        for round_index in range(args.rounds):
            for name in names:
                spec = {"settings": settings, "profile": args.profile, "trace_dir": args.out,
                        "device": args.device, "sim_gbps": _sim_gbps(args)}
                if name.startswith(("offload-", "deepspeed-")):
                    mode = name.split("-")[1]
                    spec["config"] = configs[mode]
                    if name.endswith("-unchecked"):
                        spec["config"] = {**configs[mode], "aio": {**configs[mode]["aio"],
                                                                   "verify_swap_checksums": False}}
                    if mode == "nvme":
                        (nvme_root / "swap").mkdir(parents=True, exist_ok=True)
                if name.startswith(("deepspeed-", "fsdp2-")):
                    spec["port"] = _free_port()
                timeout = args.timeout
                if args.deadline is not None:
                    timeout = int(min(timeout, run_ends - time.monotonic() - DEADLINE_MARGIN_S))
                if timeout < MIN_CONTENDER_S and args.deadline is not None:
                    r = {"name": name, "skipped": True,
                         "error": f"skipped: {max(timeout, 0)} s left of --deadline {args.deadline:g}"}
                    log(f"!! {name} {r['error']}")
                else:
                    r = _run_one(name, spec, timeout, workdir)
                rounds[name].append(r)
                shutil.rmtree(nvme_root / "swap", ignore_errors=True)
                if "median_s" in r:
                    log(f"   {name} (round {round_index + 1}/{args.rounds}): {_figures_line(r)}")
        results.update({name: _merge_rounds(rs) for name, rs in rounds.items()})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if own_nvme:
            shutil.rmtree(nvme_root, ignore_errors=True)
    report["ratios"] = _ratios(results)
    if any(n.endswith("-nvme") and "median_s" in r for n, r in results.items()):
        try:
            report["io_roofline"] = _roofline(results, nvme_root)
        finally:
            if own_nvme:  # the disk probe made the directory again
                shutil.rmtree(nvme_root, ignore_errors=True)
        _print_breakdown(results, report["io_roofline"])
    _print_hidden(results)
    report["machine"]["load_average_end"] = list(os.getloadavg())
    if args.out:
        title = (f"GPT {report['params'] / 1e6:.1f}M params, batch {settings['batch']} x seq "
                 f"{settings['seq']}, fp32; median of {settings['steps']} steps"
                 f"{f' x {args.rounds} rounds' if args.rounds > 1 else ''}; "
                 f"{report['machine']['cpu_model']}, {report['machine']['cpu_count']} cores")
        png = _plot(results, args.out, title)
        if png:
            report["png"] = str(png)
        if args.device == "sim":
            png = _plot_copies(results, args.out, f"{title}; sim {report['sim_gbps']:g} GB/s")
            if png:
                report["copies_png"] = str(png)
    write_json(report, args.out, "train.json")
    ok = all("median_s" in r for r in results.values())
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload bench train", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
