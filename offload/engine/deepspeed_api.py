"""DeepSpeed's calling conventions on the engine: a script written for DeepSpeed runs
with only its import changed (`import offload as deepspeed`).

    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset)

Here: the keyword form of `initialize` (returning DeepSpeed's 4-tuple),
`add_config_arguments`, `init_distributed`, and the DeepSpeedEngine methods
scripts, Trainer and Accelerate call (`DeepSpeedMethods`, a base of Engine).
What is honoured and what is refused, with the reasons: docs/CONFIG.md,
"DeepSpeed drop-in".

Note [global gradient norm]
get_global_grad_norm() is the 2-norm over every gradient the last update
applied, before clipping (torch.nn.utils.clip_grad_norm_'s return value).
With clipping on it is the clipping's own norm. With clipping off it is
summed in ShardedAdam.update_shard from each shard's gradient as its update
applies it (on the host worker when updates overlap backward, where no
later point still has the gradients), then summed over ranks when the step
completes. The Adam kernel takes each block's squares right after its
update read the block (offload.ops.adam_step(sum_grad_squares=True)), from
cache: a second pass over the gradient, as this once was, read it from
memory again, 23% of the update's own time (16M elements, one core), on the
host worker's path that bounds backward beside a GPU. The sum is the
kernel's, in its own order (fp32 lanes, double across blocks): equal to
torch.linalg.vector_norm's to fp32 rounding, not bit for bit. The torch
fallback (no extension) and device-tier state take a separate pass.
With device-tier optimizer state each shard's norm syncs the device once.
"""
from __future__ import annotations

import argparse
import logging
import math
import os

import torch

import offload.device

log = logging.getLogger("offload")

# DeepSpeed's initialize(), in its positional order (deepspeed/__init__.py, 0.19.8).
_DS_ORDER = ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
             "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
             "config_params")


class DeepSpeedMethods:
    """DeepSpeedEngine's methods, on Engine; their names and return values are DeepSpeed's."""

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        """train_batch_size, or micro batch * accumulation * world size when only the micro batch is given."""
        if self.config.train_batch_size is not None:
            return self.config.train_batch_size
        mb = self.config.train_micro_batch_size_per_gpu
        return None if mb is None else mb * self.gradient_accumulation_steps() * self.pg.world_size

    def dataloader_drop_last(self) -> bool:
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
        return self.pg.rank

    @property
    def world_size(self) -> int:
        return self.pg.world_size

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def get_lr(self) -> list[float]:
        """Each parameter group's learning rate now."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The 2-norm of the gradients the last update applied, before clipping; None before
        the first (Note [global gradient norm])."""
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
        if clipped_norm is None:
            self.optimizer.deferred.settle()  # the sum is complete once every update ran
            dtype = torch.float64 if self.device.type == "cpu" else torch.float32
            sq = torch.tensor([self.optimizer.grad_sq], dtype=dtype, device=self.device)
            clipped_norm = math.sqrt(float(self.pg.sum_scalar(sq).item()))
        self._global_grad_norm = clipped_norm
        self.optimizer.grad_sq = 0.0

    def _nothing_to_load(self, load_dir, tag, load_module_strict, custom_load_fn) -> bool:
        """load_checkpoint's refusals, and DeepSpeed's (None, None) where nothing was ever saved."""
        from offload.checkpoint_io.manifest import LATEST, MANIFEST

        if not load_module_strict:
            raise ValueError("load_checkpoint(load_module_strict=False) is not supported: the checkpoint is "
                             "verified against the whole model (every name and shape) before anything loads")
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported: offload's checkpoint "
                             "layout is its own (offload/checkpoint_io); read it with offload.consolidate")
        if tag is not None:
            return False
        # No `latest` and no complete tag: a fresh start. A tag without `latest` is damage: an error, later.
        nothing = not os.path.isdir(load_dir) or (not os.path.exists(os.path.join(load_dir, LATEST)) and not any(
            os.path.isfile(os.path.join(load_dir, d, MANIFEST)) for d in os.listdir(load_dir)))
        if nothing:
            log.warning("load_checkpoint: no checkpoint was completed in %s; nothing loaded", load_dir)
        return nothing


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's --deepspeed, --deepspeed_config (and the deprecated --deepscale*) arguments."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for user code; no effect on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config")
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout=None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config=None, rank: int = -1, world_size: int = -1) -> None:
    """torch.distributed's default group, from a launcher's environment (torchrun, or
    DeepSpeed's launcher: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). With none and
    dist_init_required not True, nothing: one process needs no group here (DeepSpeed makes
    a one-process group). MPI discovery (no launcher environment, under mpirun) is refused."""
    import torch.distributed as dist

    if dist.is_initialized() or dist_init_required is False:
        return
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if not launched and rank < 0:
        if "OMPI_COMM_WORLD_SIZE" in os.environ and int(os.environ["OMPI_COMM_WORLD_SIZE"]) > 1:
            raise RuntimeError("offload does not discover ranks through MPI: launch with torchrun (or "
                               "DeepSpeed's launcher), which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
        if not dist_init_required:
            return
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        rank, world_size = 0, 1
    backend = dist_backend or offload.device.collective_backend()  # Note [one device choice]
    kwargs = {"backend": backend, "init_method": init_method}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank >= 0:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)
    if verbose:
        log.info("initialized torch.distributed: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(),
                 backend)


