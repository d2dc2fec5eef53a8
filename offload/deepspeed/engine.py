"""DeepSpeedEngine: DeepSpeed's engine object, an adapter around offload's Engine.

Everything the Engine does (forward, backward, step, checkpoints, the gradient
accumulation boundary, the global norm, close) is the Engine's own, reached
through the adapter; the methods below are DeepSpeed's alone, their names and
return values DeepSpeed's, for scripts, Trainer and Accelerate written for it.
"""
from __future__ import annotations

import os

import torch

from offload.engine.closed import closed_error
from offload.engine.engine import Engine


class DeepSpeedEngine:
    """What `offload.deepspeed.initialize` returns first: the Engine (`.engine`), with
    DeepSpeedEngine's own methods besides its own."""

    def __init__(self, engine: Engine):
        object.__setattr__(self, "engine", engine)

    # ---- the Engine's own, through the adapter ----------------------------------
    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "engine"), name)

    def __setattr__(self, name, value):  # model_engine.global_steps = ..., .lr_scheduler = ...
        setattr(self.engine, name, value)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """model(*args, **kwargs), as engine(...)."""
        return self.engine(*args, **kwargs)

    def __enter__(self) -> "DeepSpeedEngine":
        self.engine.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.__exit__(*exc)

    def __repr__(self) -> str:
        return f"DeepSpeedEngine({self.engine!r})"

    # ---- DeepSpeed's alone ----------------------------------------------------------
    def _open(self, name: str) -> Engine:
        """The engine, or, once it is closed, the error its own methods raise (Note [a closed
        engine] in engine/closed.py)."""
        engine = self.engine
        if engine._closed:
            raise closed_error(engine, name)
        return engine

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """The config's micro batch per rank; None where it is not set."""
        return self._open("train_micro_batch_size_per_gpu").config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        """train_batch_size, or micro batch * accumulation * world size when only the micro batch is given."""
        engine = self._open("train_batch_size")
        config = engine.config
        if config.train_batch_size is not None:
            return config.train_batch_size
        mb = config.train_micro_batch_size_per_gpu
        return None if mb is None else mb * engine.gradient_accumulation_steps() * engine.pg.job_size

    def dataloader_drop_last(self) -> bool:
        """The config's dataloader_drop_last: whether DeepSpeed's loader drops a short last batch."""
        return self._open("dataloader_drop_last").config.dataloader_drop_last

    @property
    def global_samples(self) -> int:
        """Samples consumed by the steps taken so far (DeepSpeed's counter): the
        global batch per step; 0 when no batch size is configured."""
        return self._open("global_samples").global_steps * (self.train_batch_size() or 0)

    @property
    def local_rank(self) -> int:
        """The launcher's LOCAL_RANK (0 without one); scripts move batches with it."""
        self._open("local_rank")
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        """This process's rank in the job (0 alone)."""
        return self._open("global_rank").pg.job_rank

    @property
    def world_size(self) -> int:
        """The job's ranks (1 alone)."""
        return self._open("world_size").pg.job_size

    def fp16_enabled(self) -> bool:
        """Whether the model computes in fp16 (the config's fp16.enabled)."""
        return self._open("fp16_enabled").compute_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        """Whether the model computes in bf16 (the config's bf16.enabled)."""
        return self._open("bfloat16_enabled").compute_dtype == torch.bfloat16

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

        engine = self._open("save_16bit_model")
        path = os.path.join(os.fspath(save_dir), save_filename)
        save_state_dict(engine.checkpoint_view(), path, dtype=engine.compute_dtype,
                        exclude_frozen=exclude_frozen_parameters, streamed=save_filename.endswith(".safetensors"))
        return True
