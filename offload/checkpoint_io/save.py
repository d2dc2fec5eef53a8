"""Writing a checkpoint: a consistent snapshot, files per rank, an atomic commit.

Note [consistent async checkpoint]
What a save must capture changes at different moments of training:
  - counters, LR scheduler, loss scaler, RNG states, param groups, per-shard
    step counts, client_state and the module's buffers (BatchNorm statistics
    change in forward): taken on the caller's thread before save returns,
    serialized/cloned there (small);
  - parameter partitions, fp32 masters and Adam moments on every tier: change
    only in the optimizer update. They are read in place, one shard at a time
    (host tensors are written straight from their memory, device tensors
    through one shard-sized host copy, NVMe swap files copied through one
    8 MiB buffer), so host memory stays bounded by the largest shard.
With async_save the second part runs on a writer thread while training goes
on; Engine.step() calls `before_update()` before the optimizer update, which
waits until the writer has read every tensor (not for the fsyncs or the
commit). Forward and backward of the next steps overlap with the write.
Updates that run during backward or under the next forward wait for it too:
the engine calls the same hook before it lets the first of them start
(EngineCheckpoints.before_update, engine/checkpoints.py); tests/checkpoint_io/test_checkpoint.py checks the snapshot
is unchanged by steps run while it is written.

The commit (manifest, rename, `latest`; Note [checkpoint layout]) needs every
rank's files: with one rank the writer thread commits as soon as it is done;
with several, `finish()` (engine.wait_checkpoint, the next save, close)
agrees over the process group and rank 0 commits.

Note [saving inside an accumulation window]
A save may come after any engine.step(), also one inside a gradient
accumulation window (DeepSpeed allows it). The window's partial gradients
are then part of the state: each shard's fp32 gradient partition is saved
(grad.{i} in state.safetensors) with the window's position (micro_in_window,
and fp16's count of scaled passes), and load restores them, so the resumed
run finishes the window exactly as the uninterrupted one (bitwise: the
partition is the fp32 sum the next backward adds to). Gradients change in
the next backward, not only in the update, so an async save inside a window
returns once they are read. Not allowed: between a backward and the step()
that counts it (the micro-step would be half counted), and resuming such a
checkpoint at another world size (each rank's partial gradient is an average
over the old ranks; refused by load).
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from offload.aio.swap_dir import fsync_path
from offload.checkpoint_io import engine_state, files
from offload.checkpoint_io import manifest as mf
from offload.checkpoint_io.frozen import EXCLUDED, frozen_fingerprint
from offload.tiers import Tier


def capture_engine_state(view, exclude_frozen: bool = False) -> bytes:
    """The small state as JSON (Note [no code from a checkpoint]), serialized now so later
    changes (by training or the caller) cannot leak in; without the frozen weights, their
    fingerprint (Note [checkpoints without frozen weights] in checkpoint_io/frozen.py)."""
    opt = view.optimizer
    state = {
        # Note [step counters]; Note [saving inside an accumulation window]
        **view.step.state_dict(),  # the counters and the loss scale
        "shard_steps": dict(opt.shard_steps),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "param_group_shards": group_shards(view),
        "lr_scheduler": scheduler_state(view),
        "rng": engine_state.capture_rng(),
        "hyperparameters": engine_state.configured_hyperparameters(view),
    }
    if exclude_frozen:
        state["frozen_fingerprint"] = frozen_fingerprint(view)
    return engine_state.to_json_bytes(state)


def scheduler_state(view) -> dict | None:
    """The LR scheduler's state_dict; a config scheduler's settings (its `params`) are not
    state: they are the config's, compared at load (Note [optimizer settings at load])."""
    if view.lr_scheduler is None:
        return None
    state = view.lr_scheduler.state_dict()
    if view.config.scheduler is not None:
        state.pop("params", None)
    return state


def group_shards(view) -> list[list[int]]:
    """Each optimizer group's shard indices, in order (Note [parameter groups])."""
    index = {id(s.param): s.index for s in view.shards}
    return [[index[id(p)] for p in g["params"]] for g in view.optimizer.param_groups]


