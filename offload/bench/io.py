"""`offload bench io`: the NVMe path. Write and read GB/s of each of our
backends beside fio and DeepSpeed's async_io (when installed), in the same
run, on the same file size and settings; then a sweep of seconds over block
size, queue depth and parallelism that recommends `aio` settings for this
disk and prints the config snippet. JSON on stdout, a PNG beside it.

Every figure is O_DIRECT (the page cache is bypassed, so reads come from the
disk) and overwrites an existing file (as fio does after laying its file out),
so file-system block allocation is not part of the figure.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from offload.bench._common import log, machine_info, parse_size, pyplot, save_png, stdout_to_stderr, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default="./offload-io-bench", help="directory on the disk to measure")
    p.add_argument("--size", type=parse_size, default=None, help="file size (default 1Gi; --quick: 256Mi)")
    p.add_argument("--block-size", type=parse_size, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--parallelism", type=int, default=1, help="intra_op_parallelism")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure, median kept (default 3; --quick: 1)")
    p.add_argument("--backends", default="native,libaio,threads", help="ours to measure, comma-separated")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--quick", action="store_true", help="smaller file, one repeat, smaller sweep")
    p.add_argument("--out", default=None, help="directory for io.json and io.png (default: --path)")
    p.add_argument("--keep", action="store_true", help="keep the benchmark files")


# --------------------------------------------------------------- contenders


def _ours(backend: str, block: int, qd: int, par: int):
    import offload.aio as aio

    io = aio.AsyncIO(block_size=block, queue_depth=qd, intra_op_parallelism=par, backend=backend)
    return io.sync_pwrite, io.sync_pread, io.close


def _deepspeed(block: int, qd: int, par: int):
    with stdout_to_stderr():  # its JIT build and logger write to fd 1
        from deepspeed.ops.op_builder import AsyncIOBuilder

        lib = AsyncIOBuilder().load(verbose=False)
    handle = lib.aio_handle(block, qd, False, True, par)  # single_submit=False, overlap_events=True

    def pwrite(t, p):
        with stdout_to_stderr():  # it logs an SSD-endurance warning on fd 1 at each write
            handle.sync_pwrite(t, str(p))

    def pread(t, p):
        handle.sync_pread(t, str(p))

    return pwrite, pread, lambda: None


def _fio(path: Path, size: int, block: int, qd: int, par: int, rw: str) -> float:
    """fio's own GB/s: libaio, O_DIRECT, same file, size, block and depth;
    `par` jobs each take a contiguous 1/par of the file, as our workers do."""
    cmd = ["fio", "--name=offload-bench", f"--filename={path}", f"--size={size}", f"--bs={block}",
           f"--iodepth={qd}", "--direct=1", "--ioengine=libaio", f"--rw={rw}", "--output-format=json",
           f"--numjobs={par}", f"--offset_increment={size // par}", f"--io_size={size // par}",
           "--group_reporting", "--invalidate=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"] / 1e9


def _time_gbps(fn, buf, path, size) -> float:
    t0 = time.perf_counter()
    fn(buf, path)
    return size / (time.perf_counter() - t0) / 1e9


def _measure(names, buf, path: Path, args, block, qd, par, repeats) -> dict:
    """Median write and read GB/s per contender; repeats interleave the
    contenders so a slow moment of the disk hits them all alike."""
    size = buf.numel()
    runners, results = {}, {}
    for name in names:
        try:
            if name == "fio":
                runners[name] = None
            elif name == "deepspeed":
                runners[name] = _deepspeed(block, qd, par)
            else:
                runners[name] = _ours(name, block, qd, par)
        except Exception as exc:  # noqa: BLE001 - a contender that cannot run is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  {name}: unavailable ({exc})")
    samples = {n: {"write": [], "read": []} for n in runners}
    for _ in range(repeats):
        for name, r in runners.items():
            if name == "fio":
                samples[name]["write"].append(_fio(path, size, block, qd, par, "write"))
                samples[name]["read"].append(_fio(path, size, block, qd, par, "read"))
            else:
                samples[name]["write"].append(_time_gbps(r[0], buf, path, size))
                samples[name]["read"].append(_time_gbps(r[1], buf, path, size))
    for name, r in runners.items():
        if r is not None:
            r[2]()
        results[name] = {k: round(statistics.median(v), 3) for k, v in samples[name].items()}
        results[name]["samples"] = samples[name]
        log(f"  {name:>9}: write {results[name]['write']:.2f} GB/s  read {results[name]['read']:.2f} GB/s")
    return results


def _sweep(buf, path: Path, quick: bool) -> list[dict]:
    blocks = [256 << 10, 1 << 20, 4 << 20] if not quick else [256 << 10, 1 << 20]
    depths = [8, 32, 64] if not quick else [8, 32]
    pars = [1, 2] if not quick else [1]
    rows = []
    for block, qd, par in itertools.product(blocks, depths, pars):
        w, r, close = _ours("native", block, qd, par)
        try:
            gw = _time_gbps(w, buf, path, buf.numel())
            gr = _time_gbps(r, buf, path, buf.numel())
        finally:
            close()
        rows.append({"block_size": block, "queue_depth": qd, "intra_op_parallelism": par,
                     "write": round(gw, 3), "read": round(gr, 3)})
    return rows


def _recommend(rows: list[dict]) -> dict:
    # Harmonic mean: a step streams both ways, so the slower direction rules.
    best = max(rows, key=lambda r: 2 / (1 / r["write"] + 1 / r["read"]))
    return {"aio": {"backend": "native", "block_size": best["block_size"], "queue_depth": best["queue_depth"],
                    "intra_op_parallelism": best["intra_op_parallelism"]},
            "measured": {"write": best["write"], "read": best["read"]}}


def _plot(result: dict, out_dir: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2 if result.get("sweep") else 1, figsize=(13, 4.5), squeeze=False)
    ax = axes[0][0]
    names = [n for n, v in result["contenders"].items() if "write" in v]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [result["contenders"][n]["write"] for n in names], 0.4, label="write")
    ax.bar([i + 0.2 for i in x], [result["contenders"][n]["read"] for n in names], 0.4, label="read")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("GB/s")
    s = result["settings"]
    ax.set_title(f"{s['size'] >> 20} MiB, block {s['block_size'] >> 10} KiB, qd {s['queue_depth']}, "
                 f"par {s['intra_op_parallelism']}, O_DIRECT")
    ax.legend()
    if result.get("sweep"):
        ax = axes[0][1]
        rows = result["sweep"]
        labels = [f"{r['block_size'] >> 10}K/q{r['queue_depth']}/p{r['intra_op_parallelism']}" for r in rows]
        x = range(len(rows))
        ax.plot(list(x), [r["write"] for r in rows], "o-", label="write")
        ax.plot(list(x), [r["read"] for r in rows], "s-", label="read")
        ax.set_xticks(list(x), labels, rotation=60, fontsize=7)
        ax.set_ylabel("GB/s")
        ax.set_title(f"native sweep ({result['sweep_size'] >> 20} MiB): block/queue depth/parallelism")
        ax.legend()
    return save_png(fig, out_dir, "io.png")


def run(args) -> int:
    import offload.aio as aio

    size = args.size or ((256 << 20) if args.quick else (1 << 30))
    repeats = args.repeats or (1 if args.quick else 3)
    root = Path(args.path)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "offload-io-bench.bin"
    out_dir = Path(args.out) if args.out else root
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.no_fio:
        if shutil.which("fio"):
            names.append("fio")
        else:
            log("fio not found: skipped")
    if not args.no_deepspeed:
        names.append("deepspeed")

    buf = aio.aligned_empty(size)
    buf.copy_(__import__("torch").randint(0, 256, (size,), dtype=__import__("torch").uint8))
    log(f"laying out {size >> 20} MiB at {path}")
    aio.AsyncIO(backend="threads").sync_pwrite(buf, path)  # every figure overwrites this file
    os.sync()
    result = {
        "benchmark": "io",
        "machine": machine_info(),
        "path": str(root.resolve()),
        "settings": {"size": size, "block_size": args.block_size, "queue_depth": args.queue_depth,
                     "intra_op_parallelism": args.parallelism, "repeats": repeats, "direct": True},
        "backends": aio.backend_report(),
    }
    log(f"contenders ({repeats} repeats, median): {', '.join(names)}")
    result["contenders"] = _measure(names, buf, path, args, args.block_size, args.queue_depth,
                                    args.parallelism, repeats)
    ratios = {}
    native = result["contenders"].get("native", {})
    for other in ("fio", "deepspeed"):
        o = result["contenders"].get(other, {})
        if "write" in native and "write" in o:
            ratios[f"native/{other}"] = {d: round(native[d] / o[d], 3) for d in ("write", "read")}
    result["ratios"] = ratios
    for k, v in ratios.items():
        log(f"  {k}: write {v['write']:.2f}x  read {v['read']:.2f}x")

    if not args.no_sweep and "write" in native:
        sweep_size = min(size, (64 << 20) if args.quick else (256 << 20))
        log(f"sweep on {sweep_size >> 20} MiB ...")
        result["sweep_size"] = sweep_size
        result["sweep"] = _sweep(buf[:sweep_size], path, args.quick)
        result["recommendation"] = _recommend(result["sweep"])
        log("recommended config for this disk:\n" + json.dumps(result["recommendation"]["aio"], indent=2))
    png = _plot(result, out_dir)
    if png:
        result["png"] = str(png)
    write_json(result, out_dir, "io.json")
    if not args.keep:
        path.unlink(missing_ok=True)
    return 0
