"""The Engine: a user's model, its parameters spread over device, host and NVMe.

Built here (the shards, the optimizer, the manager, at initialize), and composed
of objects that each own their state: the step runner (offload/step/runner.py,
where one step's flow is described), the checkpoints (engine/checkpoints.py),
the manager's hooks (engine/hooks.py); what close gives back is
engine/teardown.py. DeepSpeed's own methods are an adapter around it
(offload/deepspeed/engine.py). See docs/ARCHITECTURE.md for the whole picture.
"""
from __future__ import annotations

import logging
import psutil
import torch

import offload.device
from offload.activations import ActivationCheckpointing
from offload.activations.plan import plan_budget
from offload.aio.run_dir import RunDirectories
from offload.config import Config
from offload.engine.build import build_shards
from offload.checkpoint_io.view import CheckpointView
from offload.engine import teardown
from offload.engine.checkpoints import EngineCheckpoints
from offload.engine.closed import EngineClosedError, close_off
from offload.engine.hooks import EngineHooks
from offload.engine.unfreeze import unfreeze_if_asked
from offload.compile.blocks import (blocks_to_compile, compile_blocks, compile_forwards, gathered_at_once,
                                        prefetch_by_blocks, uncompile_blocks)
from offload.step.loss_scaler import LossScaler
from offload.step.runner import StepRunner
from offload.step.update_policy import UpdatePolicy
from offload.process_memory import ProcessMemory, map_large_allocations, release_free_host_memory
from offload.host_worker import HostWorker
from offload.node import bind_kernel_threads, node_share
from offload.engine.make_optimizer import make_optimizer
from offload.schedulers import build_scheduler
from offload.accounting import MemoryAccount
from offload.transfers.layout import make_layout
from offload.partition.managed import manage, refuse_state_dict_larger_than_memory
from offload.partition.manager import ParameterManager
from offload.partition.prefetch import prefetch_scheduler
from offload.partition.shard_context import ShardContext
from offload.placement import Placement
from offload.tiers import Tier
from offload.timeline import Timeline
from offload.checkpoint_io.pretrained import save_pretrained

log = logging.getLogger("offload")


