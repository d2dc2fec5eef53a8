"""A LoRA of a Llama as large as this machine's RAM, or larger, trained on it.

    python benchmarks/lora_capacity.py --model llama3-8b [--contender deepspeed] [--estimate] [--out DIR]
    python benchmarks/lora_capacity.py --model spill     [--contender deepspeed] [--estimate] [--out DIR]
    python benchmarks/lora_capacity.py --model llama3-70b --frozen-quant nf4 --seq 16 [--compute-probe] [--estimate]
    python benchmarks/lora_capacity.py --layers 2 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 \\
        --vocab 1000 --steps 3 [--host-budget 2Mi]                # a quick run of the same code

The model is transformers' LlamaForCausalLM with random weights, bf16:
`--model llama3-70b` is Llama-3-70B's (hidden 8192, MLP 28672, 80 layers,
64 heads, 8 KV heads: 70.55B parameters); `--model llama3-8b` is Llama-3-8B's config (hidden 4096, MLP 14336, 32
layers, 32 heads, 8 KV heads, vocab 128256, untied: 8.03B parameters, 16.1
GB in bf16); `--model spill` is the same width with as many layers as make
its bf16 weights at least --spill-factor (1.5) x this machine's RAM (the
size chosen is printed); --layers/--hidden/--intermediate/--heads/--kv-heads/
--vocab override either. It is built under `offload.init(config)`, so each
parameter goes to its home as it is created (torch's init only: see
offload_bench/lora.py), then PEFT adds the LoRA (r 8, alpha 16, q_proj and
v_proj), then `offload.initialize(peft_model, config)` plans: the config
(offload_bench.lora.train_config) is bf16, ZeRO-3, AdamW lr 1e-4, batch 1,
offload_param and offload_optimizer both "auto" with an nvme_path under
--nvme-dir: the adapters and their state get RAM first, then the frozen
base as far as the host budget holds (75% of the memory available, or
--host-budget, less the engine's own buffers), the rest on NVMe. Then --steps steps on random token ids,
batch 1 x --seq.

Recorded (JSON on stdout, lora_capacity.json and lora_capacity.png under
--out): build, PEFT and initialize times; total and trainable parameters;
the plan (frozen bytes per tier, NVMe bytes held, predicted bytes moved);
per step its time (the median over the steps after the first), tokens/s,
the swap stores' bytes read and written and the process's disk I/O
(/proc/self/io); peak RSS (VmHWM) per phase, build, initialize and
training, and over all; NVMe bytes on disk. The floor of a spilled step:
the NVMe homes are read twice a step (forward, and backward for the input
gradients) at the disk's read rate, measured in the same run by `offload
bench io` (native backend, the config's aio settings, a --io-size file on
the same disk, in a process of its own): floor_s = 2 x nvme_home_bytes /
read rate, and the step's ratio to it.

--frozen-quant nf4|fp4|int8 sets the config's frozen.quantize: every Linear
but lm_head is quantized by bitsandbytes as offload.init builds it, and
homed packed (a QLoRA base); DeepSpeed's run then builds the same quantized
base whole in memory (offload_bench/lora.py quantized_as_built), as
from_pretrained with a BitsAndBytesConfig holds one: zero.Init partitions each
weight as it is built, before it could be quantized. --compute-probe times one
layer's forward and backward alone, in RAM, times the layers: the step's
compute without its transfers.

--contender deepspeed also runs DeepSpeed ZeRO-3 (offload_param and
offload_optimizer "nvme", same nvme dir, same aio settings) on the same
model and LoRA, built under `deepspeed.zero.Init(remote_device="nvme")`,
DeepSpeed's way for a model larger than RAM, in a process of its own
(DS_ACCELERATOR: cpu where no GPU, gloo, world size 1), after ours has
closed, with a wall-clock limit (--deepspeed-timeout): its step times, peak
RSS, swap directory bytes, or how it failed (the exception's last line, or
the signal: SIGKILL not sent by this script is most likely the OOM killer).
--skip-ours runs DeepSpeed alone. --estimate prints `offload estimate` for
the full fine-tune and for the LoRA (estimate(trainable=...)) of the same
model and config. Every swap file is removed at the end.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import psutil

from offload_bench import lora
from offload_bench.common import (OtherLoad, log, machine_info, parse_size, pyplot, save_png,
                                  stdout_to_stderr, write_json)

MODELS = ("llama3-8b", "llama3-70b", "spill")
OVERRIDES = (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("intermediate", "intermediate_size"),
             ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"), ("vocab", "vocab_size"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, default="llama3-8b",
                   help="llama3-8b: Llama-3-8B's config; spill: its width, bf16 weights >= --spill-factor x RAM")
    p.add_argument("--spill-factor", type=float, default=1.5)
    p.add_argument("--frozen-quant", choices=("nf4", "fp4", "int8"), default=None,
                   help="quantize the base as offload.init builds it (the config's frozen.quantize; bf16 compute)")
    p.add_argument("--compute-probe", action="store_true",
                   help="also time one layer's forward and backward alone (offload_bench/compute_probe.py)")
    for flag, key in OVERRIDES:
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=None, help=f"override {key}")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--host-budget", type=parse_size, default=None,
                   help="memory.host_budget in bytes (e.g. 8Gi; default: the engine's, 75%% of available RAM)")
    p.add_argument("--nvme-dir", default=None,
                   help="where the swap files go (default: a temporary directory in the working directory, "
                        "removed at the end)")
    p.add_argument("--contender", action="append", choices=("deepspeed",), default=[],
                   help="also run DeepSpeed ZeRO-3 (NVMe offload) on the same model, in a process of its own")
    p.add_argument("--skip-ours", action="store_true", help="run only the --contender")
    p.add_argument("--deepspeed-timeout", type=float, default=1200.0, help="seconds before DeepSpeed is stopped")
    p.add_argument("--ds-buffer-count", type=int, default=8,
                   help="DeepSpeed's offload_param.buffer_count (buffer_size is the largest parameter)")
    p.add_argument("--estimate", action="store_true", help="also print offload estimate, full fine-tune and LoRA")
    p.add_argument("--io-size", type=parse_size, default=4 << 30, help="offload bench io's file (default 4Gi)")
    p.add_argument("--io-repeats", type=int, default=3)
    p.add_argument("--read-gbps", type=float, default=None,
                   help="the disk's read rate, GB/s, instead of measuring it")
    p.add_argument("--hf-init", action="store_true",
                   help="keep Hugging Face's second init pass (slow: see offload_bench/lora.py)")
    p.add_argument("--out", default=None, help="directory for lora_capacity.json and lora_capacity.png")


def model_shape(args, ram: int) -> tuple[str, dict, str | None]:
    """(name, LlamaConfig keywords, a note or None)."""
    shape = dict(lora.LLAMA3_70B if args.model == "llama3-70b" else lora.LLAMA3_8B)
    for flag, key in OVERRIDES:
        if getattr(args, flag) is not None:
            shape[key] = getattr(args, flag)
    note = None
    if args.model == "spill":
        if args.layers is None:
            shape["num_hidden_layers"] = lora.spill_layers(ram, shape, args.spill_factor)
        elif 2 * lora.llama_params(shape) < args.spill_factor * ram:
            note = (f"--layers {args.layers}: bf16 weights {2 * lora.llama_params(shape) / 2**30:.1f} GiB are "
                    f"under {args.spill_factor} x RAM")
    overridden = [flag for flag, _ in OVERRIDES if getattr(args, flag) is not None]
    name = args.model + (" (" + ", ".join(f"{f} {getattr(args, f)}" for f in overridden) + ")" if overridden else "")
    return name, shape, note


# ------------------------------------------------------------------ the disk

def measure_read_rate(root: Path, size: int, repeats: int) -> dict:
    """`offload bench io` on root's disk, in a process of its own: our native backend
    with the aio settings the config gives the engine; GB/s = 1e9 bytes a second."""
    import offload

    from offload_bench.train import AIO

    out = root / "io-out"
    cmd = [sys.executable, "-m", "offload", "bench", "io", "--path", str(root / "io"), "--size", str(size),
           "--block-size", str(AIO["block_size"]), "--queue-depth", str(AIO["queue_depth"]),
           "--parallelism", str(AIO["intra_op_parallelism"]), "--backends", "native", "--no-fio",
           "--no-deepspeed", "--no-sweep", "--repeats", str(repeats), "--out", str(out)]
    env = dict(os.environ)
    roots = [str(Path(offload.__file__).resolve().parents[1]), str(Path(lora.__file__).resolve().parents[1])]
    env["PYTHONPATH"] = os.pathsep.join(roots + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    log(f"disk: offload bench io, {size / 2**30:.1f} GiB file, {repeats} repeats, under {root / 'io'}")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        data = json.loads((out / "io.json").read_text()) if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "command": " ".join(cmd)}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    native = (data or {}).get("contenders", {}).get("native", {})
    if "read" not in native:
        tail = proc.stderr.strip().splitlines()[-5:]
        return {"error": native.get("error") or lora.tail_error(tail) or f"exit status {proc.returncode}",
                "log_tail": tail, "command": " ".join(cmd)}
    return {"read_gbps": native["read"], "write_gbps": native["write"], "samples": native["samples"],
            "settings": data["settings"], "peak_rss_bytes": data.get("peak_rss_bytes"),
            "command": "offload bench io " + " ".join(cmd[cmd.index("io") + 1:])}


# ------------------------------------------------------------------ estimate

def run_estimate(shape: dict, cfg: dict, frozen_quant: str | None = None) -> dict:
    from offload.sizing import estimate

    model_config = {"model_type": "llama", **shape}

    def summary(est) -> dict:
        d = est.to_dict()
        plan = d.pop("placement", None)
        if plan:
            d["placement"] = {k: v for k, v in plan.items() if k != "shards"}
        return d

    full = estimate(model_config=model_config, config=cfg)
    log("offload estimate, full fine-tune:\n" + full.format())
    out = {"full": summary(full)}
    if "trainable" in inspect.signature(estimate).parameters:
        est = estimate(model_config=model_config, config=cfg, trainable=lora.adapter_config())
        log("offload estimate, LoRA (trainable=the adapter config):\n" + est.format())
        out["lora"] = summary(est)
        if frozen_quant:
            est = estimate(model_config=model_config, config=cfg, trainable=lora.adapter_config(),
                           frozen_quant=frozen_quant)
            log(f"offload estimate, QLoRA ({frozen_quant}):\n" + est.format())
            out["qlora"] = summary(est)
    else:
        out["lora"] = None
        out["lora_note"] = "this offload's estimate() takes no trainable=: the LoRA estimate is skipped"
        log(out["lora_note"])
    return out


# ----------------------------------------------------------------------- ours

def _plan_summary(plan) -> dict:
    d = plan.to_dict()
    c = plan.itemsize
    frozen, trainable, counts = {}, {}, {}
    for s in plan.shards:
        where = s.home.value
        key = f"home {where}, state {s.state.value if s.trainable else 'none (frozen)'}"
        counts[key] = counts.get(key, 0) + 1
        side = trainable if s.trainable else frozen
        side[where] = side.get(where, 0) + s.part_numel * (s.itemsize or c)  # a quantized home: its own
    nvme = sum(s.part_numel * (s.itemsize or c) for s in plan.shards if s.home.value == "nvme")
    # On a machine without an accelerator the device tier is host memory too.
    return {**{k: d[k] for k in ("auto", "held_bytes", "moved_per_step", "budgets", "host_limit", "notes")},
            "itemsize": c, "shards": counts, "frozen_home_bytes": frozen, "trainable_home_bytes": trainable,
            "frozen_in_memory_bytes": frozen.get("host", 0) + frozen.get("device", 0),
            "frozen_on_nvme_bytes": frozen.get("nvme", 0), "nvme_home_bytes": nvme}


def run_ours(args, shape: dict, cfg: dict, nvme: Path) -> dict:
    """Build under offload.init, PEFT, initialize, train; the figures. Closes the engine."""
    import torch

    import offload
    from offload.process_memory import release_free_host_memory
    from offload.tiers import Tier

    res: dict = {"name": "offload", "rss_before": lora.vm_rss()}
    engine = None
    try:
        lora.reset_peak()
        torch.manual_seed(args.seed)  # the same weights as DeepSpeed's run
        t = time.perf_counter()
        with offload.init(cfg):
            model = lora.build_llama(shape, hf_init=args.hf_init)
        res["build_s"] = round(time.perf_counter() - t, 2)
        log(f"[offload] built under offload.init in {res['build_s']} s, RSS {lora.vm_rss() / 2**30:.2f} GiB, "
            f"swap files {lora.dir_bytes(nvme) / 2**30:.2f} GiB")
        t = time.perf_counter()
        peft_model = lora.add_lora(model)
        res["peft_s"] = round(time.perf_counter() - t, 2)
        res["params"], res["trainable_params"] = lora.param_counts(peft_model)
        res["peak_rss_build"] = lora.vm_hwm()
        res["nvme_bytes_after_build"] = lora.dir_bytes(nvme)

        lora.reset_peak()
        t = time.perf_counter()
        engine = offload.initialize(peft_model, cfg)
        res["initialize_s"] = round(time.perf_counter() - t, 2)
        res["build_and_initialize_s"] = round(res["build_s"] + res["peft_s"] + res["initialize_s"], 2)
        res["peak_rss_initialize"] = lora.vm_hwm()
        res["rss_after_initialize"] = lora.vm_rss()
        res["nvme_bytes_after_initialize"] = lora.dir_bytes(nvme)
        plan = engine.placement()
        res["placement"] = _plan_summary(plan)
        log(f"[offload] initialized in {res['initialize_s']} s, RSS {res['rss_after_initialize'] / 2**30:.2f} "
            f"GiB\n" + plan.format())

        lora.reset_peak()
        load = OtherLoad()
        gen = torch.Generator().manual_seed(args.seed + 1)
        stores = engine.swap_stores
        times, losses, moved, disk = [], [], [], []
        for step in range(args.steps):
            ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=gen)
            before = [(s.stats.bytes_read, s.stats.bytes_written) for s in stores]
            r0, w0 = lora.proc_io()
            t = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t)
            r1, w1 = lora.proc_io()
            losses.append(float(loss.detach()))
            moved.append((sum(s.stats.bytes_read - r for s, (r, _) in zip(stores, before)),
                          sum(s.stats.bytes_written - w for s, (_, w) in zip(stores, before))))
            disk.append((r1 - r0, w1 - w0))
            log(f"[offload] step {step}: {times[-1]:.2f} s, loss {losses[-1]:.4f}, NVMe read "
                f"{moved[-1][0] / 1e9:.2f} GB, written {moved[-1][1] / 1e9:.2f} GB, RSS "
                f"{lora.vm_rss() / 2**30:.2f} GiB")
        res["peak_rss_training"] = lora.vm_hwm()
        # Share of the machine's CPU time other processes took during the steps: on a
        # shared 2-core machine a step time means little without it.
        res["other_load_share"] = load.share()
        timed = times[1:] or times
        res.update(step_times_s=[round(x, 3) for x in times], median_step_s=round(statistics.median(timed), 3),
                   losses=[round(x, 4) for x in losses],
                   nvme_read_per_step=[r for r, _ in moved], nvme_written_per_step=[w for _, w in moved],
                   disk_read_per_step=[r for r, _ in disk], disk_written_per_step=[w for _, w in disk])
        res["tokens_per_s"] = round(args.batch * args.seq / res["median_step_s"], 2)
        res["nvme_bytes_held"] = plan.held_bytes()[Tier.NVME]
        res["nvme_bytes_on_disk"] = lora.dir_bytes(nvme)
        tl = engine.timeline()
        res["timeline_seconds_last_step"] = {k: round(v, 3) for k, v in tl["seconds"].items()}
        res["memory_report"] = engine.memory_report()
    except Exception as exc:  # noqa: BLE001 - recorded; DeepSpeed's run and the JSON still come
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["peak_rss_failed_phase"] = lora.vm_hwm()
        res["traceback_tail"] = traceback.format_exc().strip().splitlines()[-8:]
        log("[offload] failed:\n" + traceback.format_exc())
    finally:
        if engine is not None:
            engine.close()  # removes its swap files
        engine = model = peft_model = None  # noqa: F841 - what close() gave back goes too
        gc.collect()
        release_free_host_memory()
    peaks = [res.get(k) for k in ("peak_rss_build", "peak_rss_initialize", "peak_rss_training",
                                  "peak_rss_failed_phase")]
    res["peak_rss_bytes"] = max([p for p in peaks if p] or [lora.vm_hwm()])
    res["rss_after_close"] = lora.vm_rss()
    return res


def _floor(res: dict, nvme_home_bytes: int | None, io: dict) -> None:
    gbps = io.get("read_gbps")
    if not gbps or nvme_home_bytes is None:
        return
    res["floor_s"] = round(2 * nvme_home_bytes / (gbps * 1e9), 3)
    if res.get("median_step_s") and res["floor_s"] > 0:
        res["step_over_floor"] = round(res["median_step_s"] / res["floor_s"], 3)


# ----------------------------------------------------------------------- plot

def _plot(result: dict, out: Path) -> Path | None:
    plt = pyplot("lora_capacity.png")
    if plt is None:
        return None
    gib = 2**30
    ours, ds = result.get("offload") or {}, result.get("deepspeed") or {}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names, vals, colors = [], [], []
    for label, r, color in (("ours", ours, "#1f77b4"), ("DeepSpeed ZeRO-3", ds, "#ff7f0e")):
        if r.get("median_step_s"):
            names.append(label)
            vals.append(r["median_step_s"])
            colors.append(color)
        elif r:
            names.append(f"{label}\n(failed)")
            vals.append(0)
            colors.append(color)
    if ours.get("floor_s"):
        names.append("floor: NVMe\nread twice")
        vals.append(ours["floor_s"])
        colors.append("#888888")
    bars = a1.bar(names, vals, color=colors)
    for b, v in zip(bars, vals):
        a1.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    a1.set_ylabel("seconds per step (median)")
    a1.set_title(f"batch {result['settings']['batch']} x seq {result['settings']['seq']}")
    mem = [("RAM", result["ram_bytes"], "#888888"), ("bf16 weights", result["model"]["bf16_bytes"], "#d62728")]
    if ours.get("peak_rss_bytes"):
        mem.append(("ours\npeak RSS", ours["peak_rss_bytes"], "#1f77b4"))
    if ours.get("nvme_bytes_held") is not None:
        mem.append(("ours\nNVMe", ours["nvme_bytes_held"], "#aec7e8"))
    ds_rss = ds.get("peak_rss_bytes") or ds.get("sampled_peak_rss_bytes")
    if ds_rss:
        mem.append(("DeepSpeed\npeak RSS", ds_rss, "#ff7f0e"))
    if ds.get("nvme_bytes") or ds.get("sampled_peak_nvme_bytes"):
        mem.append(("DeepSpeed\nNVMe", ds.get("nvme_bytes") or ds["sampled_peak_nvme_bytes"], "#ffbb78"))
    bars = a2.bar([m[0] for m in mem], [m[1] / gib for m in mem], color=[m[2] for m in mem])
    for b, (_, v, _) in zip(bars, mem):
        a2.annotate(f"{v / gib:.3g}", (b.get_x() + b.get_width() / 2, v / gib), ha="center", va="bottom")
    a2.set_ylabel("GiB")
    a2.tick_params(axis="x", labelsize=8)
    m = result["model"]
    fig.suptitle(f"LoRA (r {lora.LORA['r']}, q_proj/v_proj) of {m['name']}:\n{m['params'] / 1e9:.2f}B params, "
                 f"{m['lora_params'] / 1e6:.2f}M trainable; {result['machine']['cpu_count']} cores, "
                 f"RAM {result['ram_bytes'] / gib:.1f} GiB")
    fig.tight_layout()
    return save_png(fig, out, "lora_capacity.png")


# ----------------------------------------------------------------------- main

def run(args) -> int:
    ram = psutil.virtual_memory().total
    name, shape, note = model_shape(args, ram)
    n_params, n_lora = lora.llama_params(shape), lora.lora_params(shape)
    made_root = args.nvme_dir is None
    root = Path(tempfile.mkdtemp(prefix="offload-lora-nvme-", dir=os.getcwd()) if made_root else args.nvme_dir)
    root.mkdir(parents=True, exist_ok=True)
    ours_dir, ds_dir = root / "offload", root / "deepspeed"
    cfg = lora.train_config(str(ours_dir), device="auto", batch=args.batch, host_budget=args.host_budget)
    if args.frozen_quant:
        cfg["frozen"] = {"quantize": args.frozen_quant, "double_quant": True, "compute_dtype": "bf16"}
    result = {
        "benchmark": "lora_capacity",
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": machine_info(), "ram_bytes": ram,
        "model": {"name": name, "shape": shape, "params": n_params, "lora_params": n_lora,
                  "bf16_bytes": 2 * n_params, "bf16_over_ram": round(2 * n_params / ram, 3),
                  "init": "torch and Hugging Face" if args.hf_init else "torch's, at construction"},
        "lora": lora.LORA,
        "settings": {"seq": args.seq, "batch": args.batch, "steps": args.steps, "seed": args.seed},
        "config": cfg, "nvme_dir": str(root),
    }
    if note:
        result["model"]["note"] = note
    log(f"{name}: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, {n_params / 1e9:.3f}B "
        f"params, bf16 {2 * n_params / 2**30:.1f} GiB = {2 * n_params / ram:.2f} x RAM ({ram / 2**30:.1f} GiB); "
        f"LoRA {n_lora / 1e6:.2f}M trainable" + (f"; {note}" if note else ""))
    warn = lora.tmpfs_warning(root)
    if warn:
        result["nvme_dir_warning"] = warn
        log("warning: " + warn)
    try:
        with stdout_to_stderr():
            if args.estimate:
                result["estimate"] = run_estimate(shape, cfg, args.frozen_quant)
            if args.read_gbps:
                result["io"] = {"read_gbps": args.read_gbps, "source": "--read-gbps"}
            else:
                result["io"] = measure_read_rate(root, args.io_size, args.io_repeats)
                log(f"disk: read {result['io'].get('read_gbps')} GB/s, write {result['io'].get('write_gbps')} GB/s"
                    if "read_gbps" in result["io"] else f"disk: no read rate ({result['io']['error']})")
            if not args.skip_ours:
                ours = result["offload"] = run_ours(args, shape, cfg, ours_dir)
                _floor(ours, (ours.get("placement") or {}).get("nvme_home_bytes"), result["io"])
                shutil.rmtree(ours_dir, ignore_errors=True)
            if args.compute_probe:
                spec = {"shape": shape, "frozen": cfg.get("frozen"), "batch": args.batch, "seq": args.seq}
                proc = subprocess.run([sys.executable, "-m", "offload_bench.compute_probe", json.dumps(spec)],
                                      capture_output=True, text=True, cwd=Path(lora.__file__).parents[1])
                result["compute_probe"] = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                                           else {"error": lora.tail_error(proc.stderr.splitlines()) or "failed"})
                log(f"compute alone: {result['compute_probe']}")
            if "deepspeed" in args.contender:
                ds_dir.mkdir(parents=True, exist_ok=True)
                ds_cfg = lora.train_config(str(ds_dir), device="nvme", batch=args.batch,
                                           largest=lora.largest_param(shape), buffer_count=args.ds_buffer_count)
                spec = {"shape": shape, "config": ds_cfg, "nvme_path": str(ds_dir), "steps": args.steps,
                        "seq": args.seq, "batch": args.batch, "seed": args.seed, "hf_init": args.hf_init,
                        "port": _free_port(), "frozen": cfg.get("frozen")}
                log(f"== deepspeed (limit {args.deepspeed_timeout:g} s); this process's RSS now "
                    f"{lora.vm_rss() / 2**30:.2f} GiB")
                load = OtherLoad()
                with tempfile.TemporaryDirectory(prefix="lora-capacity-ds-") as work:
                    ds = lora.run_deepspeed(spec, args.deepspeed_timeout, Path(work))
                ds["other_load_share"] = load.share()  # over its whole run, build included
                ds["config"] = ds_cfg
                ds["parent_rss_during"] = lora.vm_rss()
                steps = ds.get("step_times_s") or []
                if steps:
                    ds["median_step_s"] = round(statistics.median(steps[1:] or steps), 3)
                    ds["tokens_per_s"] = round(args.batch * args.seq / ds["median_step_s"], 2)
                result["deepspeed"] = ds
                if "error" in ds:
                    log(f"!! deepspeed failed: {ds['error']}")
                shutil.rmtree(ds_dir, ignore_errors=True)
    finally:
        if made_root:
            shutil.rmtree(root, ignore_errors=True)
        else:
            for d in (ours_dir, ds_dir, root / "io"):
                shutil.rmtree(d, ignore_errors=True)
    ours, ds = result.get("offload") or {}, result.get("deepspeed") or {}
    if ours.get("median_step_s") and ds.get("median_step_s"):
        result["comparison"] = {
            "deepspeed_over_ours_step": round(ds["median_step_s"] / ours["median_step_s"], 3),
            "deepspeed_over_ours_peak_rss": round(ds["peak_rss_bytes"] / ours["peak_rss_bytes"], 3),
            "deepspeed_over_ours_build_and_initialize": round(
                (ds["build_s"] + ds["initialize_s"]) / ours["build_and_initialize_s"], 3)}
    for r in (ours, ds):
        if r.get("peak_rss_bytes"):
            r["peak_rss_over_ram"] = round(r["peak_rss_bytes"] / ram, 3)
    if args.out:
        png = _plot(result, Path(args.out))
        if png:
            result["png"] = str(png)
    write_json(result, args.out, "lora_capacity.json")
    failed = [r["name"] for r in (ours, ds) if r and "error" in r]
    return 1 if failed else 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