class _Item:
    """One thing a rank writes: a tensor of state.safetensors, or a file copy."""

    def __init__(self, name, dtype=None, shape=None, read=None, copy_from: Path | None = None):
        self.name, self.dtype, self.shape, self.read, self.copy_from = name, dtype, shape, read, copy_from


def _home_view(shard):
    """This rank's compute-dtype partition at its home: in place (no copy) on the host."""
    if shard.home is Tier.HOST:
        return shard.host_part
    return shard.home_partition()


def plan_items(view, exclude_frozen: bool = False) -> list[_Item]:
    """Per shard: its home partition and optimizer state, in shard order; a frozen shard's
    home alone, or nothing with exclude_frozen (Note [checkpoints without frozen weights])."""
    opt, items = view.optimizer, []
    for s in view.shards:
        n = (s.part_numel,)
        if not s.trainable:
            if exclude_frozen:
                continue
            if s.home is Tier.NVME:
                items.append(_Item(f"nvme/param.{s.index}.swp", copy_from=s.ctx.param_store.path_of(s)))
            else:
                items.append(_Item(f"param.{s.index}", s.dtype, n, read=lambda s=s: _home_view(s)))
            continue
        state = None if opt.states.state_tier(s) is Tier.NVME else opt.state_tensors(s)
        if s.home is Tier.NVME:
            items.append(_Item(f"nvme/param.{s.index}.swp", copy_from=s.ctx.param_store.path_of(s)))
        else:
            # A fp32 host home with host optimizer state is the master itself: saved once.
            aliased = state is not None and s.home is Tier.HOST and \
                state[0].data_ptr() == s.host_part.data_ptr()
            if not aliased:
                items.append(_Item(f"param.{s.index}", s.dtype, n, read=lambda s=s: _home_view(s)))
        if state is None and opt.states.shares_master(s):
            # Note [shared fp32 master]: the master is the parameter's file, saved above.
            items.append(_Item(f"nvme/moments.{s.index}.swp", copy_from=opt.states.state_file(s)))
        elif state is None:
            items.append(_Item(f"nvme/optim.{s.index}.swp", copy_from=opt.states.state_file(s)))
        else:
            for j, what in enumerate(("master", "exp_avg", "exp_avg_sq")):
                items.append(_Item(f"{what}.{s.index}", torch.float32, n,
                                   read=lambda s=s, j=j: opt.state_tensors(s)[j]))
        if s.gradient.pending:  # Note [saving inside an accumulation window]
            items.append(_Item(f"grad.{s.index}", torch.float32, n, read=lambda s=s: s.gradient.part))
    return items


