"""One contender of `offload bench train`, run in a process of its own.

    python -m offload_bench.train_contenders NAME SPEC_JSON

The parent (offload_bench/train.py) writes the spec (settings, config, device)
and reads the figures back from the result file the spec names. Where each
contender's model, batches and step live:

  torch        the model and the batches on the device; AdamW(fused=True)
  offload-*    offload.initialize; batches on engine.device; the device
               layer is OFFLOAD_DEVICE, set by the parent from --device
  fsdp2-cpu    torch.distributed.fsdp.fully_shard on each block, then on the
               model, with CPUOffloadPolicy (parameters, gradients and the
               optimizer step on the host), world size 1: nccl on cuda, gloo
               on cpu. On cpu the policy's pin_memory is off: torch pins for
               an accelerator and refuses without one. AdamW (foreach).
  deepspeed-*  deepspeed.initialize with the same config; nccl on cuda, gloo on cpu
  torchao-cpu  the model and the batches on the GPU; torchao.optim.CPUOffloadOptimizer
               (AdamW, fused, offload_gradients=False): fp32 parameters and
               gradients stay on the GPU, a pinned host copy of each takes
               AdamW's step there and is copied back. Parameters under its
               minimal_size (4096 elements) step on the GPU. CUDA only: the
               parent records it as skipped elsewhere; here, where torchao
               does not import, the result is skipped with the import's error.

settings["precision"] bf16 (fp32: nothing of this):
  torch, torchao-cpu  fp32 parameters and AdamW; forward and loss under
               torch.autocast(device type, torch.bfloat16), backward and the
               step outside it (PyTorch's recipe for mixed precision)
  fsdp2-cpu    fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
               reduce_dtype=fp32)); fp32 sharded parameters and AdamW
  offload-*, deepspeed-*  the config's "bf16": {"enabled": true}, set by the
               parent: bf16 parameters for compute, fp32 master and moments
Each result names what it did under "precision_how".

On cuda each step ends with torch.cuda.synchronize(), so a step's time is
its work and not only its launches; peak GPU memory is
torch.cuda.max_memory_allocated() over the warmup and timed steps (reset
after setup: FSDP2 moves the whole model to the GPU while it shards it),
and at setup apart.
"""
from __future__ import annotations

import copy
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def model_tflops(params: int, tokens_per_step: int, step_s: float) -> float:
    """Model FLOPs per second, in TFLOPS: 6 x parameters x tokens per step (forward 2,
    backward 4 per parameter and token; attention's seq^2 term left out), over the step time."""
    return 6 * params * tokens_per_step / step_s / 1e12


def _rank0_env(spec: dict) -> None:
    """World size 1, for the contenders that start torch.distributed themselves."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))


def _torch_step(model, opt, lm_loss, autocast=None, grad_clip: float = 0.0):
    """One training step of a model a torch optimizer steps (torch, FSDP2, torchao);
    `autocast`: the device type whose torch.autocast(bfloat16) the forward and loss run under;
    grad_clip > 0: clip_grad_norm_ before the step."""
    import contextlib

    import torch

    def step(tokens):
        with torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _checkpoint_blocks(model) -> None:
    """Each block's forward under torch.utils.checkpoint (non-reentrant): its activations
    recomputed in backward, as the engine's activation_checkpointing does for ours."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)


