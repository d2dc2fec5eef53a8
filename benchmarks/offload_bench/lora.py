"""What benchmarks/lora_capacity.py shares with its DeepSpeed run: the Llama
shapes, the LoRA, the one config, building the model, the process's own
measures, and DeepSpeed ZeRO-3's run in a process of its own.

    python -m offload_bench.lora deepspeed SPEC_JSON   # the child; run_deepspeed() writes the spec

The model is `transformers.LlamaForCausalLM` built from its config in bf16
(`_from_config(config, dtype=torch.bfloat16)`), random weights: each layer's
own torch init at construction (nn.Linear's kaiming-uniform, nn.Embedding's
normal, RMSNorm's ones), finite and not zero. Hugging Face's `post_init`
would draw every weight a second time (`initialize_weights`, normal(0, 0.02));
`torch_init_only()` skips that second pass, as a user with no weights to
match would: on 2 cores torch draws about 0.14 G bf16 elements a second, so
the second pass costs 60 s at 8B, and under `offload.init` (or
`deepspeed.zero.Init`) it also reads every weight back from its home and
writes it again. `hf_init=True` keeps it.

The LoRA is PEFT's (`get_peft_model` after the build context has exited):
r 8, alpha 16, q_proj and v_proj, no dropout; the base is frozen by PEFT, the
adapters are new plain parameters that initialize adopts.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B): 8.03B parameters.
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
# Llama-3-70B's (meta-llama/Meta-Llama-3-70B): 70.55B parameters.
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


# ------------------------------------------------------------------- sizes

def llama_params(shape: dict) -> int:
    """Parameters of LlamaForCausalLM(LlamaConfig(**shape)), counted from the shape."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads = shape["num_attention_heads"]
    kv = shape.get("num_key_value_heads") or heads
    hd = shape.get("head_dim") or h // heads
    per_layer = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter + 2 * h
    embeddings = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    return embeddings + layers * per_layer + h


def lora_params(shape: dict, r: int = LORA["r"]) -> int:
    """The adapters LORA adds: r x (in + out) on each q_proj and v_proj."""
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    kv = shape.get("num_key_value_heads") or heads
    hd = shape.get("head_dim") or h // heads
    return shape["num_hidden_layers"] * r * ((h + heads * hd) + (h + kv * hd))


def spill_layers(ram_bytes: int, shape: dict, factor: float = 1.5) -> int:
    """The fewest layers of `shape`'s width whose bf16 weights are at least factor x RAM."""
    layers = 1
    while 2 * llama_params({**shape, "num_hidden_layers": layers}) < factor * ram_bytes:
        layers += 1
    return layers


def largest_param(shape: dict) -> int:
    h = shape["hidden_size"]
    return max(shape["vocab_size"] * h, shape["intermediate_size"] * h,
               shape["num_attention_heads"] * (shape.get("head_dim") or h // shape["num_attention_heads"]) * h)


# ------------------------------------------------------------------ config

def train_config(nvme_path: str, *, device: str, lr: float = 1e-4, batch: int = 1,
                 largest: int | None = None, buffer_count: int = 8, host_budget: int | None = None) -> dict:
    """The one config, DeepSpeed's JSON: bf16, ZeRO stage 3, AdamW, parameters and
    optimizer state offloaded to `device` ("auto" for ours: RAM as the host budget
    allows, the rest on NVMe; "nvme" for DeepSpeed) under nvme_path, the aio
    settings `offload bench io` and `offload bench train` use. DeepSpeed's
    parameter swapper needs buffers of at least the largest parameter
    (`largest`, elements: the embedding; a larger one fails an assert) and
    enough of them for a module and what is prefetched: with DeepSpeed's
    default 5, a 2-layer Llama (hidden 512, MLP 2048, vocab 4000) fails its
    second step with "Not enough buffers 0 for swapping 1"; 8, as `offload
    bench train` gives it, runs. They are allocated (not touched) up front:
    buffer_count x largest x 2 bytes, 8.4 GB at vocab 128256."""
    from offload_bench.train import AIO

    cfg = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": device, "nvme_path": nvme_path},
            "offload_optimizer": {"device": device, "nvme_path": nvme_path},
        },
        "aio": dict(AIO),
    }
    if device == "nvme":
        cfg["zero_optimization"]["offload_param"].update(buffer_count=buffer_count, buffer_size=int(largest))
    if host_budget is not None:
        cfg["memory"] = {"host_budget": int(host_budget)}
    return cfg


