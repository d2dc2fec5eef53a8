"""DeepSpeedEngine's methods on Engine (a base of it): their names and return
values are DeepSpeed's, for scripts, Trainer and Accelerate written for it
(the module functions of DeepSpeed's API: offload/engine/deepspeed_api.py).

The global gradient norm they report: Note [global gradient norm] in
offload/step/grad_norm.py; the step's state is the step runner's
(offload/step/runner.py), read here through Engine.step_runner.
"""
from __future__ import annotations

import os

import torch


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
        norm = self.step_runner.grad_norm
        norm.settle()
        return norm.value

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Overrides whether the next engine.step() applies the update (and whether the next
        backward may overlap it); None goes back to counting micro-steps. As DeepSpeed, set it
        before each forward/backward of the window; the loss is still divided by
        gradient_accumulation_steps."""
        self.step_runner.boundary = None if is_boundary is None else bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next engine.step() applies the update."""
        return self.step_runner.is_boundary()

    def was_step_applied(self) -> bool:
        """Whether the last engine.step() updated the parameters (False inside an accumulation
        window and after an fp16 overflow skip)."""
        return self.step_runner.step_applied

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
        save_state_dict(self.checkpoint_view(), path, dtype=self.compute_dtype,
                        exclude_frozen=exclude_frozen_parameters, streamed=save_filename.endswith(".safetensors"))
        return True
