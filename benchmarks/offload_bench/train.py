"""`offload bench train`: one training run, ours beside DeepSpeed ZeRO-3 and plain torch.

The same GPT (vocab 8192, hidden 1024, 4 layers, untied head: 67.3M
parameters), the same seeded initialisation, the same random token batches
(batch 4, sequence 128) and, for ours and DeepSpeed, the same DeepSpeed
JSON config (`ds_config`): stage 3, parameters and optimizer offloaded to the
host (`cpu`) or to NVMe (`nvme`), AdamW lr 1e-4. --model picks another shape
(1b, 7b), --layers another depth. Contenders:

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
  torchao-cpu     torchao's CPUOffloadOptimizer (AdamW, fused, on the host;
                  parameters and gradients on the GPU): an exact anchor, the
                  same AdamW as torch's. Not in the default run; needs CUDA (its
                  streams and pinned memory) and torchao (never a requirement of
                  ours): skipped, with the reason, where either is missing

--precision picks what every contender computes in (train_contenders.py says
how each applies it): fp32 (default), or bf16: ours and DeepSpeed with the
config's "bf16": {"enabled": true} (bf16 compute, fp32 master and moments),
torch and torchao-cpu as users write it (fp32 parameters and AdamW, forward
and loss under torch.autocast(dtype=torch.bfloat16)), FSDP2 with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).

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
For ours, each timed step's critical path from the engine's timeline
(engine.timeline(), Note [timeline] in offload/timeline.py) under
"timeline_per_step", its median under "critical_path_median", and what each
field means under "timeline_per_step_doc" at the top of the JSON (Note
[critical path] in train_timeline.py); "timeline" keeps the last step's
seconds per kind. A closing table on stderr names the model and precision.

--device picks where compute runs (offload_bench/train_contenders.py says how
each contender uses it):
  cpu   (default) everything on the host, ours with OFFLOAD_DEVICE=cpu
  cuda  the GPU readiness run: every contender on the GPU, ours with
        OFFLOAD_DEVICE=cuda; refused at once where CUDA is absent
  sim   ours on the simulated device (OFFLOAD_DEVICE=sim, OFFLOAD_SIM_GBPS from
        --sim-gbps): for each offload contender, how much of the last step's
        host<->device copy time and NVMe read time was hidden behind compute
        (Note [hidden transfer time] in offload/device/hidden_time.py), the copies'
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

from offload_bench import train_report
from offload_bench.train_timeline import TIMELINE_PER_STEP_DOC

DEFAULT_CONTENDERS = ("torch", "offload-cpu", "offload-nvme", "deepspeed-cpu", "deepspeed-nvme")
CONTENDERS = DEFAULT_CONTENDERS + ("offload-nvme-unchecked", "offload-auto", "fsdp2-cpu", "torchao-cpu")
# Each with its blocks compiled (--compile adds them): torch's forward of each block
# torch.compile'd, ours through engine.compile() (Note [compiled blocks]).
COMPILABLE = ("torch", "offload-cpu", "offload-nvme", "offload-auto")
CONTENDERS += tuple(f"{n}-compiled" for n in COMPILABLE)
DEVICES = ("cpu", "cuda", "sim")
PRECISIONS = ("fp32", "bf16")
# The default run per --device: the GPU run adds FSDP2; the sim concerns ours
# (DeepSpeed and FSDP2 do not go through our device layer).
DEVICE_CONTENDERS = {"cpu": DEFAULT_CONTENDERS,
                     "cuda": ("torch", "offload-cpu", "offload-nvme", "fsdp2-cpu", "deepspeed-cpu", "deepspeed-nvme"),
                     "sim": ("torch", "offload-cpu", "offload-nvme")}
# torchao-cpu is let through to be recorded as skipped (it needs CUDA), as on --device cpu.
SIM_CONTENDERS = ("torch", "offload-cpu", "offload-nvme", "offload-nvme-unchecked", "offload-auto", "torchao-cpu",
                  "torch-compiled", "offload-cpu-compiled", "offload-nvme-compiled", "offload-auto-compiled")
DEFAULT_SIM_GBPS = 25.0

# The benchmark models (--model), and the --quick one; --layers overrides any
# one's depth. 67m: the default since the first benchmark; 1b: 0.94B
# parameters, the GPU measurement's shape (hidden 2048, 16 layers, vocab
# 32000; run it with --batch 8 --seq 1024); 7b: Llama-2 7B's width (hidden
# 4096, 32 heads, MLP 11008, vocab 32000, context 4096) at 2 of its 32 layers,
# 0.59B parameters: fp32 weights, gradients and Adam's two moments are 16
# bytes a parameter, 8.8 GiB, so every contender's state fits a 24 GiB host.
# Its blocks are this GPT's (a GELU MLP of two matrices, learned positions),
# not Llama's (SwiGLU's three, RoPE): 157M parameters a layer, not 202M.
FULL_MODEL = dict(vocab_size=8192, hidden=1024, layers=4, heads=16, max_seq=128, tie_embeddings=False)
MODELS = {"67m": FULL_MODEL,
          "1b": dict(vocab_size=32000, hidden=2048, layers=16, heads=16, max_seq=1024, tie_embeddings=False),
          "7b": dict(vocab_size=32000, hidden=4096, layers=2, heads=32, max_seq=4096, mlp_hidden=11008,
                     tie_embeddings=False)}
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
                   help="the GPT trained: 67m (default; vocab 8192, hidden 1024, 4 layers), 1b (0.94B: "
                        "vocab 32000, hidden 2048, 16 layers; with --batch 8 --seq 1024 as measured on a GPU) "
                        "or 7b (Llama-2 7B's width: hidden 4096, 32 heads, MLP 11008, vocab 32000, context "
                        "4096; at 2 layers by default, 0.59B parameters, 157M more a layer: 16 bytes a "
                        "parameter in fp32 with Adam, 8.8 GiB, fits a 24 GiB host). train.json's settings "
                        "give the shape, depth and parameter count")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="blocks in the model, overriding --model's depth (and --quick's)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="what every contender computes in: fp32 (default) or bf16 (ours and DeepSpeed: the "
                        "config's bf16 section; torch, torchao: fp32 parameters and AdamW, forward and loss "
                        "under torch.autocast bf16; FSDP2: MixedPrecisionPolicy bf16, reduce fp32)")
    p.add_argument("--device-budget", default=None, metavar="BYTES",
                   help="the offload contenders' memory.device_budget (\"24GB\", an int): what offload-auto "
                        "plans half of for device homes (default: none, so the GPU's free memory for auto)")
    p.add_argument("--grad-clip", type=float, default=0.0, metavar="NORM",
                   help="clip gradients by their global 2-norm (0: off, the default): ours and DeepSpeed "
                        "through the config's gradient_clipping, torch, torchao and FSDP2 with "
                        "torch.nn.utils.clip_grad_norm_ (Hugging Face Trainer clips at 1.0 by default)")
    p.add_argument("--init-device", choices=("cpu", "cuda"), default="cpu",
                   help="where the weights are drawn (default cpu): cuda draws them on the GPU from its seeded "
                   "generator, the same values for every contender, then moves them where each contender builds "
                   "(the host for all but torch). For large models: torch's host normal_ spent ~80 s on 6.9B "
                   "parameters. Needs --device cuda")
    p.add_argument("--checkpoint", action="store_true",
                   help="checkpoint every block's activations: ours through the config's activation_checkpointing "
                   "(modules [\"Block\"]), every other contender through torch.utils.checkpoint around each "
                   "block (use_reentrant=False); the same arithmetic, activations recomputed in backward")
    p.add_argument("--compile", action="store_true",
                   help="after each of torch, offload-cpu, offload-nvme and offload-auto named, the same with its "
                   "blocks compiled (NAME-compiled): torch's block forwards torch.compile'd, ours through "
                   "engine.compile() (Note [compiled blocks])")
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
    p.epilog = ("For ours, train.json's timeline_per_step gives each timed step's critical path from the "
                "engine's timeline: " + "; ".join(f"{k}: {v}" for k, v in TIMELINE_PER_STEP_DOC.items()
                                                   if k in ("wall_s", "compute_s", "wait_s", "optimizer_s",
                                                            "critical_path")) +
                ". Every field is described under timeline_per_step_doc in train.json.")


# --------------------------------------------------------------------- config

def ds_config(device: str, *, batch: int, lr: float, nvme_path: str | None = None,
              largest_param: int | None = None, buffer_count: int | None = None,
              buffer_size: int | None = None, precision: str = "fp32", grad_clip: float = 0.0) -> dict:
    """The one config ours and DeepSpeed both get; nvme adds only what nvme needs,
    bf16 only its section (fp32 has none: both engines' default).

    device "none" is not used here (the torch contender has no config); "auto" is
    ours alone (Note [automatic placement]): the default budgets, NVMe for the overflow."""
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
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if grad_clip > 0:
        cfg["gradient_clipping"] = grad_clip
    if device == "auto":
        zero = cfg["zero_optimization"]
        zero["offload_param"]["nvme_path"] = nvme_path
        zero["offload_optimizer"]["nvme_path"] = nvme_path
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
    """What every contender is given; "model" is GPTConfig's keywords, "model_name" and
    "layers" say which shape at which depth, "params" its parameter count."""
    from offload_bench.gpt import GPTConfig

    quick = args.quick
    model = dict(QUICK_MODEL if quick else MODELS[args.model])
    if args.layers is not None:
        model["layers"] = args.layers
    return {
        "model": model,
        "model_name": "quick" if quick else args.model,
        "layers": model["layers"],
        "params": GPTConfig(**model).num_params(),
        "precision": args.precision,
        "grad_clip": args.grad_clip,
        "device_budget": args.device_budget,
        "checkpoint": args.checkpoint,
        "init_device": args.init_device,
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
    if "timeline_per_step" in merged:  # ours: every round's timed steps, in the order of step_times_s
        from offload_bench.train_timeline import median_path

        merged["timeline_per_step"] = [step for r in rounds for step in r["timeline_per_step"]]
        merged["critical_path_median"] = median_path(merged["timeline_per_step"])
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
    if "offload-auto" in results:
        out["offload-auto/offload-cpu"] = {"time": _ratio(get("offload-auto", "median_s"), get("offload-cpu", "median_s")),
                                           "peak_rss": _ratio(get("offload-auto", "peak_rss_bytes"),
                                                              get("offload-cpu", "peak_rss_bytes"))}
    for anchor in ("fsdp2-cpu", "torchao-cpu"):
        if anchor in results:
            out[f"offload-cpu/{anchor}"] = {key: _ratio(get("offload-cpu", f), get(anchor, f)) for key, f in
                                            (("time", "median_s"), ("peak_rss", "peak_rss_bytes"),
                                             ("peak_gpu", "peak_gpu_bytes"))}
    return out


def _sim_gbps(args) -> float | None:
    if args.device != "sim":
        return None
    return DEFAULT_SIM_GBPS if args.sim_gbps is None else args.sim_gbps


def _unavailable(name: str, device: str) -> str | None:
    """Why a contender cannot run on this --device or machine (it is recorded as skipped
    with this reason, never as failed), or None. Asked without importing torchao: where
    CUDA is, the contender's own process imports it and says if it cannot."""
    if name != "torchao-cpu" or device == "cuda":
        return None
    import importlib.util

    installed = "installed" if importlib.util.find_spec("torchao") else "not installed"
    return (f"torchao's CPUOffloadOptimizer needs CUDA (its copy stream and pinned host memory; it "
            f"asserts a cuda or xpu device) and --device {device} has none (torchao is {installed} here)")


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


def contender_names(args) -> list[str]:
    """The contenders in run order, each once: --compile adds NAME-compiled after each
    compilable NAME, unless --contenders named it already."""
    contenders = args.contenders if args.contenders is not None else ",".join(DEVICE_CONTENDERS[args.device])
    names = [n.strip() for n in contenders.split(",") if n.strip()]
    if args.compile:
        names = [m for n in names for m in ((n, f"{n}-compiled") if n in COMPILABLE else (n,))]
    return list(dict.fromkeys(names))


def run(args) -> int:
    from offload_bench.common import log, machine_info, write_json

    names = contender_names(args)
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
    if args.init_device == "cuda" and args.device != "cuda":
        log(f"--init-device cuda draws the weights on the GPU: it needs --device cuda (got --device {args.device})")
        return 2
    if args.layers is not None and args.layers < 1:
        log(f"--layers must be at least 1, got {args.layers}")
        return 2
    settings = _settings(args)
    from offload_bench.gpt import GPTConfig

    gcfg = GPTConfig(**settings["model"])
    h, v = gcfg.hidden, gcfg.vocab_size
    largest = max(v * h, gcfg.mlp_width * h)

    own_nvme = args.nvme_dir is None
    nvme_root = Path(tempfile.mkdtemp(prefix="offload-train-nvme-", dir=os.getcwd())) if own_nvme \
        else Path(args.nvme_dir)
    configs = {mode: ds_config(mode, batch=settings["batch"], lr=settings["lr"],
                               nvme_path=str(nvme_root / "swap") if mode in ("nvme", "auto") else None,
                               largest_param=largest, buffer_count=args.buffer_count,
                               buffer_size=args.buffer_size, precision=settings["precision"],
                               grad_clip=settings["grad_clip"])
               for mode in ("cpu", "nvme", "auto")}
    ours = configs
    if settings["device_budget"] is not None:  # ours only: DeepSpeed has no such key
        ours = {mode: {**cfg, "memory": {"device_budget": settings["device_budget"]}} for mode, cfg in ours.items()}
    if settings["checkpoint"]:  # ours only: `modules` is our key; the others wrap each block themselves
        ours = {mode: {**cfg, "activation_checkpointing": {"modules": ["Block"]}} for mode, cfg in ours.items()}
    report = {
        "benchmark": "train",
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": machine_info(),
        "settings": settings,
        "params": gcfg.num_params(),
        "ds_config": configs,
        "device": args.device,
        "peak_rss_source": "VmHWM of the contender's own process (/proc/self/status)",
        "timeline_per_step_doc": TIMELINE_PER_STEP_DOC,
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
                        "device": args.device, "sim_gbps": _sim_gbps(args), "compile": name.endswith("-compiled")}
                if name.startswith(("offload-", "deepspeed-")):
                    mode = name.split("-")[1]
                    spec["config"] = (ours if name.startswith("offload-") else configs)[mode]
                    if name.endswith("-unchecked"):
                        spec["config"] = {**spec["config"], "aio": {**spec["config"]["aio"],
                                                                   "verify_swap_checksums": False}}
                    if mode in ("nvme", "auto"):
                        (nvme_root / "swap").mkdir(parents=True, exist_ok=True)
                if name.startswith(("deepspeed-", "fsdp2-")):
                    spec["port"] = _free_port()
                timeout = args.timeout
                if args.deadline is not None:
                    timeout = int(min(timeout, run_ends - time.monotonic() - DEADLINE_MARGIN_S))
                unavailable = _unavailable(name, args.device)
                if unavailable:
                    r = {"name": name, "skipped": True, "reason": unavailable}
                    log(f"-- {name} skipped: {unavailable}")
                elif timeout < MIN_CONTENDER_S and args.deadline is not None:
                    r = {"name": name, "skipped": True,
                         "error": f"skipped: {max(timeout, 0)} s left of --deadline {args.deadline:g}"}
                    log(f"!! {name} {r['error']}")
                else:
                    r = _run_one(name, spec, timeout, workdir)
                rounds[name].append(r)
                shutil.rmtree(nvme_root / "swap", ignore_errors=True)
                if "median_s" in r:
                    log(f"   {name} (round {round_index + 1}/{args.rounds}): {train_report.figures_line(r)}")
        results.update({name: _merge_rounds(rs) for name, rs in rounds.items()})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if own_nvme:
            shutil.rmtree(nvme_root, ignore_errors=True)
    report["ratios"] = _ratios(results)
    if any(n.endswith("-nvme") and "median_s" in r for n, r in results.items()):
        try:
            report["io_roofline"] = train_report.roofline(results, nvme_root)
        finally:
            if own_nvme:  # the disk probe made the directory again
                shutil.rmtree(nvme_root, ignore_errors=True)
    train_report.print_breakdown(results, report.get("io_roofline"))
    train_report.print_hidden(results)
    report["machine"]["load_average_end"] = list(os.getloadavg())
    layers = f"{settings['layers']} layer{'' if settings['layers'] == 1 else 's'}"
    title = (f"GPT {report['params'] / 1e6:.1f}M params ({settings['model_name']}, {layers}), batch "
             f"{settings['batch']} x seq {settings['seq']}, {settings['precision']}, --device {args.device}; "
             f"median of {settings['steps']} steps"
             f"{f' x {args.rounds} rounds' if args.rounds > 1 else ''}; "
             f"{report['machine']['cpu_model']}, {report['machine']['cpu_count']} cores")
    train_report.print_table(results, title)
    if args.out:
        png = train_report.plot(results, args.out, title)
        if png:
            report["png"] = str(png)
        if args.device == "sim":
            png = train_report.plot_copies(results, args.out, f"{title}; sim {report['sim_gbps']:g} GB/s")
            if png:
                report["copies_png"] = str(png)
    write_json(report, args.out, "train.json")
    # A contender that cannot run here (torchao-cpu without CUDA or torchao) is skipped
    # with its reason, not failed; one skipped for --deadline has no figures: a failure.
    ok = all("median_s" in r or "reason" in r for r in results.values())
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload bench train", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
