"""The engine's checkpoint methods: save_checkpoint, load_checkpoint, save_pretrained.

A mixin of Engine (offload/engine/engine.py), as DeepSpeedMethods is; the
work is in offload/checkpoint_io (Note [checkpoint layout] in manifest.py).
"""
from __future__ import annotations

import os

import torch

from offload.engine.step_phase import StepPhase


class CheckpointMethods:
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state=None, save_latest: bool = True, *,
                        async_save: bool = False, exclude_frozen_parameters: bool = False) -> str:
        """Saves every tier's state under save_dir/tag (default tag: global_step{N}); returns the tag.

        Crash-safe: the checkpoint appears complete or not at all, and `latest`
        names it only then (save_latest=False: `latest` is left alone).
        async_save=True returns once the small state is captured; tensors are
        written while training goes on (the next optimizer update waits until
        they are read). wait_checkpoint(), the next save and close() wait for
        it. A collective with several ranks.
        exclude_frozen_parameters=True: the trainable state alone, with a fingerprint of
        the frozen weights; it loads only into an engine on the same frozen base, at the
        same world size (Note [checkpoints without frozen weights] in checkpoint_io/frozen.py).
        """
        from offload.checkpoint_io import save_checkpoint

        self._check_open()
        self._refuse_after_failed_step("save_checkpoint")  # the files may hold half-written values
        self.wait_checkpoint()
        job = save_checkpoint(self, save_dir, tag, client_state, async_save, save_latest,
                              exclude_frozen=exclude_frozen_parameters)
        job.save_dir = save_dir
        if async_save:
            self._checkpoint_job = job
        else:
            self._finish_checkpoint(job)
        return job.tag

    def _finish_checkpoint(self, job) -> None:
        job.finish()
        if self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save and self.pg.rank == 0:
            # DeepSpeed's key: the consolidated 16-bit weights beside the checkpoint,
            # one safetensors file streamed from every rank's files (offload.consolidate).
            from offload.checkpoint_io import consolidate

            dtype = self.compute_dtype if self.compute_dtype != torch.float32 else torch.bfloat16
            save_dir = os.fspath(job.save_dir)
            consolidate(save_dir, os.path.join(save_dir, job.tag, "model_16bit.safetensors"), tag=job.tag,
                        dtype=dtype)

    def save_pretrained(self, save_dir, *, max_shard_size="5GB", dtype: torch.dtype | None = None,
                        master: bool = False):
        """The model in Hugging Face's layout (sharded safetensors, index, config), streamed one
        tensor at a time, so a model larger than RAM is saved too; `from_pretrained(save_dir)`
        loads it (Note [streamed pretrained save]). dtype: of floating tensors (default: as they
        are). master=True: the trained parameters' fp32 master weights (what a bf16 run's
        optimizer holds) instead of their compute-dtype copies; frozen parameters have no
        master and are written as they are held, in the compute dtype (Note [frozen
        parameters] in offload/placement.py). A collective with several ranks; rank 0 writes."""
        from offload.checkpoint_io.pretrained import save_pretrained

        self._check_open()
        return save_pretrained(self, save_dir, max_shard_size=max_shard_size, dtype=dtype, master=master)

    def load_checkpoint(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None, *,
                        use_config_hyperparameters: bool = False):
        """Restores what save_checkpoint saved (tag default: `latest`); returns DeepSpeed's
        (load_path, client_state), load_path being the tag's directory.

        The checkpoint is verified first (manifest, sizes, checksums, model,
        parameter groups, optimizer settings against the config); a bad one raises
        CheckpointError and changes nothing. Saved at another world size, it is
        re-partitioned (Note [resuming at another world size] in checkpoint_io/load.py).
        use_config_hyperparameters: keep the moments, apply the config's optimizer and
        scheduler settings where they differ (else refused: Note [optimizer settings at load]).
        load_dir: the root save_checkpoint wrote (tag: the one to load, default `latest`)
        or one tag's directory itself. (None, None), as DeepSpeed, where load_dir is an
        empty directory: nothing was saved there yet. A path that does not exist, a file,
        or a directory holding something else raises CheckpointError, naming it. The options: docs/CONFIG.md, "DeepSpeed drop-in".
        """
        from offload.checkpoint_io import load_checkpoint

        self._check_open()
        where = self._where_to_load(load_dir, tag, load_module_strict, custom_load_fn)  # deepspeed_methods.py
        if where is None:
            return None, None
        load_dir, tag = where
        self.wait_checkpoint()
        if self.steps.updating_in_backward:  # no update may write while the files are rewritten
            self._abandon_overlap()
        self.optimizer.deferred.settle()  # nor one left running by the last step
        tag_dir, client_state = load_checkpoint(
            self, load_dir, tag, optimizer_states=load_optimizer_states,
            lr_scheduler_states=load_lr_scheduler_states, module_only=load_module_only,
            use_config_hyperparameters=use_config_hyperparameters)
        # Every key was rewritten: a failed step's kept values and its retry are moot.
        for store in self._stores:
            store.discard_unwritten()
        # Any phase but updating in backward, which was abandoned above.
        self.steps.to_ready(StepPhase.READY, StepPhase.UPDATING_UNDER_FORWARD, StepPhase.FAILED)
        return os.fspath(tag_dir), client_state

    def wait_checkpoint(self) -> None:
        """Waits for an async save to be written and committed; raises its error, if any."""
        job, self._checkpoint_job = self._checkpoint_job, None
        if job is not None:
            self._finish_checkpoint(job)

    def _before_update(self) -> None:
        if self._checkpoint_job is not None:
            self._checkpoint_job.before_update()
