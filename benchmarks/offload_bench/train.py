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
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_CONTENDERS = ("torch", "offload-cpu", "offload-nvme", "deepspeed-cpu", "deepspeed-nvme")
CONTENDERS = DEFAULT_CONTENDERS + ("offload-nvme-unchecked",)

# The benchmark model of the issue, and the --quick one.
FULL_MODEL = dict(vocab_size=8192, hidden=1024, layers=4, heads=16, max_seq=128, tie_embeddings=False)
QUICK_MODEL = dict(vocab_size=512, hidden=128, layers=2, heads=4, max_seq=32, tie_embeddings=False)

# What ours and DeepSpeed's aio read alike (DeepSpeed's defaults, but queue depth 32 as in bench io).
AIO = {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 1,
       "single_submit": False, "overlap_events": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help=f"comma-separated, in run order (default: {','.join(DEFAULT_CONTENDERS)}; "
                        f"also: {','.join(CONTENDERS[len(DEFAULT_CONTENDERS):])})")
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
    p.add_argument("--timeout", type=int, default=1800, help="seconds per contender before it is stopped")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile one extra step of the offload contenders; keep the top N functions")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke test")
    p.add_argument("--out", default="bench_out",
                   help="directory for train.json, train.png and the offload contenders' traces (default bench_out)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one contender
    p.add_argument("--child-spec", default=None, help=argparse.SUPPRESS)


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
        "model": QUICK_MODEL if quick else FULL_MODEL,
        "warmup": args.warmup if args.warmup is not None else (1 if quick else 2),
        "steps": args.steps if args.steps is not None else (3 if quick else 10),
        "batch": args.batch if args.batch is not None else (2 if quick else 4),
        "seq": args.seq if args.seq is not None else (32 if quick else 128),
        "lr": args.lr,
        "seed": args.seed,
        "rounds": args.rounds,
    }


# --------------------------------------------------------------------- child

