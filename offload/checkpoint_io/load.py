"""Loading a checkpoint into an engine: verify everything first, then apply.

Nothing in the engine changes until the manifest has been checked (its file
list: Note [manifest paths]; the model: names, shapes, precision), every file
this rank reads has been read and its checksum compared, every tensor this
rank needs is known to be in the files, and the optimizer settings agree
with the config (Note [optimizer settings at load]); with several ranks, all
ranks agree on that before any of them applies anything. Then each shard is
loaded in turn, so host memory holds one shard's state at a time. Nothing
read is unpickled (Note [no code from a checkpoint] in engine_state.py).

A partition's tier at save time need not be its tier now: a host partition
can be loaded into an NVMe home and the other way round (the values are the
same bytes; only where they are read from differs).

Note [resuming at another world size]
A checkpoint saved by W ranks loads into W' ranks (a node lost: 2 -> 1, or
added: 1 -> 2). Each saved rank r holds elements [r * p, (r + 1) * p) of every
parameter's flat padded vector (Note [shard layout], p = ceil(n / W)), for the
compute-dtype partition, the fp32 master and both Adam moments alike; rank r'
of the new run needs [r' * p', (r' + 1) * p'). SavedPartitions cuts those
elements out of the saved ranks' partitions that overlap them (reading
every saved rank's files, so all ranks need the whole checkpoint directory:
a shared file system, or a copy), element for element, with zeros for the
padding past n, as a fresh run at W' pads. Per-shard step counts, counters,
parameter groups, LR schedule and loss scale are the same on every saved
rank and are taken from rank r' (or rank 0 where r' >= W). RNG states are
per rank: rank r' < W restores saved rank r''s; a rank the old run did not
have keeps its own. Host memory per shard: the saved partitions overlapping
this rank's, one shard at a time. A checkpoint saved inside an accumulation
window is refused at another world size (Note [saving inside an
accumulation window] in save.py).

Note [optimizer settings at load]
The checkpoint records the hyperparameters its run was configured with
(optimizer type and params, scheduler type and params, initialize's
parameter groups: engine_state.configured_hyperparameters). A load that
restores optimizer state (or the LR schedule) under a config that sets any of
them differently is refused, naming every differing key with both values,
rather than letting the saved values silently replace the configured ones.
To go on: load_checkpoint(..., use_config_hyperparameters=True) keeps the
moments, masters and step counts and applies the config's hyperparameters
(each group's lr, betas, eps, weight_decay; the config scheduler keeps its
params and resumes at the saved step, the groups' lr recomputed there);
load_optimizer_states=False / load_lr_scheduler_states=False start the
optimizer (weights kept, DeepSpeed's behaviour) / the schedule afresh.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from offload.aio.swap_format import HEADER_BYTES, parse_meta
from offload.checkpoint_io import engine_state
from offload.checkpoint_io import manifest as mf
from offload.checkpoint_io.frozen import EXCLUDED, check_same_base
from offload.optim.param_groups import check_group
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
        if not self.has_file("state.safetensors"):  # only files the manifest lists are opened
            raise mf.CheckpointError(f"corrupt checkpoint: rank{rank}/state.safetensors is not in the manifest")
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


class SavedPartitions:
    """This rank's partitions of every shard, from the saved ranks' files: the same rank's
    at the same world size, else cut from the saved ranks' (Note [resuming at another world size])."""

    def __init__(self, tag_dir: Path, manifest: dict, rank: int, world: int):
        model = manifest["model"]
        self.saved_world = model["world_size"]
        self.saved_part = {p["index"]: p["part_numel"] for p in model["parameters"]}
        self.rank, self.same_layout = rank, self.saved_world == world
        ranks = [rank] if self.same_layout else range(self.saved_world)
        self.files = {r: RankFiles(tag_dir, manifest, r) for r in ranks}
        self.own = self.files[rank if rank < self.saved_world else 0]  # engine state, buffers, gradients

    def _cut(self, shard, read) -> tuple[torch.Tensor, ...]:
        """read(rank_files, saved part_numel) -> tensors; their elements this rank owns now."""
        if self.same_layout:
            return tuple(read(self.own, shard.part_numel))
        old, new = self.saved_part[shard.index], shard.part_numel
        start, stop = self.rank * new, min((self.rank + 1) * new, shard.numel)
        out = None
        for r, src in self.files.items():
            lo, hi = max(start, r * old), min(stop, (r + 1) * old)
            if lo >= hi and not (out is None and r == self.saved_world - 1):
                continue
            got = read(src, old)
            if out is None:
                out = [torch.zeros(new, dtype=t.dtype) for t in got]  # zeros: the padding past numel
            for o, t in zip(out, got):
                if lo < hi:
                    o[lo - start:hi - start] = t[lo - r * old:hi - r * old]
        return tuple(out)

    def param(self, shard) -> torch.Tensor:
        return self._cut(shard, lambda src, n: (src.param(shard.index, shard.dtype, n),))[0]

    def state(self, shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._cut(shard, lambda src, n: src.state(shard.index, n))

    def master(self, shard) -> torch.Tensor:
        return self._cut(shard, lambda src, n: (src.master(shard.index, n),))[0]

    def grad(self, shard) -> torch.Tensor | None:
        """The partial gradient saved inside an accumulation window (same layout only)."""
        key = f"grad.{shard.index}"
        return self.own.tensor(key) if key in self.own.keys else None


def _missing(saved: SavedPartitions, view, frozen_excluded: bool) -> list[str]:
    out = []
    for r, src in saved.files.items():
        for s in view.shards:
            if not s.trainable and frozen_excluded:
                continue  # Note [checkpoints without frozen weights]
            if src.param_source(s.index) is None:
                out.append(f"corrupt checkpoint: rank {r} has no partition of parameter {s.name!r}")
            if s.trainable and src.state_source(s.index) is None:
                out.append(f"corrupt checkpoint: rank {r} has no optimizer state of {s.name!r}")
    for b in mf.describe_model(view)["buffers"]:
        if f"buffer.{b['name']}" not in saved.own.keys:
            out.append(f"corrupt checkpoint: buffer {b['name']!r} is missing")
    for name in ("engine_state.json", "client_state.pt"):
        if not saved.own.has_file(name):
            out.append(f"corrupt checkpoint: {saved.own.rel}{name} is missing")
    return out


def _newly_trained(manifest: dict, view) -> list[str]:
    """Parameters frozen when the checkpoint was saved and trainable here: they have no
    optimizer state to resume (Note [frozen parameters] in offload/placement.py)."""
    frozen = {p["name"] for p in manifest["model"]["parameters"] if p.get("state") is None}
    names = [s.name for s in view.shards if s.trainable and s.name in frozen]
    if not names:
        return []
    return [f"parameters frozen when the checkpoint was saved are trainable in this engine, and have no "
            f"optimizer state to resume: {mf.first_few(names)}; build the engine with them frozen "
            "(requires_grad=False before offload.initialize)"]


def _verify(view, load_dir, tag):
    """(tag_dir, SavedPartitions, engine state, client_state) or raises; agreed over ranks."""
    pg = view.pg
    result, error = None, None
    try:
        tag_dir = mf.resolve_tag_dir(load_dir, tag)
        manifest = mf.read_manifest(tag_dir)  # its file list checked before any is touched
        problems = mf.mismatches(manifest["model"], mf.describe_model(view)) or _newly_trained(manifest, view)
        saved_world = manifest["model"]["world_size"]
        frozen_excluded = manifest["model"].get("frozen") == EXCLUDED
        if not problems:
            ranks = [pg.rank] if saved_world == pg.world_size else range(saved_world)
            problems = mf.verify_files(tag_dir, manifest, ranks)
        if problems:
            raise mf.CheckpointError("cannot load checkpoint: " + "; ".join(problems))
        saved = SavedPartitions(tag_dir, manifest, pg.rank, pg.world_size)
        problems = _missing(saved, view, frozen_excluded)
        if problems:
            raise mf.CheckpointError("cannot load checkpoint: " + mf.first_few(problems, "; "))
        state = engine_state.from_json_bytes((saved.own.dir / "engine_state.json").read_bytes(),
                                             f"{saved.own.rel}engine_state.json")
        if frozen_excluded:
            problems = check_same_base(view, state.get("frozen_fingerprint"), saved_world)
            if problems:
                raise mf.CheckpointError("cannot load checkpoint: " + "; ".join(problems))
        state["frozen_excluded"] = frozen_excluded
        client_state = engine_state.load_client_state(saved.own.dir / "client_state.pt",
                                                      f"{saved.own.rel}client_state.pt")
        if state["micro_in_window"] and not saved.same_layout:
            raise mf.CheckpointError(
                f"cannot load checkpoint: it was saved inside a gradient accumulation window (micro-step "
                f"{state['micro_steps']}) by {saved_world} rank(s); its partial gradients are averages over "
                f"those ranks and do not carry over to {pg.world_size}. Resume at {saved_world} rank(s), or "
                "from a checkpoint saved at an accumulation boundary")
        result = (tag_dir, saved, state, client_state)
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


def _check_groups(view, state) -> None:
    """The optimizer's groups must be the saved ones (Note [parameter groups]): their
    hyperparameters and the LR schedule's per-group state are restored by position."""
    from offload.checkpoint_io.save import group_shards

    here = group_shards(view)
    saved = state.get("param_group_shards")  # absent from checkpoints older than parameter groups
    if saved is None:
        if len(state["param_groups"]) == len(here):
            return
        saved = [None] * len(state["param_groups"])
    if saved == here:
        return
    names = {s.index: s.name for s in view.shards}
    detail = f"{len(saved)} in the checkpoint, {len(here)} in this engine"
    for i, (a, b) in enumerate(zip(saved, here)):
        if a is not None and a != b:
            detail += (f"; group {i} holds {[names.get(j, j) for j in a][:4]}... ({len(a)}) in the checkpoint, "
                       f"{[names[j] for j in b][:4]}... ({len(b)}) here")
            break
    raise mf.CheckpointError(f"parameter group mismatch: {detail}. Build the engine with the same "
                             "model_parameters groups, or load with load_optimizer_states=False and "
                             "load_lr_scheduler_states=False (weights and counters only)")


def _check_hyperparameters(view, state, optimizer_states: bool, lr_scheduler_states: bool) -> None:
    """Note [optimizer settings at load]: refused, naming each difference, before anything changes."""
    prefixes = (("optimizer.", "param_groups[") if optimizer_states else ()) + \
        (("scheduler.", "lr_scheduler.") if lr_scheduler_states else ())
    differences = engine_state.hyperparameter_differences(
        state["hyperparameters"], engine_state.configured_hyperparameters(view), prefixes)
    if differences:
        raise mf.CheckpointError(
            "optimizer settings differ from the checkpoint's (a load would replace the configured ones "
            f"with the saved): {mf.first_few(differences, '; ')}. To resume with the configured settings and keep "
            "Adam's moments and step counts, load_checkpoint(..., use_config_hyperparameters=True); to keep "
            "the saved ones, configure them; load_optimizer_states=False / load_lr_scheduler_states=False "
            "start the optimizer / the LR schedule afresh (docs/CONFIG.md, \"DeepSpeed drop-in\")")


def _configured_groups(view) -> list[dict]:
    """Each optimizer group's hyperparameters as initialize set them (the config's, with
    the parameter groups' own values over them)."""
    opt, given = view.optimizer, view.param_group_names
    out = []
    for i, _ in enumerate(opt.param_groups):
        own = {} if given is None else check_group(i, {**given[i], "params": []})[1]
        out.append({**opt.defaults, **own})
    return out


def _load_scheduler(view, saved: dict, use_config: bool) -> None:
    sched = view.lr_scheduler
    if view.config.scheduler is None:  # the user's own object (initialize(lr_scheduler=...)): as torch
        sched.load_state_dict(saved)
        return
    # A config scheduler's settings stay the configured ones (checked equal unless use_config).
    keep = saved if not use_config else {k: saved[k] for k in ("last_epoch", "_step_count") if k in saved}
    sched.load_state_dict({**sched.state_dict(), **keep})
    if use_config:
        lrs = sched._get_closed_form_lr()  # the configured schedule at the saved step
        for group, lr in zip(view.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = list(lrs)


@torch.no_grad()
def load_into(view, load_dir, tag: str | None = None, *, optimizer_states: bool = True,
              lr_scheduler_states: bool = True, module_only: bool = False,
              use_config_hyperparameters: bool = False):
    """Restores the engine from a checkpoint; returns (tag directory, the client_state it was saved with).

    Always the weights (parameters, fp32 masters, buffers). optimizer_states: Adam's moments,
    per-shard step counts and the groups' hyperparameters; lr_scheduler_states: the schedule's
    state; module_only: the weights alone, no counters, RNG, loss scale or partial gradients
    (DeepSpeed's options); use_config_hyperparameters: Note [optimizer settings at load]."""
    tag_dir, saved, state, client_state = _verify(view, load_dir, tag)
    optimizer_states = optimizer_states and not module_only
    lr_scheduler_states = lr_scheduler_states and not module_only
    if optimizer_states or lr_scheduler_states:  # before anything changes
        _check_groups(view, state)
        if not use_config_hyperparameters:
            _check_hyperparameters(view, state, optimizer_states, lr_scheduler_states)
    view.manager.release_all()  # nothing gathered or being fetched while homes are rewritten
    opt = view.optimizer
    for s in view.shards:
        if not s.trainable and state["frozen_excluded"]:
            continue  # the same frozen base, checked by its fingerprint
        part = saved.param(s)
        if s.home is Tier.HOST:
            s.host_part.copy_(part)
        elif s.home is Tier.DEVICE:
            s.set_device_home(part)
        else:
            s.ctx.param_store.write(s, part.contiguous()).wait()
        if not s.trainable:
            view.frozen_fingerprints.pop(str(s.index), None)  # its home was rewritten
        elif optimizer_states:
            opt.states.load_state_tensors(s, *saved.state(s))
        else:  # the fp32 weights, with this engine's moments (DeepSpeed keeps them too)
            opt.set_master(s, saved.master(s))
    for b in mf.describe_model(view)["buffers"]:
        view.module.get_buffer(b["name"]).copy_(saved.own.tensor(f"buffer.{b['name']}"))
    if optimizer_states:
        opt.shard_steps.update({int(k): v for k, v in state["shard_steps"].items()})
        groups = _configured_groups(view) if use_config_hyperparameters else state["param_groups"]
        for group, values in zip(opt.param_groups, groups):
            group.update(values)
    if lr_scheduler_states and view.lr_scheduler is not None and state["lr_scheduler"] is not None:
        _load_scheduler(view, state["lr_scheduler"], use_config_hyperparameters)
    view.step.zero_grads()
    in_window = 0 if module_only else state["micro_in_window"]
    if not module_only:
        if view.pg.rank < saved.saved_world:  # a rank the saved run did not have keeps its own
            engine_state.restore_rng(state["rng"])
        for s in view.shards if in_window else ():  # Note [saving inside an accumulation window]
            _restore_grad(s, saved.grad(s))
    view.step.load_state_dict(state, window=bool(in_window), steps=not module_only, loss_scale=not module_only)
    return tag_dir, client_state


def _restore_grad(shard, grad: torch.Tensor | None) -> None:
    if grad is None:
        return  # no gradient yet in this window (clear_grad left it so)
    if shard.gradient.part is None:
        shard.gradient.allocate()
    shard.gradient.part.copy_(grad)
    shard.gradient.pending = True
