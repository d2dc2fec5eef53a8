"""`offload bench io`: the NVMe path. Write and read GB/s of each of our
backends beside fio and DeepSpeed's async_io (when installed), in the same
run, on the same file size and settings; then a sweep of seconds over block
size, queue depth and parallelism that recommends `aio` settings for this
disk and prints the config snippet. JSON on stdout; io.json and io.png under
--out (default bench_out/), as the other benchmarks do.

Every figure is O_DIRECT (the page cache is bypassed, so reads come from the
disk) and overwrites an existing file (as fio does after laying its file out),
so file-system block allocation is not part of the figure.

--path is only the directory whose disk is measured: the test file made there
is removed at the end (and the directory too, if the benchmark created it),
unless --keep.

Memory is bounded whatever --size is (Note [streaming the test file]): peak
RSS 0.47 GiB with the defaults and 0.35 GiB with --quick, measured on our
2-core VM, where holding the whole 1 GiB file took 2.22 GiB. Each run records
its own as peak_rss_bytes in the JSON.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from offload_bench.common import (
    log, machine_info, parse_size, peak_rss_bytes, pyplot, save_png, stdout_to_stderr, write_json,
)

# Note [streaming the test file]
# The --size test file is never in memory whole. Every transfer, for every
# contender and the sweep, streams it from offset 0 in requests of `chunk`
# bytes (_chunk_bytes) that alternate between the two halves of one aligned
# buffer, the next request submitted before the current one is waited for.
# Two in flight keep the figure the one a single request of the whole file
# gave: our engine fills a queue slot freed by the current request with the
# next request's blocks, and DeepSpeed's workers take their next op from
# their queue as soon as they end one, so the queue does not drain at a chunk
# boundary (ours; DeepSpeed's drains at each op's end anyway); and a chunk
# of at least block_size x queue_depth x intra_op_parallelism lets every
# worker fill its queue from one request. `--chunk` at or above --size gives
# one request per transfer, as before, at the memory of the whole file. The buffer is filled with random
# bytes once and written again at every offset, as fio rewrites one buffer.
# Its size is what the largest transfer needs: 128 MiB for the default
# contenders, 256 MiB when the sweep's 4 MiB x depth 64 points are run.
# Measured (`/usr/bin/time -v offload bench io --path DIR`, 1 GiB, 2-core VM):
# peak RSS 2,329,740 KiB when the file was one buffer (plus a temporary of
# its size for the random contents), 494,872 KiB streamed. Native GB/s, the
# median of five back-to-back pairs of runs (--no-sweep): write 2.19 whole vs
# 2.43 streamed, read 1.44 vs 1.61, where one version's own runs ranged over
# 1.88-2.36 (write) and 1.25-1.68 (read): not slower, within this disk's drift.
# What a drain at every chunk would cost (DeepSpeed's case), native, 1 GiB, 1
# MiB blocks, depth 32, five rounds interleaved in one process: one request
# 2.31 / 1.41 GB/s (write / read), 64 MiB chunks two in flight 2.20 / 1.57,
# 64 MiB chunks one at a time 2.10 / 1.30: about 5-8% below one request, so
# a native/deepspeed ratio from before this change is not comparable with one
# after; `--chunk 1Gi` measures the old way.
CHUNK_MIN = 64 << 20
_ALIGN = 4096  # offload.aio.ALIGN: O_DIRECT offsets and addresses


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default="./offload-io-bench",
                   help="directory on the disk to measure; only its test file goes there, removed at the end "
                        "unless --keep")
    p.add_argument("--size", type=parse_size, default=None,
                   help="file size (default 1Gi; --quick: 256Mi); streamed through a buffer of at most "
                        "2 x max(--chunk, block x depth x parallelism): peak RSS 0.47 GiB with the "
                        "defaults, recorded as peak_rss_bytes in the JSON")
    p.add_argument("--block-size", type=parse_size, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--parallelism", type=int, default=1, help="intra_op_parallelism")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure, median kept (default 3; --quick: 1)")
    p.add_argument("--backends", default="native,libaio,threads", help="ours to measure, comma-separated")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--quick", action="store_true", help="smaller file, one repeat, smaller sweep")
    p.add_argument("--chunk", type=parse_size, default=CHUNK_MIN,
                   help=f"bytes per request, at least block x depth x parallelism (default {CHUNK_MIN >> 20}Mi); "
                        "--chunk at or above --size: one request per transfer, the whole file in memory")
    p.add_argument("--out", default="bench_out", help="directory for io.json and io.png (default bench_out)")
    p.add_argument("--keep", action="store_true", help="keep the test file under --path")


# --------------------------------------------------------------- contenders


def _ours(backend: str, block: int, qd: int, par: int):
    """(write, read, close); write and read submit (tensor, path, offset) and
    return a request to wait() on."""
    import offload.aio as aio

    io = aio.AsyncIO(block_size=block, queue_depth=qd, intra_op_parallelism=par, backend=backend)
    return io.pwrite, io.pread, io.close


class _DeepSpeedRequest:
    """DeepSpeed's handle has one wait() for every op it has in flight; a
    request here is done once a wait() after its submission has returned."""

    def __init__(self, handle, in_flight: list):
        self._handle, self._in_flight = handle, in_flight
        self.done = False
        in_flight.append(self)

    def wait(self) -> None:
        if not self.done:  # its wait() asserts that something is in flight
            self._handle.wait()
            for request in self._in_flight:
                request.done = True
            self._in_flight.clear()


def _deepspeed(block: int, qd: int, par: int):
    with stdout_to_stderr():  # its JIT build and logger write to fd 1
        from deepspeed.ops.op_builder import AsyncIOBuilder

        lib = AsyncIOBuilder().load(verbose=False)
    handle = lib.aio_handle(block, qd, False, True, par)  # single_submit=False, overlap_events=True
    if "file_offset" not in (handle.async_pwrite.__doc__ or ""):
        raise RuntimeError("this DeepSpeed's aio_handle takes no file_offset, which streaming the test "
                           "file in chunks needs (Note [streaming the test file])")
    in_flight: list = []

    def pwrite(t, path, offset):  # its SSD-endurance warning on fd 1: see run()
        handle.async_pwrite(t, str(path), offset)
        return _DeepSpeedRequest(handle, in_flight)

    def pread(t, path, offset):
        handle.async_pread(t, str(path), offset)
        return _DeepSpeedRequest(handle, in_flight)

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


def _chunk_bytes(block: int, qd: int, par: int, nbytes: int, least: int = CHUNK_MIN) -> int:
    """Bytes per request when streaming `nbytes`: enough for every worker to
    fill its queue from one request, at least `least` (--chunk), at most the
    whole transfer; 4096-aligned, so every request starts on an aligned offset
    and address."""
    chunk = max(least, block * qd * par)
    return min(nbytes, -(-chunk // _ALIGN) * _ALIGN)


def _buffer_bytes(chunk: int, nbytes: int) -> int:
    """Two requests' worth, or the whole transfer if that is less."""
    return min(nbytes, 2 * chunk)