def initialize_deepspeed(*positional, **kw):
    """DeepSpeed's initialize(args=None, model=None, optimizer=None, model_parameters=None,
    training_data=None, lr_scheduler=None, distributed_port=29500, mpu=None,
    dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
    config_params=None) -> (engine, engine.optimizer, training dataloader or None,
    lr scheduler or None). See docs/CONFIG.md, "DeepSpeed drop-in"."""
    if len(positional) > len(_DS_ORDER):
        raise TypeError(f"initialize() takes at most {len(_DS_ORDER)} positional arguments in DeepSpeed's form")
    for name, value in zip(_DS_ORDER, positional):
        if name in kw:
            raise TypeError(f"initialize() got multiple values for argument {name!r}")
        kw[name] = value
    unknown = set(kw) - set(_DS_ORDER)
    if unknown:
        raise TypeError(f"initialize() got unexpected keyword arguments {sorted(unknown)} "
                        f"(DeepSpeed's form takes {', '.join(_DS_ORDER)})")
    a = {name: kw.get(name) for name in _DS_ORDER}
    model = a["model"]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize requires model= a torch.nn.Module, got {type(model).__name__}")
    if a["mpu"] is not None:
        raise ValueError("initialize(mpu=...): model parallelism is not supported; offload is data parallel "
                         "only (every rank holds a 1/world partition of every parameter)")
    if a["mesh_param"] is not None:
        raise ValueError("initialize(mesh_param=...): device meshes (sequence parallelism) are not supported")
    init_distributed(distributed_port=a["distributed_port"] or 29500, dist_init_required=a["dist_init_required"],
                     verbose=False)
    config = _config_source(a["args"], a["config"], a["config_params"])
    from offload.config import Config

    config = Config.load(config)
    groups, config = _param_groups(model, a["model_parameters"], a["optimizer"], config)
    scheduler_fn = a["lr_scheduler"]
    if scheduler_fn is not None:
        if isinstance(scheduler_fn, torch.optim.lr_scheduler.LRScheduler) or not callable(scheduler_fn):
            raise ValueError("initialize(lr_scheduler=...): a scheduler object is bound to the optimizer it was "
                             "made with, not the engine's; pass a callable, lr_scheduler=lambda opt: "
                             "torch.optim.lr_scheduler.LambdaLR(opt, ...), or use the config's 'scheduler'")
        if config.scheduler is not None:
            raise ValueError("initialize(lr_scheduler=...) and the config's 'scheduler' section both give a "
                             "schedule; keep one")
    from offload.engine.engine import _initialize

    engine = _initialize(model, config, param_groups=groups)
    if hasattr(a["args"], "local_rank"):
        a["args"].local_rank = engine.local_rank  # as DeepSpeed aligns it
    try:
        if scheduler_fn is not None:
            engine.lr_scheduler = scheduler_fn(engine.optimizer)
        loader = None
        if a["training_data"] is not None:
            loader = training_dataloader(engine, a["training_data"], a["collate_fn"])
    except BaseException:
        engine.close()
        raise
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config_source(args, config, config_params):
    """DeepSpeed's rules: config, else config_params; or args.deepspeed_config (args.deepscale_config,
    deprecated) — but not both."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is None:
        from_args = getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("initialize: a config both in args.deepspeed_config and as config=; give one")
        config = from_args
    if config is None:
        raise ValueError("initialize needs a config: config= (a dict or a JSON path), or "
                         "args.deepspeed_config (--deepspeed_config, offload.add_config_arguments)")
    return config


def _param_groups(model, model_parameters, optimizer, config):
    """(groups as {"params": [names], hyperparameters...} or None, config), from model_parameters
    or a torch Adam/AdamW's groups (Note [parameter groups] in offload/optim/sharded_adam.py)."""
    if optimizer is not None:
        config = _adopt_optimizer(optimizer, config)
        # Its groups, as DeepSpeed steps a client optimizer over its own (model_parameters unused).
        keep = ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
        model_parameters = [{k: v for k, v in g.items() if k in keep} for g in optimizer.param_groups]
    if model_parameters is None:
        return None, config
    if isinstance(model_parameters, torch.nn.Module):
        raise TypeError("model_parameters: an iterable of parameters or of param-group dicts, not a module")
    entries = list(model_parameters)
    if not entries:
        raise ValueError("model_parameters is empty")
    if all(isinstance(e, dict) for e in entries):
        groups = entries
    elif any(isinstance(e, dict) for e in entries):
        raise TypeError("model_parameters mixes parameters and param-group dicts; give one kind")
    else:
        groups = [{"params": entries}]
    names = {id(p): n for n, p in model.named_parameters()}
    out, listed = [], set()
    for gi, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if params is None:
            raise TypeError(f"model_parameters group {gi}: a dict with a 'params' list")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) not in names:
                raise ValueError(f"model_parameters group {gi}: a tensor of shape {tuple(p.shape)} that is not "
                                 "a parameter of the model")
        listed.update(id(p) for p in params)
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in params]})
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in listed]
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ValueError(
            f"model_parameters leaves out {len(left)} trainable parameter(s): {shown}. DeepSpeed would compute "
            "their gradients and never apply them; set requires_grad=False on them for the same training "
            "without the wasted gradients, or list them")
    return out, config


