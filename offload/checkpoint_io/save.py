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
commit). Forward and backward of the next steps overlap with the write. If
the optimizer update ever moves earlier (into backward), that hook must move
with it; tests/engine/test_checkpoint.py checks the snapshot is unchanged by
steps run while it is written.

The commit (manifest, rename, `latest`; Note [checkpoint layout]) needs every
rank's files: with one rank the writer thread commits as soon as it is done;
with several, `finish()` (engine.wait_checkpoint, the next save, close)
agrees over the process group and rank 0 commits.
"""
from __future__ import annotations

import io
import json
import random
import shutil
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from offload.aio.swap_store import fsync_path
from offload.checkpoint_io import files
from offload.checkpoint_io import manifest as mf
from offload.tiers import Tier


def capture_engine_state(engine, client_state) -> bytes:
    """The small state, serialized now so later changes (by training or the caller) cannot leak in."""
    opt = engine.optimizer
    state = {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "shard_steps": dict(opt.shard_steps),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "param_group_shards": group_shards(engine),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "rng": capture_rng(),
        "client_state": client_state,
    }
    out = io.BytesIO()
    torch.save(state, out)
    return out.getvalue()


def group_shards(engine) -> list[list[int]]:
    """Each optimizer group's shard indices, in order (Note [parameter groups])."""
    index = {id(s.param): s.index for s in engine.shards}
    return [[index[id(p)] for p in g["params"]] for g in engine.optimizer.param_groups]


def capture_rng() -> dict:
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": None, "numpy": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        rng["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return rng


class _Item:
    """One thing a rank writes: a tensor of state.safetensors, or a file copy."""

    def __init__(self, name, dtype=None, shape=None, read=None, copy_from: Path | None = None):
        self.name, self.dtype, self.shape, self.read, self.copy_from = name, dtype, shape, read, copy_from


def _home_view(shard):
    """This rank's compute-dtype partition at its home, in place (no copy)."""
    if shard.home is Tier.HOST:
        return shard.host_part
    start = shard.ctx.pg.rank * shard.part_numel
    return shard.device_full()[start:start + shard.part_numel]


def plan_items(engine) -> list[_Item]:
    """Per shard: its home partition and optimizer state, in shard order."""
    opt, items = engine.optimizer, []
    for s in engine.shards:
        n = (s.part_numel,)
        state = None if opt.tier.value == "nvme" else opt.state_tensors(s)
        if s.home is Tier.NVME:
            items.append(_Item(f"nvme/param.{s.index}.swp", copy_from=s.ctx.param_store.path_of(s)))
        else:
            # A fp32 host home with host optimizer state is the master itself: saved once.
            aliased = state is not None and s.home is Tier.HOST and \
                state[0].data_ptr() == s.host_part.data_ptr()
            if not aliased:
                items.append(_Item(f"param.{s.index}", s.dtype, n, read=lambda s=s: _home_view(s)))
        if state is None and opt.shares_master(s):
            # Note [shared fp32 master]: the master is the parameter's file, saved above.
            items.append(_Item(f"nvme/moments.{s.index}.swp", copy_from=opt.state_file(s)))
        elif state is None:
            items.append(_Item(f"nvme/optim.{s.index}.swp", copy_from=opt.state_file(s)))
        else:
            for j, what in enumerate(("master", "exp_avg", "exp_avg_sq")):
                items.append(_Item(f"{what}.{s.index}", torch.float32, n,
                                   read=lambda s=s, j=j: opt.state_tensors(s)[j]))
    return items


class SaveJob:
    """One checkpoint being written by this rank (Note [consistent async checkpoint])."""

    def __init__(self, engine, save_dir, tag: str | None, client_state, async_save: bool,
                 save_latest: bool = True):
        if engine.gradients_pending or engine._micro_in_window:
            raise RuntimeError(
                f"save_checkpoint inside a gradient accumulation window (micro-step "
                f"{engine.micro_steps}, gradient_accumulation_steps "
                f"{engine.gradient_accumulation_steps()}, gradients pending: "
                f"{engine.gradients_pending}): the gradients accumulated so far are not saved; "
                f"save after the engine.step() that completes the window")
        self.pg = engine.pg
        self.save_latest = save_latest
        self.root = Path(save_dir)
        self.tag = mf.check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
        self.tmp = mf.tmp_dir(self.root, self.tag)
        self.model = mf.describe_model(engine)
        self.kind = files.kind()
        self._prepare_dirs()
        self.rank_dir = mf.rank_dir(self.tmp, self.pg.rank)
        (self.rank_dir / "nvme").mkdir(parents=True, exist_ok=True)
        # Swap writes still in flight would race the copies; the optimizer step
        # waits for its own, this makes sure of it.
        for store in engine.swap_stores:
            store.wait_all()
        self.state_bytes = capture_engine_state(engine, client_state)
        self.buffers = [(b["name"], engine.module.get_buffer(b["name"]).detach().to("cpu", copy=True))
                        for b in self.model["buffers"]]
        self.items = plan_items(engine)
        self.entries: dict[str, tuple[int, int]] = {}
        self.error: BaseException | None = None
        self.committed = False
        self._snapshot_done = threading.Event()
        self._thread = None
        if async_save:
            self._thread = threading.Thread(target=self._run, name=f"offload-checkpoint-{self.tag}")
            self._thread.start()
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
            self.error = exc
            if self.pg.world_size == 1:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            self._snapshot_done.set()

    def _write_rank(self) -> None:
        rel = f"rank{self.pg.rank}/"
        self.entries[rel + "engine_state.pt"] = files.write_bytes(self.rank_dir / "engine_state.pt",
                                                                  self.state_bytes)
        plan = [(i.name, i.dtype, i.shape) for i in self.items if i.copy_from is None]
        plan += [(f"buffer.{name}", b.dtype, tuple(b.shape)) for name, b in self.buffers]
        stream = files.SafetensorsStream(self.rank_dir / "state.safetensors", plan,
                                         {"format": "pt", "offload": "checkpoint rank partition"})
        try:
            for item in self.items:
                if item.copy_from is None:
                    stream.write(item.name, item.read())
                else:
                    self.entries[rel + item.name] = files.copy_file(item.copy_from,
                                                                    self.rank_dir / item.name)
            for name, b in self.buffers:
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
        if self.pg.world_size == 1:
            if self.error is not None:
                raise self.error
            return
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
        dist.broadcast_object_list(outcome, src=0, group=self.pg.group)
        if outcome[0]:
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(outcome[0].items()))
            raise RuntimeError(f"checkpoint {self.tag!r} in {self.root} was not saved: {detail}") \
                from self.error


def _barrier(pg) -> None:
    if pg.world_size > 1:
        dist.barrier(group=pg.group)