def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def _child(name: str, spec: dict) -> dict:
    """Runs one contender in this process; returns its figures."""
    import resource

    import torch

    from offload_bench.gpt import GPT, GPTConfig, lm_loss

    s = spec["settings"]
    res: dict = {"name": name, "torch_threads": torch.get_num_threads(), "rss_after_import": _rss()}
    torch.manual_seed(s["seed"])
    model = GPT(GPTConfig(**s["model"]))
    res["params"] = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(s["seed"] + 1)
    n_batches = s["warmup"] + s["steps"] + 1
    batches = [torch.randint(0, s["model"]["vocab_size"], (s["batch"], s["seq"] + 1), generator=gen)
               for _ in range(n_batches)]
    res["rss_after_model"] = _rss()

    t0 = time.perf_counter()
    engine = None
    if name == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.0, fused=True)

        def step(tokens):
            logits = model(tokens[:, :-1])
            loss = lm_loss(logits, tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    elif name.startswith("offload-"):
        import offload

        engine = offload.initialize(model, spec["config"])

        def step(tokens):
            loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            return loss
    elif name.startswith("deepspeed-"):
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=copy.deepcopy(spec["config"]))

        def step(tokens):
            loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            return loss
    else:
        raise ValueError(f"unknown contender {name!r}")
    res["init_s"] = round(time.perf_counter() - t0, 3)
    res["rss_after_init"] = _rss()

    losses, times = [], []
    stores = engine.swap_stores if name.startswith("offload-") else []
    moved = None
    for i in range(s["warmup"] + s["steps"]):
        if i == s["warmup"]:
            moved = [(st.stats.bytes_read, st.stats.bytes_written) for st in stores]
            usage = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        loss = step(batches[i])
        dt = time.perf_counter() - t
        losses.append(float(loss.detach()))
        if i >= s["warmup"]:
            times.append(dt)
        print(f"[{name}] step {i} {'warmup' if i < s['warmup'] else 'timed'} "
              f"{dt:.3f} s loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    # CPU seconds (user, system) and page faults per timed step: on 2 cores a
    # step whose CPU time nears twice its wall time is short of cores, not disk.
    end = resource.getrusage(resource.RUSAGE_SELF)
    res["cpu_s_per_step"] = {"user": round((end.ru_utime - usage.ru_utime) / s["steps"], 3),
                             "system": round((end.ru_stime - usage.ru_stime) / s["steps"], 3)}
    res["page_faults_per_step"] = (end.ru_minflt - usage.ru_minflt) // s["steps"]
    if stores:
        # Bytes moved per timed step, and where the last step's time went (Note [timeline]).
        res["bytes_read_per_step"] = sum(st.stats.bytes_read - r for st, (r, _) in zip(stores, moved)) // s["steps"]
        res["bytes_written_per_step"] = sum(st.stats.bytes_written - w
                                            for st, (_, w) in zip(stores, moved)) // s["steps"]
    if name.startswith("offload-"):
        tl = engine.timeline()
        res["timeline"] = {"wall_s": round(tl["wall_s"], 4),
                           "seconds": {k: round(v, 4) for k, v in tl["seconds"].items()}}
        if spec.get("trace_dir"):
            engine.export_chrome_trace(os.path.join(spec["trace_dir"], f"{name}.trace.json"))
    res["step_times_s"] = [round(t, 4) for t in times]
    res["median_s"] = round(statistics.median(times), 4)
    res["tokens_per_s"] = round(s["batch"] * s["seq"] / res["median_s"], 1)
    res["losses"] = [round(x, 5) for x in losses]

    if spec.get("profile") and name.startswith("offload-"):
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        step(batches[-1])
        prof.disable()
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("tottime").print_stats(spec["profile"])
        st.sort_stats("cumulative").print_stats(spec["profile"])
        res["profile_step_s"] = round(time.perf_counter() - t, 4)
        res["profile"] = out.getvalue()
        print(res["profile"], file=sys.stderr, flush=True)

    if name.startswith("offload-"):
        res["memory_report"] = engine.memory_report()
        engine.close()
    from offload.engine.memory import peak_rss_bytes  # after the run: the import adds nothing to its peak

    res["peak_rss_bytes"] = peak_rss_bytes()
    res["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def _child_main(name: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    # Everything the contender prints (DeepSpeed logs on fd 1) goes to stderr;
    # the figures go to the result file.
    os.dup2(2, 1)
    res = _child(name, spec)
    Path(spec["result"]).write_text(json.dumps(res))
    return 0


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
    cmd = [sys.executable, "-m", "offload_bench.train", "--child", name, "--child-spec", str(spec_path)]
    log(f"== {name}")
    load = OtherLoad()
    t0 = time.perf_counter()
    tail: list[str] = []
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        for line in proc.stderr:  # echo the child's log, keep the tail for the JSON on failure
            sys.stderr.write(line)
            tail = (tail + [line.rstrip()])[-40:]
            if time.monotonic() > deadline:
                proc.kill()
                break
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
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


def run(args) -> int:
    if args.child:
        return _child_main(args.child, args.child_spec)
    from offload_bench.common import log, machine_info, write_json

    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    bad = [n for n in names if n not in CONTENDERS]
    if bad:
        log(f"unknown contender(s) {bad}; choose from {', '.join(CONTENDERS)}")
        return 2
    if args.rounds < 1:  # refused before anything is made (the --out and NVMe directories)
        log(f"--rounds must be at least 1, got {args.rounds}")
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
        "peak_rss_source": "VmHWM of the contender's own process (/proc/self/status)",
        "results": {},
    }
    results = report["results"]
    workdir = Path(tempfile.mkdtemp(prefix="offload-train-bench-"))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)  # the contenders write traces there
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for round_index in range(args.rounds):
            for name in names:
                spec = {"settings": settings, "profile": args.profile, "trace_dir": args.out}
                if name != "torch":
                    mode = name.split("-")[1]
                    spec["config"] = configs[mode]
                    if name.endswith("-unchecked"):
                        spec["config"] = {**configs[mode], "aio": {**configs[mode]["aio"],
                                                                   "verify_swap_checksums": False}}
                    if mode == "nvme":
                        (nvme_root / "swap").mkdir(parents=True, exist_ok=True)
                if name.startswith("deepspeed-"):
                    spec["port"] = _free_port()
                r = _run_one(name, spec, args.timeout, workdir)
                rounds[name].append(r)
                shutil.rmtree(nvme_root / "swap", ignore_errors=True)
                if "median_s" in r:
                    log(f"   {name} (round {round_index + 1}/{args.rounds}): {r['median_s']:.3f} s/step, "
                        f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
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
    report["machine"]["load_average_end"] = list(os.getloadavg())
    if args.out:
        title = (f"GPT {report['params'] / 1e6:.1f}M params, batch {settings['batch']} x seq "
                 f"{settings['seq']}, fp32; median of {settings['steps']} steps"
                 f"{f' x {args.rounds} rounds' if args.rounds > 1 else ''}; "
                 f"{report['machine']['cpu_model']}, {report['machine']['cpu_count']} cores")
        png = _plot(results, args.out, title)
        if png:
            report["png"] = str(png)
    write_json(report, args.out, "train.json")
    ok = all("median_s" in r for r in results.values())
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload bench train", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
