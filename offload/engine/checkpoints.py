"""An engine's checkpoints: save, load, the async save in progress.

EngineCheckpoints is one of the objects an Engine is composed of (offload/engine/engine.py);
the engine's save_checkpoint, load_checkpoint and wait_checkpoint call it. The work
is in offload/checkpoint_io (Note [checkpoint layout] in manifest.py), which reads
the engine's parts through `engine.checkpoint_view()` (checkpoint_io/view.py).
"""
from __future__ import annotations

import logging
import os
import weakref

import torch

from offload.checkpoint_io import consolidate, load_checkpoint, save_checkpoint
from offload.checkpoint_io.manifest import LATEST, MANIFEST, CheckpointError

log = logging.getLogger("offload")


class EngineCheckpoints:
    """Owns the async save in progress; the engine is held weakly (no cycle through it)."""

    def __init__(self, engine):
        self._engine = weakref.proxy(engine)
        self.job = None  # an async save in progress

    def save(self, save_dir, tag, client_state, save_latest: bool, async_save: bool,
             exclude_frozen: bool) -> str:

        engine = self._engine
        engine.step_runner.refuse_after_failed_step("save_checkpoint")  # the files may hold half-written values
        self.wait()
        job = save_checkpoint(engine.checkpoint_view(), save_dir, tag, client_state, async_save, save_latest,
                              exclude_frozen=exclude_frozen)
        job.save_dir = save_dir
        if async_save:
            self.job = job
        else:
            self._finish(job)
        return job.tag

    def _finish(self, job) -> None:
        job.finish()
        engine = self._engine
        if engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save and engine.pg.job_rank == 0:
            # DeepSpeed's key: the consolidated 16-bit weights beside the checkpoint,
            # one safetensors file streamed from every rank's files (offload.consolidate).

            dtype = engine.compute_dtype if engine.compute_dtype != torch.float32 else torch.bfloat16
            save_dir = os.fspath(job.save_dir)
            consolidate(save_dir, os.path.join(save_dir, job.tag, "model_16bit.safetensors"), tag=job.tag,
                        dtype=dtype)

    def load(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
             load_module_only, custom_load_fn, use_config_hyperparameters):

        where = where_to_load(load_dir, tag, load_module_strict, custom_load_fn)
        if where is None:
            return None, None
        load_dir, tag = where
        self.wait()
        engine = self._engine
        engine.step_runner.settle()  # no update may write while the files are rewritten
        tag_dir, client_state = load_checkpoint(
            engine.checkpoint_view(), load_dir, tag, optimizer_states=load_optimizer_states,
            lr_scheduler_states=load_lr_scheduler_states, module_only=load_module_only,
            use_config_hyperparameters=use_config_hyperparameters)
        # Every key was rewritten: a failed step's kept values and its retry are moot.
        for store in engine.swap_stores:
            store.discard_unwritten()
        engine.step_runner.loaded()
        return os.fspath(tag_dir), client_state

    def wait(self) -> None:
        """Waits for an async save to be written and committed; raises its error, if any."""
        job, self.job = self.job, None
        if job is not None:
            self._finish(job)

    def before_update(self) -> None:
        """Note [consistent async checkpoint] (checkpoint_io/save.py): an update waits
        until the save in progress has read what it saves."""
        if self.job is not None:
            self.job.before_update()


def where_to_load(load_dir, tag, load_module_strict, custom_load_fn):
    """load_checkpoint's refusals, then (root, tag) to load; None where nothing was ever
    saved there (DeepSpeed's (None, None)). load_dir may be the root (with or without
    tag) or a tag's directory itself; a path that is not a directory, or that does not
    exist, is refused: a run asked to resume never silently starts over."""

    if not load_module_strict:
        raise ValueError("load_checkpoint(load_module_strict=False) is not supported: the checkpoint is "
                         "verified against the whole model (every name and shape) before anything loads")
    if custom_load_fn is not None:
        raise ValueError("load_checkpoint(custom_load_fn=...) is not supported: offload's checkpoint "
                         "layout is its own (offload/checkpoint_io); read it with offload.consolidate")
    path = os.fspath(load_dir)
    if not os.path.exists(path):
        raise CheckpointError(f"load_checkpoint: {path} does not exist; give the directory save_checkpoint "
                              "wrote (its root, or one tag's directory under it)")
    if not os.path.isdir(path):
        raise CheckpointError(f"load_checkpoint: {path} is a file, not a checkpoint directory; give the "
                              "directory save_checkpoint wrote (its root, or one tag's directory under it)")
    if tag is not None:
        return path, tag
    if os.path.isfile(os.path.join(path, MANIFEST)):  # a tag's own directory
        root, own_tag = os.path.split(os.path.normpath(os.path.abspath(path)))
        return root, own_tag
    # No `latest` and no complete tag: a fresh start. A tag without `latest` is damage: an error, later.
    entries = os.listdir(path)
    if os.path.exists(os.path.join(path, LATEST)) or any(
            os.path.isfile(os.path.join(path, d, MANIFEST)) for d in entries):
        return path, None
    if entries:
        raise CheckpointError(f"load_checkpoint: {path} holds no checkpoint (no `{LATEST}` file, no tag "
                              f"directory with a {MANIFEST}; found {', '.join(sorted(entries)[:5])}"
                              f"{' ...' if len(entries) > 5 else ''}); give the directory save_checkpoint "
                              "wrote, or a tag's directory under it")
    log.warning("load_checkpoint: %s is empty: no checkpoint was saved there yet; nothing loaded", path)
    return None
