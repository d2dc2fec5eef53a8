"""DeepSpeedEngine's methods on Engine (a base of it): their names and return
values are DeepSpeed's, for scripts, Trainer and Accelerate written for it
(the module functions of DeepSpeed's API: offload/engine/deepspeed_api.py).

Note [global gradient norm]
get_global_grad_norm() is the 2-norm over every gradient the last update
applied, before clipping (torch.nn.utils.clip_grad_norm_'s return value).
With clipping on it is the clipping's own norm. With clipping off it is
summed in ShardedAdam.update_shard from each shard's gradient as its update
applies it (on the host worker when updates overlap backward, where no
later point still has the gradients), then summed over ranks when the step
completes; with one rank, when asked for or before the next update starts
(the updates may still run under the next forward; a device's terms are
read without waiting for it per step). The Adam kernel takes each block's squares right after its
update read the block (offload.ops.adam_step(sum_grad_squares=True)), from
cache: a second pass over the gradient, as this once was, read it from
memory again, 23% of the update's own time (16M elements, one core), on the
host worker's path that bounds backward beside a GPU. The sum is the
kernel's, in its own order (fp32 lanes, double across blocks): equal to
torch.linalg.vector_norm's to fp32 rounding, not bit for bit. The torch
fallback (no extension) and device-tier state take a separate pass.
With device-tier optimizer state each shard's term stays on the device (in
double), read once, when the norm is asked for: a read per shard waited for
the device each time (0.94B in bf16 on an H200: ~200 waits a step).
"""
from __future__ import annotations

import logging
import math
import os

import torch


log = logging.getLogger("offload")