class SaveJob:
    """One checkpoint being written by this rank (Note [consistent async checkpoint])."""

    def __init__(self, view, save_dir, tag: str | None, client_state, async_save: bool,
                 save_latest: bool = True, exclude_frozen: bool = False):
        view.step.refuse_save_mid_step()  # Note [saving inside an accumulation window]
        for s in view.shards if view.pg.replicas > 1 else ():  # what group 0 saves is the sum across
            s.gradient.sum_share_across()  # the groups (Note [gradients across groups once a window])
        self.pg = view.pg
        self.save_latest = save_latest
        self.root = Path(save_dir)
        if self.root.exists() and not self.root.is_dir():
            raise mf.CheckpointError(f"save_checkpoint: {self.root} is a file; give a directory (it is made "
                                     "where missing), under which each checkpoint is a tag's directory")
        self.tag = mf.check_tag(tag if tag is not None else f"global_step{view.step.counters.global_steps}")
        self.tmp = mf.tmp_dir(self.root, self.tag)
        self.model = mf.describe_model(view)
        exclude_frozen = exclude_frozen and any(not sh.trainable for sh in view.shards)
        if exclude_frozen:
            self.model["frozen"] = EXCLUDED  # Note [checkpoints without frozen weights]
        self.kind = files.kind()
        self.error: BaseException | None = None
        self.committed = False
        self._snapshot_done = threading.Event()
        self._thread = None
        if self.pg.replica > 0:  # group 0 writes the partitions every group holds (Note [hybrid sharding])
            self.items, self.entries = [], {}
            self._snapshot_done.set()
            return
        self._prepare_dirs()
        self.rank_dir = mf.rank_dir(self.tmp, self.pg.rank)
        (self.rank_dir / "nvme").mkdir(parents=True, exist_ok=True)
        # Swap writes still in flight would race the copies; the optimizer step
        # waits for its own, this makes sure of it.
        for store in view.swap_stores:
            store.wait_all()
        self.state_bytes = capture_engine_state(view, exclude_frozen)
        self.client_bytes = engine_state.client_state_bytes(client_state)
        self.model_buffers = [(b["name"], view.module.get_buffer(b["name"]).detach().to("cpu", copy=True))
                        for b in self.model["buffers"]]
        self.items = plan_items(view, exclude_frozen)
        self.entries: dict[str, tuple[int, int]] = {}
        self._writing: Path | None = None  # the file being written (Note [checkpoint free space])
        if async_save:
            self._thread = threading.Thread(target=self._run, name=f"offload-checkpoint-{self.tag}")
            self._thread.start()
            if any(i.name.startswith("grad.") for i in self.items):
                # Gradients change in the next backward, not only in the update:
                # returns once they are read (Note [saving inside an accumulation window]).
                self._snapshot_done.wait()
        else:
            self._run()

    def _prepare_dirs(self) -> None:
        if self.pg.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)  # left by a crashed save of this tag
            self.tmp.mkdir()
        _barrier(self.pg)

    # ---- the writer (caller's thread, or a background thread) ---------------
    def _run(self) -> None:
        try:
            self._write_rank()
            if self.pg.world_size == 1:
                self._commit({0: self.entries})
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish() on the caller's thread
            self.error = self._with_path(exc)
            if self.pg.world_size == 1:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            self._snapshot_done.set()

    # Note [checkpoint free space]: a rank's files are sized before the first is
    # written (swap files copied as they are, tensors and buffers by their bytes,
    # 64 KiB for headers and the manifest) and refused if the file system has
    # less free; a disk that fills anyway (another writer) fails naming the file
    # and the figures. Either way the temporary directory goes and the previous
    # checkpoint, `latest` included, is untouched (Note [checkpoint layout]).
    def _bytes_needed(self) -> int:
        n = len(self.state_bytes) + len(self.client_bytes) + (64 << 10)
        for item in self.items:
            n += (os.stat(item.copy_from).st_size if item.copy_from is not None
                  else math.prod(item.shape) * item.dtype.itemsize)
        return n + sum(b.numel() * b.element_size() for _, b in self.model_buffers)

    def _check_free_space(self) -> None:
        need, free = self._bytes_needed(), shutil.disk_usage(self.rank_dir).free
        if need > free:
            raise OSError(errno.ENOSPC, f"checkpoint {self.tag!r} not saved: {self.root} has {free} bytes free, "
                                        f"this rank's files need {need} ({need - free} short); nothing was "
                                        "written and the previous checkpoint is unchanged")

    def _with_path(self, exc: BaseException) -> BaseException:
        """A full disk during the write, named: the file, what was needed, what is free now."""
        if not isinstance(exc, OSError) or exc.errno != errno.ENOSPC or self._writing is None:
            return exc
        reason = exc.strerror or os.strerror(errno.ENOSPC)
        named = OSError(errno.ENOSPC, f"checkpoint {self.tag!r} not saved: {reason} writing "
                                      f"{self._writing} ({self._bytes_needed()} bytes needed for this rank's "
                                      f"files, {shutil.disk_usage(self.root).free} bytes free now); the "
                                      "previous checkpoint is unchanged")
        named.__cause__ = exc
        return named

    def _write_rank(self) -> None:
        self._check_free_space()
        rel = f"rank{self.pg.rank}/"
        self._writing = self.rank_dir / "engine_state.json"
        self.entries[rel + "engine_state.json"] = files.write_bytes(self.rank_dir / "engine_state.json",
                                                                    self.state_bytes)
        self._writing = self.rank_dir / "client_state.pt"
        self.entries[rel + "client_state.pt"] = files.write_bytes(self.rank_dir / "client_state.pt",
                                                                  self.client_bytes)
        plan = [(i.name, i.dtype, i.shape) for i in self.items if i.copy_from is None]
        plan += [(f"buffer.{name}", b.dtype, tuple(b.shape)) for name, b in self.model_buffers]
        stream = files.SafetensorsStream(self.rank_dir / "state.safetensors", plan,
                                         {"format": "pt", "offload": "checkpoint rank partition"})
        try:
            for item in self.items:
                if item.copy_from is None:
                    self._writing = self.rank_dir / "state.safetensors"
                    stream.write(item.name, item.read())
                else:
                    self._writing = self.rank_dir / item.name
                    self.entries[rel + item.name] = files.copy_file(item.copy_from,
                                                                    self.rank_dir / item.name)
            self._writing = self.rank_dir / "state.safetensors"
            for name, b in self.model_buffers:
                stream.write(f"buffer.{name}", b)
        except BaseException:
            stream.abort()
            raise
        # Every tensor has been read: the optimizer may change them now.
        self._snapshot_done.set()
        self.entries[rel + "state.safetensors"] = stream.close()
        fsync_path(self.rank_dir / "nvme")
        fsync_path(self.rank_dir)

    def _commit(self, entries_by_rank: dict) -> None:
        """Rank 0: manifest, rename to the tag, then `latest` (Note [checkpoint layout])."""
        merged = {}
        for entries in entries_by_rank.values():
            merged.update({rel: {"bytes": n, "crc": crc} for rel, (n, crc) in entries.items()})
        manifest = {"format": mf.FORMAT, "version": mf.VERSION, "tag": self.tag,
                    "checksum": self.kind.name, "model": self.model, "files": merged}
        files.write_bytes(self.tmp / mf.MANIFEST, json.dumps(manifest, indent=1).encode())
        fsync_path(self.tmp)
        final, old = self.root / self.tag, mf.old_dir(self.root, self.tag)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        files.replace_durably(self.tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        if self.save_latest:
            mf.write_latest(self.root, self.tag)
        self.committed = True

    # ---- the caller's side --------------------------------------------------
    def before_update(self) -> None:
        """Blocks until the writer has read every tensor the optimizer update would change."""
        self._snapshot_done.wait()

    def finish(self) -> None:
        """Waits for the write and commits (a collective with several ranks); raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.pg.replicas > 1:
            self._finish_groups()
            return
        if self.pg.world_size == 1:
            if self.error is not None:
                raise self.error
            return
        self._raise(self._group_outcome())

    def _finish_groups(self) -> None:
        """Several groups (Note [hybrid sharding]): group 0's outcome, told to every rank."""
        outcome = [None]
        if self.pg.replica == 0:
            if self.pg.world_size == 1:
                outcome = [{} if self.error is None else {0: f"{type(self.error).__name__}: {self.error}"}]
            else:
                outcome = [self._group_outcome()]
        dist.broadcast_object_list(outcome, src=0, group=self.pg.job_group)
        if outcome[0] and self.error is not None and self.pg.world_size == 1:
            raise self.error
        self._raise(outcome[0])

    def _raise(self, failed: dict) -> None:
        if failed:
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items()))
            raise RuntimeError(f"checkpoint {self.tag!r} in {self.root} was not saved: {detail}") \
                from self.error

    def _group_outcome(self) -> dict:
        """The shard group's files committed by its rank 0; {rank: error} of what failed."""
        mine = (None if self.error is None else f"{type(self.error).__name__}: {self.error}",
                self.entries)
        everyone = [None] * self.pg.world_size
        dist.all_gather_object(everyone, mine, group=self.pg.group)
        failed = {r: err for r, (err, _) in enumerate(everyone) if err is not None}
        if not failed and self.pg.rank == 0:
            try:
                self._commit({r: entries for r, (_, entries) in enumerate(everyone)})
            except BaseException as exc:  # noqa: BLE001 - every rank must hear of it
                failed[0] = f"{type(exc).__name__}: {exc}"
        outcome = [None]
        if self.pg.rank == 0:
            outcome = [failed]
            if failed:
                shutil.rmtree(self.tmp, ignore_errors=True)
        dist.broadcast_object_list(outcome, src=self.pg.job_rank - self.pg.rank, group=self.pg.group)
        return outcome[0]


def _barrier(pg) -> None:
    if pg.world_size > 1:
        dist.barrier(group=pg.group)