def _setup(name: str, model, spec: dict, device, res: dict):
    """(step function, engine or None, where the batches go) for one contender;
    writes how it applies the precision to res["precision_how"]."""
    import torch

    from offload_bench.gpt import lm_loss

    s = spec["settings"]
    cuda = device.type == "cuda"
    bf16 = s.get("precision", "fp32") == "bf16"
    autocast = device.type if bf16 else None
    adamw = dict(lr=s["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    clip = s.get("grad_clip", 0.0)  # ours and DeepSpeed: the config's gradient_clipping
    if bf16 and name in ("torch", "torchao-cpu"):
        res["precision_how"] = f"fp32 parameters and AdamW; forward and loss under torch.autocast({autocast!r}, bf16)"
    compiled = spec.get("compile", False)
    name = name.removesuffix("-compiled")
    if s.get("checkpoint") and not name.startswith("offload-"):
        _checkpoint_blocks(model)
        res["checkpoint_how"] = "torch.utils.checkpoint(use_reentrant=False) around each block"
    elif s.get("checkpoint"):
        res["checkpoint_how"] = 'the config\'s activation_checkpointing {"modules": ["Block"]}'
    if name == "torch":
        model.to(device)
        if compiled:  # as engine.compile() does: each block's own forward (Note [compiled blocks])
            for block in model.blocks:
                block.forward = torch.compile(type(block).forward.__get__(block))
            res["compile_how"] = "each block's forward torch.compile'd (inductor)"
        opt = torch.optim.AdamW(model.parameters(), **adamw, fused=True)
        return _torch_step(model, opt, lm_loss, autocast, clip), None, device
    if name == "torchao-cpu":
        from torchao.optim import CPUOffloadOptimizer  # run_contender checked that it imports

        model.to(device)
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=False, fused=True,
                                  **adamw)
        return _torch_step(model, opt, lm_loss, autocast, clip), None, device
    if name == "fsdp2-cpu":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        _rank0_env(spec)
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
        policy = CPUOffloadPolicy(pin_memory=cuda)
        shard = {"offload_policy": policy}
        if bf16:
            shard["mp_policy"], res["precision_how"] = _fsdp2_bf16()
        for block in model.blocks:
            fully_shard(block, **shard)
        fully_shard(model, **shard)
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        return _torch_step(model, opt, lm_loss, grad_clip=clip), None, device
    if bf16:
        res["precision_how"] = 'the config\'s "bf16": {"enabled": true}'
    if name.startswith("offload-"):
        import offload

        engine = offload.initialize(model, spec["config"])
        if compiled:
            engine.compile()
            res["compile_how"] = f"engine.compile(): {len(engine.compiled_blocks)} blocks (inductor)"
    elif name.startswith("deepspeed-"):
        _rank0_env(spec)
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=copy.deepcopy(spec["config"]))
    else:
        raise ValueError(f"unknown contender {name!r}")

    def step(tokens):
        loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss
    return step, engine, engine.device


def _fsdp2_bf16():
    """FSDP2's mixed precision: bf16 all-gathered parameters for compute, fp32 gradient
    reduction; the sharded parameters and AdamW stay fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))")


def _torchao_missing() -> str | None:
    """Why torchao's CPUOffloadOptimizer cannot be imported here, or None."""
    try:
        from torchao.optim import CPUOffloadOptimizer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - an ImportError, or torchao failing against this torch
        return f"torchao does not import here ({type(exc).__name__}: {exc}); pip install torchao to run it"
    return None


def _sim_overlap(engine, window: tuple[float, float]) -> dict:
    """How much of one step's transfer time was hidden (Note [hidden transfer time]);
    `window` is the step just run, whose spans engine.timeline() gives."""
    from offload.device import hidden_time

    layer = engine.device_layer
    if layer.name != "sim":
        return {"error": f"--device sim: the engine's device layer is {layer.describe()!r}, not sim"}
    return {"host_device": hidden_time.copy_overlap(layer.schedule, layer.blocked, window, threading.main_thread().name),
            "nvme_reads": hidden_time.read_overlap(engine.timeline())}


def _sim_summary(engine, steps: list[dict]) -> dict:
    """The last timed step in full (the copies' timeline), and each timed step's hidden
    fractions with their median: one step is one sample of a noisy machine."""
    if "error" in steps[-1]:
        return steps[-1]
    layer = engine.device_layer
    out = {"layer": layer.describe(), "gbps": layer.gbps, **steps[-1],
           "per_step": [{k: step[k]["hidden_fraction"] for k in ("host_device", "nvme_reads")} for step in steps]}
    out["median_hidden_fraction"] = {
        k: statistics.median(f[k] for f in out["per_step"]) if all(f[k] is not None for f in out["per_step"])
        else None for k in ("host_device", "nvme_reads")}
    if not out["host_device"]["copies"]:
        out["note"] = "no host<->device copy went through the device layer in the last step"
    return out


