"""DeepSpeed ZeRO-3 with hpZ (zero_hpz_partition_size) and CPU/NVMe offload, on a
simulated 2 nodes x 2 ranks on one host (gloo, DeepSpeed's CPU accelerator),
checked step by step against plain PyTorch on the global batch.

    python benchmarks/offload_bench/deepspeed_hybrid.py run --out DIR \\
        [--offload cpu|nvme|nvme-optimizer] [--hpz 2] [--steps 3] [--timeout 600] [--zero-init]

prints the JSON of two torchrun launches on 127.0.0.1 as two nodes (static rendezvous):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank {0,1} --master-addr 127.0.0.1 \\
        --master-port PORT deepspeed_hybrid.py worker --out DIR --offload O --hpz N --steps S

Each rank builds the same GPT (build_model: vocab 256, hidden 64, 2 layers, seq
32, fp32; hidden 1024 with NVMe, see model_hidden) and deepspeed.initialize's it:
ZeRO stage 3, offload_param and offload_optimizer both on cpu (cpu), both on
NVMe (nvme), or parameters on cpu and optimizer on NVMe (nvme-optimizer); NVMe
path DIR/nvme/node<node rank>, one "disk" per node; zero_hpz_partition_size N;
DeepSpeed's Adam (on offload DeepSpeedCPUAdam, adamw_mode=True: with weight_decay
0 it is torch's AdamW). --zero-init first converts the model with
deepspeed.zero.Init(module=model, config_dict_or_path=config). Each rank trains S
steps on its micro-batch of global_batches; the mean of the ranks' losses is the
global loss, compared with torch_losses (one process, loss = mean of rank losses).

Config choices: stage3_param_persistence_threshold 0 (the default, 1e5 elements,
keeps every parameter of the small model whole: nothing for hpZ to partition);
stage3_max_live_parameters 1e4, stage3_max_reuse_distance 0, prefetch bucket 1e4
(else the small model stays gathered from forward to the end of backward and the
backward never all-gathers from hpZ's secondary partition); "gradient_clipping":
0.0 explicit: DeepSpeed 0.19.8's default is 1.0 (GRADIENT_CLIPPING_DEFAULT), which
clips here (first-step norm 1.12) and parts from torch by 7.7e-5 at step 2, at
any ZeRO stage, with or without offload or hpZ.

Rank 0 writes DIR/result_name(...) (deepspeed_hpz_<offload>.json for hpz 2):
losses, torch losses, max abs difference, torch.testing.assert_close (defaults)
passed or its message, step times, NVMe files, and hpZ's evidence per step:
parameters holding a ds_secondary_tensor after the forward, its numel against
the primary partition's, the intra-node group's ranks, and DeepSpeed's
collectives as "op/group size" -> calls (deepspeed.comm's backend methods wrapped
to count only). A rank that raises writes <stem>.rank<r>.error.json (type,
message, last frames); one still running after --timeout writes it as a Hang
with its main thread's frames and exits. run_two_nodes merges these with the
return codes and each failed launch's log tail (log: DIR/<stem>.node<i>.log).

Found (DeepSpeed 0.19.8, torch 2.13.0+cpu, 5 steps): hpz 2 + cpu offload trains
and matches torch (4.8e-7), hpZ active (backward all-gathers over the node pair,
forward over all 4, secondary partition twice the primary); so do hpz 2 +
nvme-optimizer and the hpz 1 controls. hpz 2 + offload_param nvme fails in
deepspeed.initialize (or zero.Init) on every rank: the secondary partition is
torch.empty(..., device=remote_device) with remote_device "nvme" ("Expected one
of cpu, cuda, ... device type at start of device string: nvme"). Also hpz 1 +
offload_param nvme without --zero-init fails in the first forward ("expected m1
and m2 to have the same dtype, but got: float != c10::BFloat16"): Init's
_set_dtype, given dtype=float32 by the engine, picks bf16 on an accelerator
without fp16 (operator precedence), and the NVMe swapper returns bf16 weights.

Environment set by the launcher only: DS_ACCELERATOR=cpu (no GPU here),
OMP_NUM_THREADS=1 (4 ranks on 2 cores), PYTHONPATH with benchmarks/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
from torch.nn import functional as F

if __package__ in (None, ""):  # run as a script (torchrun): benchmarks/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload_bench.gpt import GPT, GPTConfig  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, MICRO = 256, 64, 2, 4, 32, 2
NVME_HIDDEN = 1024  # nvme runs: MLP and qkv weights whose partitions DeepSpeed swaps (model_hidden)
NODES, PER_NODE = 2, 2
OFFLOADS = ("cpu", "nvme", "nvme-optimizer")
ADAM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0}


def build_model(seed: int = 0, hidden: int = HIDDEN) -> torch.nn.Module:
    """The small fp32 GPT every rank and the reference start from (untied head)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, hidden=hidden, layers=LAYERS, heads=HEADS, max_seq=SEQ,
                         tie_embeddings=False))