# ------------------------------------------------------------------- model

@contextlib.contextmanager
def torch_init_only():
    """Hugging Face's second initialization pass skipped (see the module's docstring):
    each weight keeps the value its torch module drew at construction."""
    from unittest import mock

    from transformers import PreTrainedModel

    with mock.patch.object(PreTrainedModel, "initialize_weights", lambda self: None):
        yield


def build_llama(shape: dict, *, hf_init: bool = False):
    """LlamaForCausalLM in bf16, random weights (torch's init; Hugging Face's too with hf_init);
    call it inside offload.init or deepspeed.zero.Init."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    with contextlib.nullcontext() if hf_init else torch_init_only():
        return LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)


@contextlib.contextmanager
def quantized_as_built(frozen: dict):
    """Each nn.Linear attached inside (but frozen's skip_modules) replaced by bitsandbytes'
    quantized layer, as offload.init's frozen.quantize does, with nothing homed: the
    quantized base is built whole in memory, as transformers' from_pretrained with a
    BitsAndBytesConfig holds it (DeepSpeed's zero.Init cannot build one: it partitions
    each weight as its module is built, before it could be quantized)."""
    import torch
    from torch.nn.modules.module import register_module_module_registration_hook

    from offload.config import Config
    from offload.partition.quantized import quantized_linear, to_quantize

    fc = Config.load({"frozen": frozen}).frozen

    def hook(parent, name, child):
        if type(child) is torch.nn.Linear and to_quantize(child, fc, prefix=name):
            return quantized_linear(child, fc, torch.device("cpu"))
        return None
    handle = register_module_module_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def add_lora(model):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(**LORA))


def adapter_config() -> dict:
    """LORA as PEFT's adapter_config.json says it (offload.estimate's `trainable=`)."""
    return {"peft_type": "LORA", "bias": "none", **LORA}


def param_counts(model) -> tuple[int, int]:
    """(total, trainable) from the parameters' shapes: reads no value (DeepSpeed's
    partitioned parameters have ds_numel, their tensors are empty; a 4-bit weight
    counts its weights, quant_state.shape, not its packed bytes)."""
    total = trainable = 0
    for p in model.parameters():
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        n = (shape[0] * shape[1] if shape is not None else None) or getattr(p, "ds_numel", None) or p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


# --------------------------------------------------------- process measures

def _status(key: str, pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def vm_hwm(pid: int | str = "self") -> int | None:
    """Peak RSS (VmHWM), bytes."""
    return _status("VmHWM", pid)


def vm_rss(pid: int | str = "self") -> int | None:
    return _status("VmRSS", pid)


def reset_peak() -> bool:
    """VmHWM back to the current RSS, so the next phase's peak is its own."""
    from offload.process_memory import reset_peak_rss

    return reset_peak_rss()


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has had the block layer do (O_DIRECT included)."""
    got = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                got[k] = int(v)
    except OSError:
        return 0, 0
    return got.get("read_bytes", 0), got.get("write_bytes", 0)


def dir_bytes(path) -> int:
    """Bytes the files under `path` take on disk (allocated blocks)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def tree_bytes(path, depth: int = 3) -> dict[str, int]:
    """Allocated bytes per directory `depth` levels under `path` (where a swap dir's bytes are)."""
    out: dict[str, int] = {}
    root = Path(path)
    for dirpath, _, files in os.walk(path):
        rel = Path(dirpath).relative_to(root)
        key = str(Path(*rel.parts[:depth])) if rel.parts else "."
        for name in files:
            try:
                out[key] = out.get(key, 0) + os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return out


def tmpfs_warning(path) -> str | None:
    """A line when `path` is on a memory file system (its "NVMe" would be RAM)."""
    try:
        import psutil

        path = os.path.realpath(path)
        best = max((p for p in psutil.disk_partitions(all=True)
                    if path == p.mountpoint or path.startswith(p.mountpoint.rstrip("/") + "/")),
                   key=lambda p: len(p.mountpoint), default=None)
    except Exception:  # noqa: BLE001 - a warning only
        return None
    if best is not None and best.fstype in ("tmpfs", "ramfs"):
        return f"{path} is on {best.fstype} ({best.mountpoint}): its bytes are in RAM, not on a disk"
    return None