def _stream(submit, buf, path: Path, nbytes: int, chunk: int) -> None:
    """Bytes [0, nbytes) of `path` written from or read into `buf`, in requests
    of `chunk` bytes, two in flight, alternating between the halves of buf
    (Note [streaming the test file])."""
    pending = collections.deque()
    for i, offset in enumerate(range(0, nbytes, chunk)):
        if len(pending) == 2:
            pending.popleft().wait()  # frees the half the next request uses
        start = (i % 2) * chunk
        pending.append(submit(buf[start:start + min(chunk, nbytes - offset)], path, offset))
    while pending:
        pending.popleft().wait()


def _time_gbps(submit, buf, path: Path, nbytes: int, chunk: int) -> float:
    t0 = time.perf_counter()
    _stream(submit, buf, path, nbytes, chunk)
    return nbytes / (time.perf_counter() - t0) / 1e9


def _measure(names, buf, path: Path, size: int, chunk: int, block, qd, par, repeats) -> dict:
    """Median write and read GB/s per contender; repeats interleave the
    contenders so a slow moment of the disk hits them all alike."""
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
                samples[name]["write"].append(_time_gbps(r[0], buf, path, size, chunk))
                samples[name]["read"].append(_time_gbps(r[1], buf, path, size, chunk))
    for name, r in runners.items():
        if r is not None:
            r[2]()
        results[name] = {k: round(statistics.median(v), 3) for k, v in samples[name].items()}
        results[name]["samples"] = samples[name]
        log(f"  {name:>9}: write {results[name]['write']:.2f} GB/s  read {results[name]['read']:.2f} GB/s")
    return results


