"""Loading a checkpoint into an engine: verify everything first, then apply.

Nothing in the engine changes until the manifest has been checked against
the model (names, shapes, world size, precision), every file of this rank
has been read and its checksum compared, and every tensor this rank needs is
known to be in the files (with several ranks, all ranks agree on that before
any of them applies anything). Then each shard is loaded in turn, so host
memory holds one shard's state at a time.

A partition's tier at save time need not be its tier now: a host partition
can be loaded into an NVMe home and the other way round (the values are the
same bytes; only where they are read from differs).
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from offload.aio.swap_store import HEADER_BYTES, parse_meta
from offload.checkpoint_io import manifest as mf
from offload.tiers import Tier


def read_swap_file(path: Path, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first `numel` elements stored in a swap-format file (Note [swap file format])."""
    with open(path, "rb") as f:
        head = bytearray(HEADER_BYTES)
        if f.readinto(head) != HEADER_BYTES:
            raise mf.CheckpointError(f"{path}: shorter than a swap file header")
        meta = parse_meta(torch.frombuffer(head, dtype=torch.uint8), path, path.stem)
        if meta.dtype != dtype or meta.nbytes < numel * dtype.itemsize:
            raise mf.CheckpointError(f"{path}: holds {meta.nbytes} bytes of {meta.dtype}, "
                                     f"expected at least {numel} elements of {dtype}")
        out = torch.empty(numel, dtype=dtype)
        if numel and f.readinto(memoryview(out.view(torch.uint8).numpy())) != numel * dtype.itemsize:
            raise mf.CheckpointError(f"{path}: truncated")
    return out