class Engine:
    """A model trained with its parameters, gradients and optimizer state spread over
    device, host and NVMe; `offload.initialize(model, config)` makes one. Call it as
    the model, then backward(loss) and step() (or drive engine.optimizer from your own
    loop); save_checkpoint / load_checkpoint / save_pretrained; close() gives the
    model its values back."""

    compiled_blocks: tuple = ()  # Note [compiled blocks] in compile/blocks.py

    def __init__(self, model: torch.nn.Module, config: Config, *, builder=None, weights=None,
                 param_groups: list[dict] | None = None):
        """builder: the offload.init ModelBuilder the model was built in (its shards
        are adopted); weights: values for the parameters (offload/engine/weights.py);
        param_groups: the optimizer's groups, each {"params": [parameter names], "lr": ...}
        (Note [parameter groups] in offload/optim/sharded_adam.py); None: one group."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if config.optimizer is None:
            raise ValueError("config has no 'optimizer' section: offload needs one "
                             "(for example {'type': 'AdamW', 'params': {'lr': 1e-4}})")
        # Before anything is allocated: the OS view's baseline (Note [engine bytes and the OS]).
        self._process_memory = ProcessMemory.at_start(model)
        self.config = config
        self.module = model
        # The shard and replica groups (Note [hybrid sharding]): a model built under
        # offload.init brings the builder's.
        self.pg = builder.ctx.pg if builder is not None else make_layout(config.zero_optimization.group_size)
        # Every copy between host and a separate device goes through this layer
        # (Note [device layer] in offload/device/layer.py): OFFLOAD_DEVICE picks it,
        # once per run: a model built under offload.init brings the builder's
        # (Note [one device choice] in offload/device/__init__.py).
        self.device_layer = builder.ctx.layer if builder is not None else offload.device.from_env()
        self.device = self.device_layer.device
        self.compute_dtype = config.precision.dtype
        if builder is not None:  # its shards already charge its account
            self.account = builder.account
        else:
            mem = config.memory
            self.account = MemoryAccount({Tier.DEVICE: mem.device_budget, Tier.HOST: mem.host_budget})
        self._run_dirs = RunDirectories()  # Note [run directories] in offload/aio/run_dir.py

        self._timeline = Timeline(enabled=True)
        self._builder, self._weights, self._param_groups = builder, weights, param_groups
        # What every shard shares: made once, complete, by build_shards.
        self.shard_context: ShardContext | None = None
        self.shards, self._stores, self.manager, self.optimizer = [], [], None, None
        self._host_worker = None
        self._placed = []
        self.paged_modules = []  # (quantized layer, its own class): filled by build_shards
        self.activation_checkpointing = None
        self.step_runner: StepRunner | None = None
        self.checkpoints = EngineCheckpoints(self)
        self._closed = False
        try:
            self._build(model, config)
        except BaseException:
            # Ctrl-C or an error part way: leave no swap files and no hooks
            # behind, and give the model its values back where we can.
            teardown.abort(self)
            raise
        release_free_host_memory()  # the build's temporaries (Note [engine bytes and the OS])
        if self._placement.uses(Tier.NVME):
            map_large_allocations()  # host memory is what an NVMe run is short of

    def _build(self, model: torch.nn.Module, config: Config) -> None:
        # First, so a class name missing from the model fails before anything moves.
        # Note [the node's share] (offload/node.py): this rank's cores and pinned memory, among its
        # host's ranks (asked of every rank: a collective, made by all in the same place).
        self.node = node_share(self.pg)

        self.activation_checkpointing = ActivationCheckpointing(
            model, config.activation_checkpointing, self.account, self.device,
            plan_budget=plan_budget(self.device_layer, config), local_ranks=self.node.local_ranks)
        blocks, forwards = [], []  # Note [compiled blocks]: checked here, put in place once managed
        if config.compile.at_initialize:
            blocks = blocks_to_compile(model, config.compile.modules or None)
            forwards = compile_forwards(blocks, **config.compile.compile_kwargs())
        built = build_shards(model, config, layer=self.device_layer, pg=self.pg, account=self.account,
                             timeline=self._timeline, run_dirs=self._run_dirs,
                             builder=self._builder, weights=self._weights, compiled=blocks,
                             paged=self.paged_modules)
        self._builder = self._weights = None
        self.shard_context = built.ctx
        self.shards = built.shards
        self._placement = built.placement
        log.info("%s; %s", built.placement.summary(), self.node.describe())
        self._stores = built.stores()
        self._placed = built.placed  # filled as built.place() moves them (Note [an interrupted initialize])
        # Weak: no cycle through the engine (Note [a closed engine] in engine/closed.py).
        # Note [the host worker] (offload/host_worker.py): gradients taken in and updates run there.
        self._host_worker = HostWorker()
        hooks = EngineHooks(self)  # the manager's StepHooks and the optimizer's UpdateDriver
        self.manager = ParameterManager(model, self.shards, hooks,
                                        host_worker=self._host_worker,
                                        prefetch=prefetch_scheduler(config.zero_optimization, self.shards,
                                                                    device_budget=config.memory.device_budget,
                                                                    unit=gathered_at_once(blocks, self.shards)),
                                        timeline=self._timeline,
                                        reduce_bucket_elems=config.zero_optimization.reduce_bucket_size)
        self.activation_checkpointing.attach(self.manager)

        bind_kernel_threads(self.node, self._host_worker)
        # Note [when updates run] (step/update_policy.py): the same answers the budgets had.
        policy = UpdatePolicy.of(config, separate_memory=self.device_layer.separate_memory)
        self.optimizer = make_optimizer(config, self.shards, built, policy, device_layer=self.device_layer,
                                        account=self.account, timeline=self._timeline, node=self.node,
                                        host_worker=self._host_worker, param_groups=self._param_groups,
                                        driver=hooks)  # optimizer.step(): the whole update
        built.place(self.optimizer.init_state)  # the parameters move home here, one at a time
        # Reads outside a forward see real values, edits go through offload.gathered
        # (Note [reading a parameter outside the engine] in partition/managed.py).
        manage(self.manager, self.shards)
        if blocks:
            self.compiled_blocks = tuple(compile_blocks(self.manager, blocks, forwards))
        lr_scheduler = None if config.scheduler is None else build_scheduler(self.optimizer, config.scheduler)
        # The step's one owner (offload/step/runner.py): its phase, counters, norm, schedule.
        self.step_runner = StepRunner(
            config=config, shards=self.shards, pg=self.pg, device=self.device, account=self.account,
            timeline=self._timeline, manager=self.manager, optimizer=self.optimizer, policy=policy,
            stores=self._stores, uses_nvme=built.placement.uses(Tier.NVME), loss_scaler=LossScaler.of(config),
            lr_scheduler=lr_scheduler, before_update=self.checkpoints.before_update,
            host_worker=self._host_worker)
        # Fingerprints of the frozen partitions (Note [checkpoints without frozen weights] in
        # checkpoint_io/frozen.py), computed at the first save or load that needs them.
        self.frozen_fingerprints: dict[str, dict] = {}
        self._state_dict_guard = refuse_state_dict_larger_than_memory(model, self.shards)

    # DeepSpeed's attributes, read and set by scripts: the step runner's (Note [step counters]);
    # the counters answer after close too (engine/closed.py: ANSWERED_AFTER_CLOSE).
    global_steps = property(lambda self: self.__dict__["step_runner"].counters.global_steps,
                            lambda self, v: setattr(self.step_runner.counters, "global_steps", v),
                            doc="Optimizer steps taken (skipped fp16 overflow steps included), as DeepSpeed counts.")
    micro_steps = property(lambda self: self.__dict__["step_runner"].counters.micro_steps,
                           lambda self, v: setattr(self.step_runner.counters, "micro_steps", v),
                           doc="Micro-batches through backward so far.")
    skipped_steps = property(lambda self: self.__dict__["step_runner"].counters.skipped_steps,
                             lambda self, v: setattr(self.step_runner.counters, "skipped_steps", v),
                             doc="Steps skipped for an fp16 overflow (the loss scale lowered instead).")
    lr_scheduler = property(lambda self: self.step_runner.lr_scheduler,
                            lambda self, v: setattr(self.step_runner, "lr_scheduler", v),
                            doc="The LR schedule stepped after each update (the config's, or DeepSpeed's "
                                "initialize(lr_scheduler=...)); None without one.")
    loss_scaler = property(lambda self: self.step_runner.loss_scaler,
                           doc="fp16's dynamic (or static) loss scaler; None in fp32 and bf16.")

    # ---- the training loop -------------------------------------------------
    def __call__(self, *args, **kwargs):
        """model(*args, **kwargs), timed: the model's own hooks gather its parameters
        (Note [the model is the interface] in partition/manager.py)."""
        self._check_open()
        with self._timeline.span("forward"):
            return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of a scalar loss, scaled by 1 / gradient_accumulation_steps (and the fp16
        loss scale); at the window's last micro-batch the optimizer update may start during
        it, and step() completes it. Returns the loss as given."""
        self._check_open()
        return self.step_runner.backward(loss)

    def step(self) -> None:
        """DeepSpeed's step: counts a micro-step; at the end of an accumulation window
        applies the update (as engine.optimizer.step()) and clears the gradients.
        After an update that raised, step() again (no new backward) retries it."""
        self._check_open()
        self.step_runner.step()

    @property
    def gradients_pending(self) -> bool:
        """Whether a backward since the last optimizer step left gradients not yet applied."""
        return self.step_runner.gradients_pending

    def _update(self) -> None:
        """The optimizer's driver: engine.step() at a boundary, and engine.optimizer.step()
        from a user's loop (Note [the optimizer users drive] in optim/sharded_adam.py)."""
        self._check_open()
        self.step_runner.update()

    def _forward_starts(self) -> None:
        """As a forward opens (the manager's hooks): unfreezing, the step's refusals, the activation plan."""
        self._check_open()
        unfreeze_if_asked(self)  # Note [unfreezing] (engine/unfreeze.py)
        self.step_runner.forward_starts()
        if self.activation_checkpointing.plan is not None:
            self.activation_checkpointing.plan.begin_forward(
                model_checkpoints=bool(getattr(self.module, "is_gradient_checkpointing", False)))

    def __iter__(self):
        raise TypeError("offload.initialize returns the Engine alone, not DeepSpeed's 4-tuple: "
                        "`engine = offload.initialize(model, config)`, or offload.deepspeed.initialize for "
                        "(engine, optimizer, dataloader, lr_scheduler)")

    # ---- the step's settings and figures (the step runner's) ----------------
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's gradient_accumulation_steps)."""
        return self.config.gradient_accumulation_steps

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

    def get_lr(self) -> list[float]:
        """Each parameter group's learning rate now."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The 2-norm of the gradients the last update applied, before clipping; None before
        the first (Note [global gradient norm] in step/grad_norm.py)."""
        norm = self.step_runner.grad_norm
        norm.settle()
        return norm.value

    def zero_grad(self) -> None:
        """Forgets the gradients accumulated since the last update (DeepSpeed sets each
        param.grad to None, which here clears the gradient partitions)."""
        self._check_open()
        self.optimizer.zero_grad()

    def compile(self, backend="inductor", compile_kwargs=None, schedule=None, modules=None) -> None:
        """DeepSpeed's engine.compile(), done block by block: each block's own forward
        compiled with torch.compile(backend=..., **compile_kwargs), its parameters gathered
        at its boundary (Note [compiled blocks] in compile/blocks.py). modules: the
        block classes' names; by default the class of the largest nn.ModuleList's children."""
        self._check_open()
        if schedule is not None:
            raise ValueError("compile(schedule=...) is DeepCompile's, DeepSpeed's own; offload compiles each "
                             "block instead: engine.compile(modules=[...])")
        if self.compiled_blocks:
            raise RuntimeError(f"compile: this engine's {len(self.compiled_blocks)} blocks are compiled already (by "
                               "the config's compile section, or an earlier engine.compile())")
        blocks = blocks_to_compile(self.module, modules)
        forwards = compile_forwards(blocks, backend=backend, **(compile_kwargs or {}))
        prefetch_by_blocks(self.manager, self.shards, self.config, self.account, self.compute_dtype.itemsize,
                           gathered_at_once(blocks, self.shards))
        self.compiled_blocks = tuple(compile_blocks(self.manager, blocks, forwards))

    @property
    def is_compiled(self) -> bool:
        """Whether the model's blocks are compiled (engine.compile() or the config's compile)."""
        return bool(self.compiled_blocks)

    # ---- checkpoints (engine/checkpoints.py; the work in offload/checkpoint_io) ----
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
        self._check_open()
        return self.checkpoints.save(save_dir, tag, client_state, save_latest, async_save,
                                     exclude_frozen_parameters)

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
        or a directory holding something else raises CheckpointError, naming it. The options:
        docs/CONFIG.md, "DeepSpeed drop-in".
        """
        self._check_open()
        return self.checkpoints.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                     load_lr_scheduler_states, load_module_only, custom_load_fn,
                                     use_config_hyperparameters)

    def wait_checkpoint(self) -> None:
        """Waits for an async save to be written and committed; raises its error, if any."""
        self.checkpoints.wait()

    def save_pretrained(self, save_dir, *, max_shard_size="5GB", dtype: torch.dtype | None = None,
                        master: bool = False):
        """The model in Hugging Face's layout (sharded safetensors, index, config), streamed one
        tensor at a time, so a model larger than RAM is saved too; `from_pretrained(save_dir)`
        loads it (Note [streamed pretrained save]). dtype: of floating tensors (default: as they
        are). master=True: the trained parameters' fp32 master weights (what a bf16 run's
        optimizer holds) instead of their compute-dtype copies; frozen parameters have no
        master and are written as they are held, in the compute dtype (Note [frozen
        parameters] in offload/placement.py). A collective with several ranks; rank 0 writes."""

        self._check_open()
        return save_pretrained(self.checkpoint_view(), save_dir, max_shard_size=max_shard_size, dtype=dtype,
                               master=master)

    def checkpoint_view(self) -> CheckpointView:
        """What checkpoints read of this engine (offload/checkpoint_io/view.py)."""
        return CheckpointView(module=self.module, config=self.config, shards=self.shards, optimizer=self.optimizer,
                              step=self.step_runner, manager=self.manager, pg=self.pg,
                              compute_dtype=self.compute_dtype, swap_stores=self.swap_stores,
                              param_group_names=self._param_groups, frozen_fingerprints=self.frozen_fingerprints,
                              full_value=self.full_value)

    def train(self, mode: bool = True) -> "Engine":
        """The model's train(mode), as nn.Module.train: dropout and the like on (or off)."""
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        """The model's eval(): train(False)."""
        return self.train(False)

    # ---- full values -------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, master: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter's full value on the host, by its first qualified name.

        master=True gives the fp32 master weights, else the compute-dtype copy.
        A collective with several ranks: every rank must call it.
        """
        return {shard.name: self.full_value(shard, master) for shard in self.shards}

    def full_value(self, shard, master: bool = False) -> torch.Tensor:
        """One parameter's full value on the host: the fp32 master (master=True) or
        the compute-dtype copy. A collective with several ranks."""
        part = self.optimizer.master_partition(shard) if master else shard.home_partition()
        full = torch.empty(shard.padded_numel, dtype=part.dtype, device=part.device)
        self.pg.all_gather(full, part)
        return full[:shard.numel].view(shard.shape).cpu()

    # ---- reporting and lifetime ---------------------------------------------
    def timeline(self) -> dict:
        """The last complete step's time per kind (forward, backward, read, write,
        optimizer, wait) and its spans: Note [timeline] in offload/timeline.py."""
        return self._timeline.last_step()

    def export_chrome_trace(self, path) -> None:
        """Writes the last complete step as a Chrome trace (chrome://tracing, Perfetto)."""
        self._timeline.export_chrome_trace(path)

    @property
    def swap_stores(self) -> tuple:
        """The NVMe swap stores (offload.aio.SwapStore), each once: `store.io.config` is
        the `aio` config its transfers run with (Note [one store per thread] in engine/stores.py)."""
        return tuple(self._stores)

    def placement(self) -> Placement:
        """Each parameter's home and optimizer state tier, bytes per tier and per step
        per link: the auto plan or the config's tiers (Note [automatic placement])."""
        return self._placement

    def memory_report(self) -> dict:
        """Bytes per tier the engine holds (now, peak, budget), under "pinned" its
        page-locked host bytes (now, peak, memory.pinned_budget; part of "host"),
        the process RSS, and under "os" the OS's figures beside the engine's
        (ProcessMemory.report)."""
        report = self.account.report()
        report["process_rss"] = psutil.Process().memory_info().rss
        report["os"] = self._process_memory.report(self.account, self.device)
        return report

    def activation_report(self) -> dict:
        """Saved-activation bytes on the device tier now, and with activation_checkpointing.profile
        the time spent in checkpointed forwards and recomputations; under "plan", what the
        activation plan chose at the last forward and why (Note [activations in the plan])."""
        checkpointing = self.activation_checkpointing
        saver = checkpointing.saver
        return {"device_bytes": saver.device_bytes(), "checkpointed_modules": checkpointing.wrapped,
                "plan": None if checkpointing.plan is None else checkpointing.plan.report(),
                **(saver.timings if saver.profile else {})}

    def close(self) -> None:
        """Removes hooks and the swap files this engine created, gives the parameters
        their values back when they fit in memory (save before closing otherwise),
        releases the process group; afterwards every public method raises
        EngineClosedError (Note [a closed engine] in engine/closed.py). Idempotent."""
        if self._closed:
            return
        try:
            self.wait_checkpoint()  # it may still be copying swap files
            self.step_runner.finish_updates()
        finally:
            self._closed = True
            self.manager.release_all()
            given_back = teardown.give_values_back(self)  # before the optimizer and the files go
            if not given_back:
                self.manager.closed = True  # reads of its parameters now raise, naming why
            self.optimizer.close()
            self._host_worker.shutdown()
            self._state_dict_guard.remove()
            if self.shard_context is not None and self.shard_context.gathered_buffers is not None:
                self.shard_context.gathered_buffers.clear()
            self.manager.remove_hooks()
            self.activation_checkpointing.remove()
            uncompile_blocks(self.compiled_blocks)  # Note [compiled blocks]
            teardown.remove_swap_files(self)
            self.pg.release()  # Note [releasing the process group] in transfers/collectives.py
            teardown.close_device(self)
            self.account.drop_callbacks()
            reason = ("the model's parameters hold their values (engine.module)" if given_back else
                      "the parameters did not fit in memory and were not given back: save before closing "
                      "(engine.save_checkpoint, engine.save_pretrained)")
            close_off(self.optimizer, "engine.optimizer", reason)
            close_off(self, "engine", reason)

    def _on_edit(self, shard, master) -> None:
        """A parameter edited outside training (offload.gathered): its master takes the value."""
        self.frozen_fingerprints.pop(str(shard.index), None)
        self.optimizer.set_master(shard, master)

    def _check_open(self) -> None:
        if self._closed:  # engine.optimizer.step() reaches _update through its driver
            raise EngineClosedError("this engine was closed (engine.close())")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