def global_batches(steps: int, world: int, micro: int = MICRO, seq: int = SEQ, seed: int = 0):
    """[step][rank] -> (input_ids, labels), each (micro, seq) int64: rows that count up
    by a per-row stride from a random start (learnable), with labels the next token."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        per_rank = []
        for _ in range(world):
            start = torch.randint(0, VOCAB, (micro, 1), generator=gen)
            stride = torch.randint(1, 8, (micro, 1), generator=gen)
            tokens = (start + stride * torch.arange(seq + 1)) % VOCAB
            per_rank.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        out.append(per_rank)
    return out


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def torch_losses(steps: int, world: int, lr: float = 1e-3, hidden: int = HIDDEN) -> list[float]:
    """Plain PyTorch in one process on the global batch: loss = mean over ranks of
    each rank's micro-batch loss; AdamW with weight_decay 0 (DeepSpeedCPUAdam's
    adamw_mode=True arithmetic). The global loss of each step."""
    model = build_model(0, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(ADAM["betas"]), eps=ADAM["eps"], weight_decay=0.0)
    losses = []
    for batch in global_batches(steps, world):
        loss = torch.stack([lm_loss(model(x), y) for x, y in batch]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def model_hidden(offload: str) -> int:
    """The hidden size a run uses: DeepSpeed swaps to NVMe only tensors of at least
    1 MiB (swap_tensor/utils.py MIN_AIO_BYTES), which nothing of the hidden-64 model is."""
    return HIDDEN if offload == "cpu" else NVME_HIDDEN


def result_name(offload: str, hpz: int, zero_init: bool = False) -> str:
    tail = "_zeroinit" if zero_init else ""
    return f"deepspeed_hpz_{offload}{tail}.json" if hpz == 2 else f"deepspeed_hpz{hpz}_{offload}{tail}.json"


def ds_config(offload: str, hpz: int, world: int, nvme_path: str | None = None, micro: int = MICRO) -> dict:
    """offload: "cpu" (both offloads on cpu), "nvme" (both on NVMe) or "nvme-optimizer"
    (offload_param on cpu, offload_optimizer on NVMe)."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    param = {"device": "nvme" if offload == "nvme" else "cpu"}
    optim = {"device": "cpu" if offload == "cpu" else "nvme"}
    if param["device"] == "nvme":
        param.update(nvme_path=nvme_path, buffer_count=8, buffer_size=int(2e6), max_in_cpu=0)
    if optim["device"] == "nvme":
        optim.update(nvme_path=nvme_path, buffer_count=4)
    cfg = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "train_batch_size": micro * world,
        "optimizer": {"type": "Adam", "params": dict(ADAM)},
        "fp16": {"enabled": False}, "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": 3, "offload_param": param, "offload_optimizer": optim, "zero_hpz_partition_size": hpz,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": int(1e6), "stage3_prefetch_bucket_size": int(1e4),
            "stage3_max_live_parameters": int(1e4), "stage3_max_reuse_distance": 0,
        },
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0 (Note in the module docstring)
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    if offload != "cpu":
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                      "thread_count": 1}
    return cfg