class RankFiles:
    """Where each of one rank's saved tensors is: state.safetensors or a swap-file copy."""

    def __init__(self, tag_dir: Path, manifest: dict, rank: int):
        self.dir = mf.rank_dir(tag_dir, rank)
        self.rel = f"rank{rank}/"
        self.files = manifest["files"]
        self._st = safe_open(str(self.dir / "state.safetensors"), framework="pt")
        self.keys = set(self._st.keys())

    def has_file(self, name: str) -> bool:
        return self.rel + name in self.files

    def tensor(self, name: str) -> torch.Tensor:
        return self._st.get_tensor(name)

    def param_source(self, index: int) -> str | None:
        if f"param.{index}" in self.keys:
            return "tensor"
        if self.has_file(f"nvme/param.{index}.swp"):
            return "file"
        if f"master.{index}" in self.keys or self.has_file(f"nvme/optim.{index}.swp"):
            return "master"  # fp32 host home saved once, as the master (save.plan_items)
        return None

    def state_source(self, index: int) -> str | None:
        if all(f"{w}.{index}" in self.keys for w in ("master", "exp_avg", "exp_avg_sq")):
            return "tensor"
        if self.has_file(f"nvme/optim.{index}.swp"):
            return "file"
        if self.has_file(f"nvme/moments.{index}.swp") and self.has_file(f"nvme/param.{index}.swp"):
            return "moments"  # the master is the fp32 parameter file (Note [shared fp32 master])
        return None

    def param(self, index: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        source = self.param_source(index)
        if source == "tensor":
            return self.tensor(f"param.{index}")
        if source == "file":
            return read_swap_file(self.dir / f"nvme/param.{index}.swp", dtype, n)
        return self.state(index, n)[0].to(dtype)

    def state(self, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        source = self.state_source(index)
        if source == "tensor":
            return tuple(self.tensor(f"{w}.{index}") for w in ("master", "exp_avg", "exp_avg_sq"))
        if source == "moments":
            moments = read_swap_file(self.dir / f"nvme/moments.{index}.swp", torch.float32, 2 * n)
            return self.master(index, n), moments[:n], moments[n:]
        packed = read_swap_file(self.dir / f"nvme/optim.{index}.swp", torch.float32, 3 * n)
        return packed[:n], packed[n:2 * n], packed[2 * n:]

    def master(self, index: int, n: int) -> torch.Tensor:
        if f"master.{index}" in self.keys:
            return self.tensor(f"master.{index}")
        if self.has_file(f"nvme/optim.{index}.swp"):
            return read_swap_file(self.dir / f"nvme/optim.{index}.swp", torch.float32, n)
        # A shared master: the parameter's own file, fp32 (read_swap_file checks the dtype).
        return read_swap_file(self.dir / f"nvme/param.{index}.swp", torch.float32, n)


def _missing(src: RankFiles, engine) -> list[str]:
    out = []
    for s in engine.shards:
        if src.param_source(s.index) is None:
            out.append(f"corrupt checkpoint: rank {engine.pg.rank} has no partition of parameter {s.name!r}")
        if src.state_source(s.index) is None:
            out.append(f"corrupt checkpoint: rank {engine.pg.rank} has no optimizer state of {s.name!r}")
    for b in mf.describe_model(engine)["buffers"]:
        if f"buffer.{b['name']}" not in src.keys:
            out.append(f"corrupt checkpoint: buffer {b['name']!r} is missing")
    if not src.has_file("engine_state.pt"):
        out.append(f"corrupt checkpoint: rank {engine.pg.rank} has no engine_state.pt")
    return out


def _verify(engine, load_dir, tag):
    """(tag_dir, manifest, RankFiles, engine state) or raises; agreed over ranks."""
    pg = engine.pg
    result, error = None, None
    try:
        tag_dir, manifest = mf.load_verified(load_dir, tag, mf.describe_model(engine), [pg.rank])
        src = RankFiles(tag_dir, manifest, pg.rank)
        problems = _missing(src, engine)
        if problems:
            raise mf.CheckpointError("cannot load checkpoint: " + "; ".join(problems))
        # Trusted files only: engine_state.pt is a pickle (client_state may hold any object).
        state = torch.load(src.dir / "engine_state.pt", map_location="cpu", weights_only=False)
        result = (tag_dir, manifest, src, state)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
        error = exc
    if pg.world_size > 1:
        everyone = [None] * pg.world_size
        dist.all_gather_object(everyone, None if error is None else str(error), group=pg.group)
        others = {r: msg for r, msg in enumerate(everyone) if msg is not None and r != pg.rank}
        if others and error is None:
            raise mf.CheckpointError("; ".join(f"rank {r}: {msg}" for r, msg in sorted(others.items())))
    if error is not None:
        if isinstance(error, mf.CheckpointError):
            raise error
        raise mf.CheckpointError(f"cannot load checkpoint from {load_dir}: {error}") from error
    return result


def _check_groups(engine, state) -> None:
    """The optimizer's groups must be the saved ones (Note [parameter groups]): their
    hyperparameters and the LR schedule's per-group state are restored by position."""
    from offload.checkpoint_io.save import group_shards

    here = group_shards(engine)
    saved = state.get("param_group_shards")  # absent from checkpoints older than parameter groups
    if saved is None:
        if len(state["param_groups"]) == len(here):
            return
        saved = [None] * len(state["param_groups"])
    if saved == here:
        return
    names = {s.index: s.name for s in engine.shards}
    detail = f"{len(saved)} in the checkpoint, {len(here)} in this engine"
    for i, (a, b) in enumerate(zip(saved, here)):
        if a is not None and a != b:
            detail += (f"; group {i} holds {[names.get(j, j) for j in a][:4]}... ({len(a)}) in the checkpoint, "
                       f"{[names[j] for j in b][:4]}... ({len(b)}) here")
            break
    raise mf.CheckpointError(f"parameter group mismatch: {detail}. Build the engine with the same "
                             "model_parameters groups, or load with load_optimizer_states=False and "
                             "load_lr_scheduler_states=False (weights and counters only)")


@torch.no_grad()
def load_into(engine, load_dir, tag: str | None = None, *, optimizer_states: bool = True,
              lr_scheduler_states: bool = True, module_only: bool = False):
    """Restores the engine from a checkpoint; returns (tag directory, the client_state it was saved with).

    Always the weights (parameters, fp32 masters, buffers). optimizer_states: Adam's moments,
    per-shard step counts and the groups' hyperparameters; lr_scheduler_states: the schedule's
    state; module_only: the weights alone, no counters, RNG or loss scale (DeepSpeed's options)."""
    tag_dir, _manifest, src, state = _verify(engine, load_dir, tag)
    optimizer_states = optimizer_states and not module_only
    lr_scheduler_states = lr_scheduler_states and not module_only
    if optimizer_states or lr_scheduler_states:
        _check_groups(engine, state)  # before anything changes
    engine.manager.release_all()  # nothing gathered or being fetched while homes are rewritten
    opt = engine.optimizer
    for s in engine.shards:
        part = src.param(s.index, s.dtype, s.part_numel)
        if s.home is Tier.HOST:
            s.host_part.copy_(part)
        elif s.home is Tier.DEVICE:
            s.ctx.pg.all_gather(s.device_full(), part.to(s.ctx.device))
        else:
            s.ctx.param_store.write(s, part.contiguous()).wait()
        if optimizer_states:
            opt.load_state_tensors(s, *src.state(s.index, s.part_numel))
        else:  # the fp32 weights, with this engine's moments (DeepSpeed keeps them too)
            opt.set_master(s, src.master(s.index, s.part_numel))
    for b in mf.describe_model(engine)["buffers"]:
        engine.module.get_buffer(b["name"]).copy_(src.tensor(f"buffer.{b['name']}"))
    if optimizer_states:
        opt.shard_steps.update({int(k): v for k, v in state["shard_steps"].items()})
        for group, saved in zip(opt.param_groups, state["param_groups"]):
            group.update(saved)
    if lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    if not module_only:
        if engine.loss_scaler is not None and state["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(state["loss_scaler"])
        engine.global_steps = state["global_steps"]
        engine.micro_steps = state["micro_steps"]
        engine.skipped_steps = state["skipped_steps"]
        restore_rng(state["rng"])
    engine._zero_grads()
    engine._micro_in_window = 0
    engine._passes_at_step = engine._passes_at_update = engine.manager.backward_passes
    engine._scaled_passes = 0
    return tag_dir, state["client_state"]


def restore_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if rng.get("numpy") is not None:
        try:
            import numpy

            numpy.random.set_state(rng["numpy"])
        except ImportError:
            pass
