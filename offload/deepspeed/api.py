"""DeepSpeed's module functions: its initialize (keywords, 4-tuple), add_config_arguments
and init_distributed (offload/deepspeed/__init__.py says what the surface is).
What is honoured and what is refused, with the reasons: docs/CONFIG.md,
"DeepSpeed drop-in".
"""
from __future__ import annotations

import argparse
import logging
import os

import torch

import offload.device
from offload.deepspeed.engine import DeepSpeedEngine
from offload.engine.create import create_engine
from offload.optim.param_groups import torch_param_groups
from offload.config import Config

log = logging.getLogger("offload")

# DeepSpeed's initialize(), in its positional order (deepspeed/__init__.py, 0.19.8).
_DS_ORDER = ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
             "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
             "config_params")


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


def initialize(*positional, **kw):
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
    engine = DeepSpeedEngine(create_engine(model, config, param_groups=groups))
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
                         "args.deepspeed_config (--deepspeed_config, offload.deepspeed.add_config_arguments)")
    return config


def _param_groups(model, model_parameters, optimizer, config):
    """(groups as {"params": [names], hyperparameters...} or None, config), from model_parameters
    or a torch Adam/AdamW's groups (Note [parameter groups] in offload/optim/sharded_adam.py)."""
    if optimizer is not None:
        config = _adopt_optimizer(optimizer, config)
        # Its groups, as DeepSpeed steps a client optimizer over its own (model_parameters unused).
        keep = ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
        model_parameters = [{k: v for k, v in g.items() if k in keep} for g in optimizer.param_groups]
    return torch_param_groups(model, model_parameters), config


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
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=engine.pg.job_size, rank=engine.pg.job_rank)
    return torch.utils.data.DataLoader(dataset, batch_size=mb, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=engine.dataloader_drop_last(),
                                       pin_memory=torch.cuda.is_available())