class DeepSpeedMethods:
    """DeepSpeedEngine's methods, on Engine; their names and return values are DeepSpeed's."""

    compiled_blocks: tuple = ()

    def compile(self, backend="inductor", compile_kwargs=None, schedule=None, modules=None) -> None:
        """DeepSpeed's engine.compile(), done block by block: each block's own forward
        compiled with torch.compile(backend=..., **compile_kwargs), its parameters gathered
        at its boundary (Note [compiled blocks] in partition/compiled.py). modules: the
        block classes' names; by default the class of the largest nn.ModuleList's children."""
        from offload.partition.compiled import (blocks_to_compile, compile_blocks, compile_forwards,
                                                gathered_at_once)

        self._check_open()
        if schedule is not None:
            raise ValueError("compile(schedule=...) is DeepCompile's, DeepSpeed's own; offload compiles each "
                             "block instead: engine.compile(modules=[...])")
        if self.compiled_blocks:
            raise RuntimeError(f"compile: this engine's {len(self.compiled_blocks)} blocks are compiled already (by "
                               "the config's compile section, or an earlier engine.compile())")
        blocks = blocks_to_compile(self.module, modules)
        forwards = compile_forwards(blocks, backend=backend, **(compile_kwargs or {}))
        self._prefetch_by_blocks(gathered_at_once(blocks, self.shards))
        self.compiled_blocks = tuple(compile_blocks(self.manager, blocks, forwards))

    def _prefetch_by_blocks(self, unit: int) -> None:
        """Note [blocks as the unit of prefetch], for blocks compiled after initialize:
        refused where the device budget has no room for a block gathered whole."""
        from offload.partition.prefetch import prefetch_limits, working_set_elems
        from offload.tiers import Tier

        zero = self.config.zero_optimization
        gathered = [s.padded_numel for s in self.shards if s.gathers_to_a_buffer]
        if unit <= max(gathered, default=0):
            return  # no block gathers more than its largest parameter: nothing changes
        device = self.account.usage(Tier.DEVICE)
        need = working_set_elems(zero, gathered, any(s.reads_ahead for s in self.shards), unit, unit)
        need *= self.compute_dtype.itemsize
        if device.budget is not None and device.now + need > device.budget:
            raise MemoryError(  # as initialize's own check of the budgets (engine/budgets.py)
                f"compile: a block gathers {unit * self.compute_dtype.itemsize / 2**20:.1f} MiB of parameters at "
                f"once, so the step needs {need / 2**20:.1f} MiB of them gathered beside the "
                f"{device.now / 2**20:.1f} MiB the device tier holds now, past memory.device_budget "
                f"({device.budget / 2**20:.1f} MiB). Name the blocks in the config's compile section, so that "
                "initialize plans for them, or compile smaller modules (modules=[...])")
        self.manager.prefetch.resize(prefetch_limits(zero, unit))

    @property
    def is_compiled(self) -> bool:
        """Whether the model's blocks are compiled (engine.compile() or the config's compile)."""
        return bool(self.compiled_blocks)

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's gradient_accumulation_steps)."""
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """The config's micro batch per rank; None where it is not set."""
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        """train_batch_size, or micro batch * accumulation * world size when only the micro batch is given."""
        if self.config.train_batch_size is not None:
            return self.config.train_batch_size
        mb = self.config.train_micro_batch_size_per_gpu
        return None if mb is None else mb * self.gradient_accumulation_steps() * self.pg.world_size

    def dataloader_drop_last(self) -> bool:
        """The config's dataloader_drop_last: whether DeepSpeed's loader drops a short last batch."""
        return self.config.dataloader_drop_last

    @property
    def global_samples(self) -> int:
        """Samples consumed by the steps taken so far (DeepSpeed's counter): the
        global batch per step; 0 when no batch size is configured."""
        return self.global_steps * (self.train_batch_size() or 0)

    @property
    def local_rank(self) -> int:
        """The launcher's LOCAL_RANK (0 without one); scripts move batches with it."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        """This process's rank in the job (0 alone)."""
        return self.pg.rank

    @property
    def world_size(self) -> int:
        """The job's ranks (1 alone)."""
        return self.pg.world_size

    def fp16_enabled(self) -> bool:
        """Whether the model computes in fp16 (the config's fp16.enabled)."""
        return self.compute_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        """Whether the model computes in bf16 (the config's bf16.enabled)."""
        return self.compute_dtype == torch.bfloat16

    def get_lr(self) -> list[float]:
        """Each parameter group's learning rate now."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The 2-norm of the gradients the last update applied, before clipping; None before
        the first (Note [global gradient norm])."""
        self._settle_grad_norm()
        return self._global_grad_norm

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Overrides whether the next engine.step() applies the update (and whether the next
        backward may overlap it); None goes back to counting micro-steps. As DeepSpeed, set it
        before each forward/backward of the window; the loss is still divided by
        gradient_accumulation_steps."""
        self._boundary = None if is_boundary is None else bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next engine.step() applies the update."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def was_step_applied(self) -> bool:
        """Whether the last engine.step() updated the parameters (False inside an accumulation
        window and after an fp16 overflow skip)."""
        return self._step_applied

    def zero_grad(self) -> None:
        """Forgets the gradients accumulated since the last update (DeepSpeed sets each
        param.grad to None, which here clears the gradient partitions)."""
        self._check_open()
        self.optimizer.zero_grad()

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The consolidated weights in the compute dtype (DeepSpeed's "16-bit": fp32 when training
        in fp32), as the model's state_dict keys, written by rank 0; returns True.

        A name ending in .safetensors is streamed one tensor at a time (a model larger than
        RAM is fine; tied weights once, under their first name). Any other name is DeepSpeed's
        torch.save of the state dict, which holds it all in memory: refused when it does not
        fit. Unlike DeepSpeed, stage3_gather_16bit_weights_on_model_save=false does not skip
        the save (its weights would be empty there; here reading them is what the engine does).
        A collective with several ranks: every rank calls it."""
        from offload.checkpoint_io.pretrained import save_state_dict

        self._check_open()
        path = os.path.join(os.fspath(save_dir), save_filename)
        save_state_dict(self, path, dtype=self.compute_dtype, exclude_frozen=exclude_frozen_parameters,
                        streamed=save_filename.endswith(".safetensors"))
        return True

    # ---- pieces of Engine's own methods --------------------------------------
    def _record_grad_norm(self, clipped_norm: float | None) -> None:
        """At each update: the clipping's norm, else the one the optimizer summed (Note [global gradient norm])."""
        if clipped_norm is None and self.pg.world_size == 1 and not self._grad_norm_pending:
            # Summed when asked for, or before the next update starts: the updates may
            # go on under the next forward, and a device sum read now would wait for
            # the device (no collective: one rank).
            self._grad_norm_pending = True
            return
        if clipped_norm is None:
            self.optimizer.deferred.settle()  # the sum is complete once every update ran
            dtype = torch.float64 if self.device.type == "cpu" else torch.float32
            sq = self.optimizer.grad_sq  # a device tensor where device-state updates added to it
            sq = (sq.reshape(1).to(self.device, dtype) if isinstance(sq, torch.Tensor)
                  else torch.tensor([sq], dtype=dtype, device=self.device))
            clipped_norm = math.sqrt(float(self.pg.sum_scalar(sq).item()))
        self._global_grad_norm = clipped_norm
        self.optimizer.grad_sq = 0.0

    def _settle_grad_norm(self) -> None:
        """The last update's norm, where it was left to sum once its updates ran."""
        if self._grad_norm_pending:
            self.optimizer.deferred.settle()
            self._record_grad_norm(None)
            self._grad_norm_pending = False

    def _where_to_load(self, load_dir, tag, load_module_strict, custom_load_fn):
        """load_checkpoint's refusals, then (root, tag) to load; None where nothing was ever
        saved there (DeepSpeed's (None, None)). load_dir may be the root (with or without
        tag) or a tag's directory itself; a path that is not a directory, or that does not
        exist, is refused: a run asked to resume never silently starts over."""
        from offload.checkpoint_io.manifest import LATEST, MANIFEST, CheckpointError

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