def _bus_rate(device) -> dict:
    """GB/s of one 1 GiB copy each way between pinned host memory and the GPU (the
    median of three after one untimed): the rate the bus floor of a step is taken at."""
    import torch

    n = 2**28  # fp32: 1 GiB
    host = torch.empty(n, dtype=torch.float32, pin_memory=True).uniform_()
    dev = torch.empty(n, dtype=torch.float32, device=device)
    rate = {}
    for way, (dst, src) in {"up": (dev, host), "down": (host, dev)}.items():
        times = []
        for _ in range(4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        rate[way] = round(4 * n / statistics.median(times[1:]) / 1e9, 2)
    del host, dev
    torch.cuda.empty_cache()
    return rate


def _bus_step(layer, before) -> dict:
    """Bytes each way over the bus in the step just run, and, on cuda, the seconds
    the copies took each way (CudaDevice.time_copies)."""
    out = {"up_bytes": layer.counters.bytes_to_device - before[0],
           "down_bytes": layer.counters.bytes_to_host - before[1]}
    seconds = layer.copy_seconds() if hasattr(layer, "copy_seconds") else {}
    for way, sec in seconds.items():
        out[f"{way}_s"] = round(sec, 6)
    return out


def run_contender(name: str, spec: dict) -> dict:
    """Runs one contender in this process; returns its figures."""
    import torch

    from offload_bench.gpt import GPT, GPTConfig
    from offload_bench.train_timeline import critical_path, median_path

    s = spec["settings"]
    # cuda:0, with its index: torch.cuda.set_device refuses a bare "cuda" (world size 1, LOCAL_RANK 0)
    device = torch.device("cuda", 0) if spec.get("device") == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    res: dict = {"name": name, "device": spec.get("device", "cpu"), "torch_threads": torch.get_num_threads(),
                 "precision": s.get("precision", "fp32"), "rss_after_import": _rss()}
    if name == "torchao-cpu":
        missing = _torchao_missing()
        if missing:  # recorded as skipped with its reason, not as a failure
            return {**res, "skipped": True, "reason": missing}
    torch.manual_seed(s["seed"])  # every generator: the GPU's too, for --init-device cuda
    init_device = s.get("init_device", "cpu")
    with torch.device(init_device):
        model = GPT(GPTConfig(**s["model"]))
    if init_device != "cpu" and name.removesuffix("-compiled") != "torch":
        model.to("cpu")  # where every other contender takes its model from
        torch.cuda.empty_cache()
    res["init_device"] = init_device
    res["params"] = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(s["seed"] + 1)
    n_batches = s["warmup"] + s["steps"] + 1
    batches = [torch.randint(0, s["model"]["vocab_size"], (s["batch"], s["seq"] + 1), generator=gen)
               for _ in range(n_batches)]
    res["rss_after_model"] = _rss()

    t0 = time.perf_counter()
    step, engine, batch_device = _setup(name, model, spec, device, res)
    batches = [b.to(batch_device) for b in batches]
    res["init_s"] = round(time.perf_counter() - t0, 3)
    res["rss_after_init"] = _rss()
    if cuda:
        torch.cuda.synchronize()
        res["peak_gpu_bytes_setup"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    losses, times = [], []
    stores = engine.swap_stores if name.startswith("offload-") else []
    moved = None
    sim_steps: list[dict] = []  # --device sim, ours: each timed step's hidden fractions
    paths: list[dict] = []  # ours: each timed step (Note [critical path] in train_timeline.py)
    layer = engine.device_layer if engine is not None and name.startswith("offload-") else None
    if layer is not None and cuda:
        res["bus_rate_gbps"] = _bus_rate(device)
    for i in range(s["warmup"] + s["steps"]):
        if i == s["warmup"]:
            moved = [(st.stats.bytes_read, st.stats.bytes_written) for st in stores]
            usage = resource.getrusage(resource.RUSAGE_SELF)
            if layer is not None and hasattr(layer, "time_copies"):
                layer.time_copies()
        bus_before = (layer.counters.bytes_to_device, layer.counters.bytes_to_host) if layer is not None else None
        modeled = getattr(layer, "compute", None)  # --device sim with OFFLOAD_SIM_TFLOPS
        if modeled is not None:
            layer.reset_modeled_compute()
        t = time.perf_counter()
        loss = step(batches[i])
        if cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        dt = end - t
        losses.append(float(loss.detach()))
        if i >= s["warmup"]:
            times.append(dt)
            if spec.get("device") == "sim" and engine is not None and name.startswith("offload-"):
                sim_steps.append(_sim_overlap(engine, (t, end)))
            if name.startswith("offload-"):
                paths.append(critical_path(engine.timeline(), round(dt, 6), sim_steps[-1] if sim_steps else None))
                paths[-1]["optimizer_gparams_per_s"] = round(
                    res["params"] / 1e9 / max(paths[-1]["optimizer_s"], 1e-9), 4)
                paths[-1]["bus"] = _bus_step(layer, bus_before)
                if modeled is not None:  # the device compute's modeled time (Note [sim modeled compute])
                    paths[-1]["modeled_compute_s"] = round(layer.reset_modeled_compute().modeled_s, 6)
        print(f"[{name}] step {i} {'warmup' if i < s['warmup'] else 'timed'} "
              f"{dt:.3f} s loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    # CPU seconds (user, system) and page faults per timed step: on 2 cores a
    # step whose CPU time nears twice its wall time is short of cores, not disk.
    end_usage = resource.getrusage(resource.RUSAGE_SELF)
    res["cpu_s_per_step"] = {"user": round((end_usage.ru_utime - usage.ru_utime) / s["steps"], 3),
                             "system": round((end_usage.ru_stime - usage.ru_stime) / s["steps"], 3)}
    res["page_faults_per_step"] = (end_usage.ru_minflt - usage.ru_minflt) // s["steps"]
    if cuda:
        res["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    if stores:
        # Bytes moved per timed step, and where the last step's time went (Note [timeline]).
        res["bytes_read_per_step"] = sum(st.stats.bytes_read - r for st, (r, _) in zip(stores, moved)) // s["steps"]
        res["bytes_written_per_step"] = sum(st.stats.bytes_written - w
                                            for st, (_, w) in zip(stores, moved)) // s["steps"]
    if name.startswith("offload-"):
        tl = engine.timeline()
        res["timeline"] = {"wall_s": round(tl["wall_s"], 4),
                           "seconds": {k: round(v, 4) for k, v in tl["seconds"].items()}}
        res["timeline_per_step"] = paths
        res["critical_path_median"] = median_path(paths)
        if sim_steps:
            res["sim"] = _sim_summary(engine, sim_steps)
        if spec.get("trace_dir"):
            engine.export_chrome_trace(os.path.join(spec["trace_dir"], f"{name}.trace.json"))
    res["step_times_s"] = [round(t, 4) for t in times]
    res["median_s"] = round(statistics.median(times), 4)
    tokens = s["batch"] * s["seq"]
    res["tokens_per_s"] = round(tokens / res["median_s"], 1)
    res["tflops"] = float(f"{model_tflops(res['params'], tokens, res['median_s']):.4g}")  # 4 digits: tiny on a CPU
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
        plan = engine.placement().to_dict()
        res["placement"] = {k: plan[k] for k in ("auto", "held_bytes", "moved_per_step", "budgets")}
        engine.close()
    if name == "fsdp2-cpu":
        import torch.distributed as dist

        dist.destroy_process_group()
    from offload.process_memory import peak_rss_bytes  # after the run: the import adds nothing to its peak

    res["peak_rss_bytes"] = peak_rss_bytes()
    res["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def main(argv: list[str]) -> int:
    name, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    # Everything the contender prints (DeepSpeed logs on fd 1) goes to stderr;
    # the figures go to the result file.
    os.dup2(2, 1)
    res = run_contender(name, spec)
    Path(spec["result"]).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