def _sweep_grid(quick: bool) -> list[tuple[int, int, int]]:
    """(block_size, queue_depth, intra_op_parallelism) of each sweep point."""
    blocks = [256 << 10, 1 << 20, 4 << 20] if not quick else [256 << 10, 1 << 20]
    depths = [8, 32, 64] if not quick else [8, 32]
    pars = [1, 2] if not quick else [1]
    return list(itertools.product(blocks, depths, pars))


def _sweep(buf, path: Path, nbytes: int, grid, least: int) -> list[dict]:
    rows = []
    for block, qd, par in grid:
        chunk = _chunk_bytes(block, qd, par, nbytes, least)
        w, r, close = _ours("native", block, qd, par)
        try:
            gw = _time_gbps(w, buf, path, nbytes, chunk)
            gr = _time_gbps(r, buf, path, nbytes, chunk)
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
    plt = pyplot("io.png")
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
    made_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    path = root / "offload-io-bench.bin"
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.no_fio:
        if shutil.which("fio"):
            names.append("fio")
        else:
            log("fio not found: skipped")
    if not args.no_deepspeed:
        names.append("deepspeed")
    sweep_size = min(size, (64 << 20) if args.quick else (256 << 20))
    grid = [] if args.no_sweep else _sweep_grid(args.quick)
    chunk = _chunk_bytes(args.block_size, args.queue_depth, args.parallelism, size, args.chunk)
    layout_chunk = _chunk_bytes(1 << 20, 32, 1, size, args.chunk)  # AsyncIO's defaults
    transfers = [(args.block_size, args.queue_depth, args.parallelism, size), (1 << 20, 32, 1, size)]
    transfers += [(block, qd, par, sweep_size) for block, qd, par in grid]
    # One buffer for the whole run, as large as the largest transfer needs.
    buf = aio.aligned_empty(max(_buffer_bytes(_chunk_bytes(*t, args.chunk), t[3]) for t in transfers))
    buf.random_(0, 256)  # in place: no temporary of its size
    result = {
        "benchmark": "io",
        "machine": machine_info(),
        "path": str(root.resolve()),
        "settings": {"size": size, "block_size": args.block_size, "queue_depth": args.queue_depth,
                     "intra_op_parallelism": args.parallelism, "repeats": repeats, "direct": True,
                     "chunk": chunk, "buffer_bytes": buf.numel()},
        "backends": aio.backend_report(),
    }
    try:
        # Only the JSON goes to stdout: DeepSpeed logs on fd 1 (an SSD-endurance
        # warning at each write, from its own threads), so fd 1 is stderr until then.
        with stdout_to_stderr():
            log(f"laying out {size >> 20} MiB at {path} (streamed through a {buf.numel() >> 20} MiB buffer)")
            with aio.AsyncIO(backend="threads") as io:  # every figure overwrites this file
                _stream(io.pwrite, buf, path, size, layout_chunk)
            os.sync()
            log(f"contenders ({repeats} repeats, median): {', '.join(names)}")
            result["contenders"] = _measure(names, buf, path, size, chunk, args.block_size, args.queue_depth,
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
            if grid and "write" in native:
                log(f"sweep on {sweep_size >> 20} MiB ...")
                result["sweep_size"] = sweep_size
                result["sweep"] = _sweep(buf, path, sweep_size, grid, args.chunk)
                result["recommendation"] = _recommend(result["sweep"])
                log("recommended config for this disk:\n" + json.dumps(result["recommendation"]["aio"], indent=2))
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
            if made_root:
                try:
                    root.rmdir()
                except OSError:  # something else was put there meanwhile: not ours to remove
                    pass
    del buf
    out_dir = Path(args.out)
    png = _plot(result, out_dir)
    if png:
        result["png"] = str(png)
    result["peak_rss_bytes"] = peak_rss_bytes()
    log(f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB; {out_dir / 'io.json'}")
    write_json(result, out_dir, "io.json")
    return 0