def _frames(tb_or_frame, limit: int = 12) -> list[str]:
    if hasattr(tb_or_frame, "tb_frame"):
        return [ln.rstrip() for ln in traceback.format_tb(tb_or_frame)[-limit:]]
    return [ln.rstrip() for ln in traceback.format_stack(tb_or_frame)[-limit:]]


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def worker(out: str, offload: str, hpz: int, steps: int, timeout: float, zero_init: bool = False) -> int:
    """One rank, under torchrun (RANK, WORLD_SIZE, GROUP_RANK from its environment)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ.get("GROUP_RANK", "0"))
    out_dir = Path(out)
    stem = result_name(offload, hpz, zero_init).removesuffix(".json")
    err_path = out_dir / f"{stem}.rank{rank}.error.json"
    state = {"phase": "start", "rank": rank, "node": node, "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}
    main_ident = threading.get_ident()
    done = threading.Event()

    def guard():  # a hang is reported as one, with where the main thread was
        if done.wait(timeout):
            return
        frame = sys._current_frames().get(main_ident)
        _write(err_path, {**state, "error_type": "Hang", "message": f"still running after {timeout:.0f} s "
                          f"in phase {state['phase']!r}", "traceback": _frames(frame) if frame else []})
        os._exit(3)

    threading.Thread(target=guard, daemon=True).start()
    torch.set_num_threads(1)
    try:
        state["phase"] = "import deepspeed"
        import deepspeed
        import deepspeed.comm as dscomm
        import torch.distributed as dist
        from deepspeed.utils import groups

        state["phase"] = "init_distributed"
        deepspeed.init_distributed(dist_backend="gloo")
        gathers: dict[str, int] = {}  # collectives of the step, "op/group size" -> calls
        cdb = dscomm.comm.cdb

        def counting(op, group_at, real):
            def call(*args, **kw):
                group = kw["group"] if "group" in kw else args[group_at] if len(args) > group_at else None
                key = f"{op}/{dist.get_world_size(group)}"
                gathers[key] = gathers.get(key, 0) + 1
                return real(*args, **kw)
            return call

        # DeepSpeed's backend (deepspeed.comm's cdb): each op and where its group sits in
        # TorchBackend's signature; counted, not changed.
        for op, group_at in (("all_gather_into_tensor", 2), ("all_gather", 2), ("all_reduce", 2),
                             ("reduce_scatter_tensor", 3), ("broadcast", 2), ("all_gather_coalesced", 2),
                             ("all_reduce_coalesced", 2), ("reduce_scatter", 3), ("all_to_all_single", 4)):
            setattr(cdb, op, counting(op, group_at, getattr(cdb, op)))
        nvme = str(out_dir / "nvme" / f"node{node}") if offload != "cpu" else None
        if nvme:
            os.makedirs(nvme, exist_ok=True)
        cfg = ds_config(offload, hpz, world, nvme)
        hidden = model_hidden(offload)
        model = build_model(0, hidden)
        if zero_init:  # parameters partitioned with the config's dtype, before initialize
            state["phase"] = "deepspeed.zero.Init(module=model)"
            deepspeed.zero.Init(module=model, config_dict_or_path=cfg)
        state["phase"] = "deepspeed.initialize"
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        sec_group = groups._get_zero_param_intra_parallel_group()
        hpz_info = {"intra_group_ranks": dist.get_process_group_ranks(sec_group) if sec_group is not None else None,
                    "optimizer": type(engine.optimizer).__name__,
                    "basic_optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
                    "adamw_mode": getattr(getattr(engine, "basic_optimizer", None), "adam_w_mode", None),
                    "secondary_group_size_attr": sorted({getattr(p, "ds_secondary_tensor_group_size", None)
                                                         for p in engine.module.parameters()}, key=str),
                    "per_step": []}
        params = list(engine.module.parameters())
        losses, per_rank, times = [], [], []
        for i, batch in enumerate(global_batches(steps, world)):
            x, y = batch[rank]
            gathers.clear()
            state["phase"] = f"step {i} forward"
            t = time.perf_counter()
            loss = lm_loss(engine(x), y)
            secs = [p.ds_secondary_tensor for p in params if getattr(p, "ds_secondary_tensor", None) is not None]
            state["phase"] = f"step {i} backward"
            engine.backward(loss)
            state["phase"] = f"step {i} step"
            engine.step()
            times.append(time.perf_counter() - t)
            whole = sum(p.data.numel() == p.ds_numel for p in params)
            state["phase"] = f"step {i} gather losses"
            counted = dict(sorted(gathers.items()))
            everyone = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(everyone, loss.detach().float().reshape(1))
            per_rank.append([float(v) for v in everyone])
            losses.append(sum(per_rank[-1]) / world)
            hpz_info["per_step"].append({
                "params": len(params), "with_secondary_after_forward": len(secs),
                "secondary_numel": sum(s.numel() for s in secs),
                "primary_numel": sum(p.ds_tensor.numel() for p in params),
                "secondary_device": sorted({str(s.device) for s in secs}), "whole_after_step": whole,
                "collectives_by_op_and_group_size": counted})
        state["phase"] = "done"
        if rank == 0:
            ref = torch_losses(steps, world, hidden=hidden)
            a, b = torch.tensor(losses), torch.tensor(ref)
            try:
                torch.testing.assert_close(a, b)
                close, why = True, None
            except AssertionError as exc:
                close, why = False, str(exc)
            _write(out_dir / result_name(offload, hpz, zero_init), {
                "deepspeed": deepspeed.__version__, "torch": torch.__version__, "offload": offload, "hpz": hpz,
                "zero_init": zero_init, "world": world, "nodes": NODES, "steps": steps, "hidden": hidden,
                "params": sum(p.ds_numel for p in params), "config": cfg, "losses": losses,
                "per_rank_losses": per_rank, "torch_losses": ref,
                "max_abs_diff": max(abs(p - q) for p, q in zip(losses, ref)),
                "finite": all(math.isfinite(v) for v in losses), "assert_close": close, "assert_close_message": why,
                "step_times_s": [round(v, 4) for v in times], "hpz_evidence_rank0": hpz_info,
                "nvme_files": sorted(str(f.relative_to(out_dir)) for f in (out_dir / "nvme").rglob("*")
                                     if f.is_file()) if nvme else None})
        dist.barrier()
        done.set()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure of a rank is recorded
        done.set()
        _write(err_path, {**state, "error_type": type(exc).__name__, "message": str(exc),
                          "traceback": _frames(exc.__traceback__)})
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(out_dir, offload: str = "cpu", hpz: int = 2, steps: int = 3, timeout: float = 600,
                  zero_init: bool = False) -> dict:
    """Two torchrun launches (2 nodes x 2 ranks) on this host; waits up to `timeout`
    seconds (then kills both process groups); returns rank 0's JSON merged with the
    ranks' error files, the return codes, and the tail of each failed launch's log."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = result_name(offload, hpz, zero_init)
    stem = name.removesuffix(".json")
    for old in [out / name, *out.glob(f"{stem}.rank*.error.json")]:
        old.unlink(missing_ok=True)
    shutil.rmtree(out / "nvme", ignore_errors=True)  # the files listed are this run's
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    bench = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([bench] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    procs, logs, cmds = [], [], []
    t0 = time.perf_counter()
    for node in range(NODES):
        cmd = torchrun + ["--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE), "--node-rank", str(node),
                          "--master-addr", "127.0.0.1", "--master-port", str(port),
                          str(Path(__file__).resolve()), "worker", "--out", str(out), "--offload", offload,
                          "--hpz", str(hpz), "--steps", str(steps), "--timeout", str(max(30.0, timeout - 60))]
        cmd += ["--zero-init"] * zero_init
        cmds.append(" ".join(["torchrun"] + cmd[3:]))
        log = open(out / f"{stem}.node{node}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    codes, timed_out = [], False
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0))))
        except subprocess.TimeoutExpired:
            timed_out = True
            codes.append(None)
    if timed_out:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    for log in logs:
        log.close()
    path = out / name
    res = json.loads(path.read_text()) if path.exists() else {"offload": offload, "hpz": hpz, "result": None}
    res.update(return_codes=codes, launcher_timed_out=timed_out, wall_s=round(time.perf_counter() - t0, 1),
               commands=cmds)
    errors = {}
    for p in sorted(out.glob(f"{stem}.rank*.error.json")):
        errors[p.name.split(".")[-3]] = json.loads(p.read_text())
    if errors:
        res["rank_errors"] = errors
    logs_text = [(out / f"{stem}.node{n}.log").read_text(errors="replace") for n in range(NODES)]
    if timed_out or any(c != 0 for c in codes) or not path.exists():
        res["ok"] = False
        res["log_tails"] = {f"node{n}": text[-4000:] for n, text in enumerate(logs_text)}
        if "torch_losses" not in res:
            res["torch_losses"] = torch_losses(steps, NODES * PER_NODE, hidden=model_hidden(offload))
    else:
        res["ok"] = bool(res.get("assert_close")) and bool(res.get("finite"))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "worker"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=name == "worker", help="run: a temporary folder if not given")
        s.add_argument("--offload", choices=OFFLOADS, default="cpu")
        s.add_argument("--hpz", type=int, default=2)
        s.add_argument("--steps", type=int, default=3)
        s.add_argument("--timeout", type=float, default=600)
        s.add_argument("--zero-init", action="store_true", help="deepspeed.zero.Init(module=model, config) first")
    a = p.parse_args(argv)
    if a.cmd == "worker":
        return worker(a.out, a.offload, a.hpz, a.steps, a.timeout, a.zero_init)
    res = run_two_nodes(a.out or tempfile.mkdtemp(prefix="ds_hpz_"), a.offload, a.hpz, a.steps, a.timeout,
                        a.zero_init)
    print(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