def _adopt_optimizer(optimizer, config):
    """A torch.optim.Adam/AdamW given with no optimizer section: its hyperparameters become the
    section (its groups become the engine's). Anything else is refused."""
    import dataclasses

    from offload.config.sections import OptimizerConfig

    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("initialize(optimizer=<callable>): the engine builds its own optimizer (ShardedAdam: "
                         "Adam state partitioned over device, host and NVMe); give its settings in the "
                         "config's 'optimizer' section")
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(f"initialize(optimizer={type(optimizer).__name__}): only the engine's own Adam/AdamW "
                         "runs here; give the settings in the config's 'optimizer' section")
    if config.optimizer is not None:
        raise ValueError("initialize: both optimizer= and the config's 'optimizer' section give an optimizer; "
                         "keep one")
    if optimizer.state:
        raise ValueError("initialize(optimizer=...): the optimizer has already stepped; its state would be lost")
    d = optimizer.defaults
    decoupled = type(optimizer) is torch.optim.AdamW or bool(d.get("decoupled_weight_decay"))
    section = OptimizerConfig(type="AdamW" if decoupled else "Adam", lr=float(d["lr"]), betas=tuple(d["betas"]),
                              eps=d["eps"], weight_decay=d["weight_decay"], adam_w_mode=decoupled)
    return dataclasses.replace(config, optimizer=section)


def training_dataloader(engine, dataset, collate_fn=None) -> torch.utils.data.DataLoader:
    """DeepSpeed's deepspeed_io for training: batches of train_micro_batch_size_per_gpu,
    sampled by a DistributedSampler over the data-parallel ranks (shuffled, seed 0, no
    set_epoch: the same order each epoch, as DeepSpeed's loader), a short last batch
    kept unless the config's dataloader_drop_last is true. Not
    DeepSpeed's 2 worker processes per device: the order is the same without them."""
    if not isinstance(dataset, torch.utils.data.Dataset):
        raise ValueError("training_data must be a torch Dataset")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError("training_data: an IterableDataset cannot be sampled across ranks; build your own "
                         "DataLoader")
    mb = engine.train_micro_batch_size_per_gpu()
    if mb is None:
        raise ValueError("training_data needs train_micro_batch_size_per_gpu (or train_batch_size) in the config")
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=engine.pg.world_size, rank=engine.pg.rank)
    return torch.utils.data.DataLoader(dataset, batch_size=mb, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=engine.dataloader_drop_last(),
                                       pin_memory=torch.cuda.is_available())