def tail_error(lines: list[str]) -> str | None:
    """The exception line of a traceback's tail, if any."""
    for line in reversed(lines):
        s = line.strip()
        if s and (s.split(":")[0].endswith(("Error", "Exception", "Interrupt")) or s.startswith("AssertionError")):
            return s
    return None


# -------------------------------------------------------- the DeepSpeed child

def _rank0_env(port: int) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def deepspeed_child(spec: dict) -> int:
    """DeepSpeed ZeRO-3 on the spec's model: built under deepspeed.zero.Init (DeepSpeed's
    way for a model larger than RAM: each module's parameters are partitioned, and
    with remote_device "nvme" swapped out, as soon as its constructor returns), the
    LoRA added by PEFT, deepspeed.initialize, the steps. The figures go to
    spec["result"], rewritten after each phase, so a crash leaves how far it got."""
    res: dict = {"name": "deepspeed", "phase": "start", "rss_after_import": None}
    out = Path(spec["result"])

    def save(phase: str) -> None:
        res["phase"] = phase
        res["peak_rss_bytes"] = max(v for v in (res.get("peak_rss_build"), res.get("peak_rss_initialize"),
                                                res.get("peak_rss_training"), vm_hwm()) if v is not None)
        out.write_text(json.dumps(res))

    _rank0_env(spec["port"])
    import deepspeed
    import torch

    res["deepspeed"] = deepspeed.__version__
    res["torch_threads"] = torch.get_num_threads()
    cfg, nvme = spec["config"], spec["nvme_path"]
    deepspeed.init_distributed(dist_backend="gloo")
    res["rss_after_import"] = vm_rss()
    save("imported")

    # The model's modules imported before zero.Init: inside it DeepSpeed has replaced
    # torch.Tensor.__new__, and a first import of transformers' Llama there imports
    # torch._dynamo, which refuses the replacement ("Signature mismatch between
    # get_new_tensor_fn_for_dtype.<locals>.new_tensor and tensor_pynew").
    import peft  # noqa: F401
    import transformers.generation  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    reset_peak()
    torch.manual_seed(spec["seed"])  # the same weights as ours
    t = time.perf_counter()
    frozen = spec.get("frozen")
    res["build"] = "quantized whole in memory (no zero.Init)" if frozen else "deepspeed.zero.Init(remote_device=nvme)"
    with quantized_as_built(frozen) if frozen else deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        model = build_llama(spec["shape"], hf_init=spec.get("hf_init", False))
    peft_model = add_lora(model)
    res["build_s"] = round(time.perf_counter() - t, 2)
    res["params"], res["trainable_params"] = param_counts(peft_model)
    res["peak_rss_build"] = vm_hwm()
    res["nvme_bytes_after_build"] = dir_bytes(nvme)
    save("built")

    reset_peak()
    t = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=peft_model,
                                      model_parameters=[p for p in peft_model.parameters() if p.requires_grad],
                                      config=cfg)
    res["initialize_s"] = round(time.perf_counter() - t, 2)
    res["peak_rss_initialize"] = vm_hwm()
    res["rss_after_initialize"] = vm_rss()
    res["nvme_bytes_after_initialize"] = dir_bytes(nvme)
    save("initialized")

    reset_peak()
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    times, losses, io = [], [], []
    for step in range(spec["steps"]):
        ids = torch.randint(0, spec["shape"]["vocab_size"], (spec["batch"], spec["seq"]), generator=gen)
        r0, w0 = proc_io()
        t = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        r1, w1 = proc_io()
        losses.append(float(loss.detach()))
        io.append((r1 - r0, w1 - w0))
        res.update(step_times_s=[round(x, 3) for x in times], losses=[round(x, 4) for x in losses],
                   disk_read_per_step=[a for a, _ in io], disk_written_per_step=[b for _, b in io],
                   peak_rss_training=vm_hwm())
        print(f"[deepspeed] step {step}: {times[-1]:.2f} s, loss {losses[-1]:.4f}, disk read "
              f"{io[-1][0] / 1e9:.2f} GB, written {io[-1][1] / 1e9:.2f} GB, RSS {vm_rss() / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)
        save(f"step {step}")
    res["nvme_bytes"] = dir_bytes(nvme)
    res["nvme_bytes_by_dir"] = tree_bytes(nvme)
    res["peak_rss_training"] = vm_hwm()
    save("done")
    with contextlib.suppress(Exception):
        engine.destroy()
    return 0


def run_deepspeed(spec: dict, timeout: float, workdir: Path) -> dict:
    """Runs deepspeed_child in a process of its own (its own session: a timeout kills
    it and whatever it started), echoes its log, samples its RSS and its swap
    directory each second; returns its figures, or how it failed: the exception's
    last lines, the exit status or the signal, with what it had recorded so far."""
    import offload

    spec = dict(spec, result=str(workdir / "deepspeed.result.json"))
    spec_path = workdir / "deepspeed.spec.json"
    spec_path.write_text(json.dumps(spec))
    roots = [str(Path(offload.__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(roots + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    import torch

    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")  # what DeepSpeed would detect, said up front
    cmd = [sys.executable, "-m", "offload_bench.lora", "deepspeed", str(spec_path)]
    tail: list[str] = []
    samples = {"peak_rss": 0, "last_rss": 0, "peak_nvme": 0}
    stop = threading.Event()
    timed_out = threading.Event()
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as exc:
        return {"name": "deepspeed", "error": f"could not start: {exc}"}

    def kill():
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def sample():
        while not stop.wait(1.0):
            hwm, rss = vm_hwm(proc.pid), vm_rss(proc.pid)
            if hwm:
                samples["peak_rss"] = max(samples["peak_rss"], hwm)
            if rss:
                samples["last_rss"] = rss
            samples["peak_nvme"] = max(samples["peak_nvme"], dir_bytes(spec["nvme_path"]))

    watchdog = threading.Timer(timeout, kill)
    watchdog.daemon = True
    sampler = threading.Thread(target=sample, daemon=True)
    watchdog.start()
    sampler.start()
    try:
        for line in proc.stderr:
            sys.stderr.write(line)
            tail = (tail + [line.rstrip()])[-40:]
        rc = proc.wait()
    finally:
        watchdog.cancel()
        stop.set()
        sampler.join()
    wall = round(time.perf_counter() - t0, 1)
    result_path = Path(spec["result"])
    res = json.loads(result_path.read_text()) if result_path.exists() else {"name": "deepspeed", "phase": None}
    res["wall_s"] = wall
    res["exit_status"] = rc
    res["sampled_peak_rss_bytes"] = samples["peak_rss"] or None
    res["sampled_peak_nvme_bytes"] = samples["peak_nvme"]
    # Its peak over all: what it recorded at each phase's end, or what was sampled
    # between (a crash or a kill records nothing more).
    res["peak_rss_bytes"] = max(res.get("peak_rss_bytes") or 0, samples["peak_rss"]) or None
    if rc == 0 and res.get("phase") == "done":
        return res
    if timed_out.is_set():
        why = f"timed out after {timeout:g} s (--deepspeed-timeout), after phase {res.get('phase')!r}"
    elif rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        why = f"killed by signal {-rc} ({name}) after phase {res.get('phase')!r}"
        if -rc == signal.SIGKILL:
            why += (", not by this script: most likely the kernel's OOM killer (its last sampled RSS "
                    f"{samples['last_rss'] / 2**30:.2f} GiB, peak {samples['peak_rss'] / 2**30:.2f} GiB)")
    else:
        why = (tail_error(tail) or f"exit status {rc}") + f" (after phase {res.get('phase')!r})"
    res["error"] = why
    res["log_tail"] = tail[-15:]
    return res


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "deepspeed":
        print("usage: python -m offload_bench.lora deepspeed SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    os.dup2(2, 1)  # DeepSpeed logs on fd 1; the figures go to the result file
    try:
        return deepspeed_child(spec)
    except Exception:  # noqa: BLE001 - the parent reads the traceback's tail from stderr
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
