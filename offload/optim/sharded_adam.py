"""Adam/AdamW over the engine's parameter partitions, with state on any tier.

Note [optimizer state tiers]
Each shard's optimizer state is an fp32 master partition and two fp32
moments, kept on the tier `offload_optimizer.device` names:
  DEVICE  tensors on the device; updated with torch's fused Adam
  HOST    host tensors; updated with the native fused kernel (offload.ops)
  NVME    one file per shard holding [master | exp_avg | exp_avg_sq], or only
          [exp_avg | exp_avg_sq] when the parameter's own file is the master
          (Note [shared fp32 master] in optim/states.py); the step streams them: reads of the
          next shards are in flight while one is updated, writes are asynchronous
After a shard's update its compute-dtype copy is refreshed at the parameter's
home (see Note [shard layout] in offload/partition/shard.py): the fused
kernel writes the rounded value straight into a host home; a device home
receives the new partition by all-gather; an NVMe home gets a file write.

Note [device homes' new values]
A device home whose state is on the host gets its new value through a pinned
upload buffer on the h2d stream (CopyStreams.to_device_staged). With one
rank the upload starts on the thread that ran the update, right after it:
beside backward, that is the host worker, so the copy overlaps the rest of
backward instead of waiting for step() on the compute thread (GPT 67M on the
sim, 143 MB of device homes: the step went from 1.10x cpu offload's to
0.98x); under the next forward (Note [updates under the next forward]) it
runs on the host worker with the others, and the forward's gather of the
shard waits for its update, then for its copy. It is safe there: the update ran because the gradient was final, so
nothing later in this backward reads the home, and the h2d stream waits for
the compute stream's queued work before writing (h2d-after-compute); the
next forward waits for the copy's event (compute-after-h2d). With several
ranks the value is all-gathered, a collective, so it waits for step() on
the compute thread. A device home whose state is on the device too is
written from the master by compute, at step(), with nothing on the bus.

The class is a torch.optim.Optimizer so LR schedulers drive param_groups as
usual. Its "params" are the model's parameters, as a torch optimizer's are:
code that clips or inspects `p.grad` over `optimizer.param_groups`
(Lightning, Accelerate) reaches the gradients (Note [gradients users read]
in partition/managed.py); the fp32 masters live in the state, not there.
"""
from __future__ import annotations

import torch

from collections import deque

from offload.aio.memory import BufferCache
from offload.host_worker import HostWorker
from offload.ops import adam_step
from offload.ops.adam import fused_torch_adam
from offload.optim.driver import UpdateDriver
from offload.optim.param_groups import check_group
from offload.optim.state_access import state_dict_of, load_torch_state_dict
from offload.optim.state_stream import StateStream
from offload.optim.states import ShardStates
from offload.accounting import MemoryAccount
from offload.partition.shard import Shard
from offload.tiers import Tier
from offload.timeline import Timeline


class ShardedAdam(torch.optim.Optimizer):
    def __init__(self, shards: list[Shard], *,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 adamw_mode: bool, tier: Tier, device: torch.device, account: MemoryAccount,
                 state_tiers: dict[int, Tier] | None = None,
                 state_store=None, param_store=None, sub_group_size: int | None = None,
                 timeline: Timeline | None = None,
                 param_groups: list[dict] | None = None, overlap_threads: int = 1,
                 step_threads: int | None = None, host_worker: HostWorker | None = None,
                 driver: UpdateDriver | None = None):
        """Built empty: it places nothing. The build step (engine/build.py
        `Built.place`) moves each shard home and then gives init_state() its
        initial fp32 partition, in order, once per shard.

        param_groups: torch's form, [{"params": [the model's parameters], "lr": ..., ...}],
        each group's lr, betas, eps and weight_decay overriding the defaults above
        (Note [parameter groups]). None: one group over every shard.
        overlap_threads: Adam kernel threads while updates overlap backward
        (Note [optimizer threads] in offload/simd.py); step_threads: the others' (None:
        torch.get_num_threads()); the engine gives this rank's cores (Note [the node's share]).
        host_worker: the thread host-side updates run on (Note [the host worker] in
        offload/host_worker.py); None: one of its own (closed with it).
        driver: the step that runs the updates, where an engine owns this optimizer (Note
        [the optimizer users drive]); None: step() is update(), nothing runs beside it.
        tier: where every shard's state lives, but for those `state_tiers` (shard.index
        -> Tier: an auto placement, Note [automatic placement] in
        offload/placement.py) puts elsewhere. Each shard's gradient partition
        is on the device where its state is (Shard.gradient.tier)."""
        if not shards:
            raise ValueError("optimizer got an empty parameter list")
        # Note [frozen parameters] (offload/placement.py): frozen shards have no state;
        # a parameter group may still name them, as torch's may, and they are never stepped.
        self.shards = [s for s in shards if s.trainable]
        self._frozen = {id(s.param): s for s in shards if not s.trainable}
        if not self.shards:
            raise ValueError(f"every parameter of the model is frozen (requires_grad=False on all "
                             f"{len(shards)}): there is nothing to train; unfreeze the ones to train "
                             "before offload.initialize")
        shards = self.shards
        # Where each shard's state lives, and its tensors or file: one owner (optim/states.py).
        self.states = ShardStates(shards, tier=tier, state_tiers=state_tiers, device=device, account=account,
                                  state_store=state_store, param_store=param_store)
        self.device = device
        self.account = account
        # zero_optimization.sub_group_size caps the optimizer-state elements read
        # ahead of the shard being updated in the streamed (NVMe) step.
        self.sub_group_size = sub_group_size
        # Per-shard step counts, as torch keeps per-parameter ones: a parameter
        # that got no gradient in a step is skipped and its count stays.
        self.driver = driver
        self.shard_steps = {shard.index: 0 for shard in shards}
        self.timeline = timeline or Timeline(enabled=False)
        # Started with the engine, not on first use: see Note [the host worker].
        self._own_worker = host_worker is None
        self.worker = host_worker or HostWorker()
        self._device_publishes: list[tuple[Shard, torch.Tensor, bool]] = []
        self._param_writes: deque = deque()  # handles of new parameter values being written
        self._param_write_error: BaseException | None = None  # raised by close_stream (Note [a failed step])
        # Adam kernel threads: overlap_threads beside the compute thread, else None (every
        # core): beside_compute() sets it (Note [optimizer threads] in offload/simd.py).
        self.overlap_threads = overlap_threads
        self.step_threads = step_threads
        self.kernel_threads: int | None = step_threads
        largest = max((s.part_numel for s in shards), default=1)
        # State buffers and new values, reused within a step: as many as are
        # in flight at once (the shard updated, the reads ahead, two written
        # back). NVMe state is read ahead of the shard updated up to one
        # largest shard's elements (Note in offload/optim/state_stream.py):
        # enough to keep the disk busy, since the update itself is quicker
        # than its transfers. Two held 90 MiB more at the peak (GPT 67M:
        # 0.91 vs 0.82 GiB) for a step 0-5% faster, within this VM's noise.
        # One write in flight.
        self.ahead = 1
        self.state_buffers = BufferCache((2 + self.ahead) * 3 * 4 * largest + 3 * 4 * largest,
                                   charge=lambda n: account.charge(Tier.HOST, n, "idle optimizer buffers"),
                                   credit=lambda n: account.credit(Tier.HOST, n))
        # Sum of squares of the gradients updated since the engine last read it (this rank's partitions).
        self.grad_sq = 0.0
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode)
        self._group_of: dict[int, int] = {}  # shard.index -> the index of its group
        self._groups_open = True
        # No groups given: one group, and init_state() adds each shard's param to it, in shard order.
        self._one_group = param_groups is None
        super().__init__([{"params": []}] if self._one_group else list(param_groups), defaults)
        self._groups_open = False

    def init_state(self, shard: Shard, init: torch.Tensor) -> None:
        """Takes `init`, this rank's fp32 partition of the shard's initial weights,
        as its master (moments zero). The shard is already home; it is trainable."""
        if not shard.trainable:
            raise ValueError(f"parameter {shard.name} is frozen: it has no optimizer state")
        self.states.init_state(shard, init)
        self._adopt(shard)

    def _adopt(self, shard: Shard) -> None:
        if self._one_group:
            self.param_groups[0]["params"].append(shard.param)
            self._group_of[shard.index] = 0

    # Note [parameter groups]
    # Groups are fixed when the optimizer is made (DeepSpeed's model_parameters,
    # torch's param_groups form): each names some of the model's parameters and
    # may give its own lr, betas, eps and weight_decay; the rest come from the
    # config's optimizer section. Every shard is updated with its own group's
    # values, read from param_groups[i] at the update (so LR schedulers, which
    # set param_groups[i]["lr"], drive each group). A parameter in no group is
    # never updated: the engine only allows that for frozen ones. Indices in
    # state_dict() follow the groups' params in order, as torch's do.
    def add_param_group(self, param_group: dict) -> None:
        """Only while __init__ makes the groups. torch's own version is wrapped in
        torch._disable_dynamo, whose first call imports torch._dynamo (70 MiB of
        RSS, sympy included) into a process that may never compile."""
        if not self._groups_open:
            raise RuntimeError("the engine's optimizer groups are fixed when it is made: give them to "
                               "offload.initialize(model_parameters=[{'params': [...], 'lr': ...}, ...], ...)")
        gi = len(self.param_groups)
        params, hyper = check_group(gi, param_group)
        by_param = {id(s.param): s for s in self.shards}
        for p in params:
            if id(p) in self._frozen:
                continue  # in the group, as torch keeps it, with no state (Note [frozen parameters])
            shard = by_param.get(id(p))
            if shard is None:
                raise ValueError(f"parameter group {gi}: holds a tensor of shape {tuple(getattr(p, 'shape', ()))} "
                                 "that is not one of the engine's parameters")
            if shard.index in self._group_of:
                raise ValueError(f"parameter {shard.name} appears in more than one parameter group "
                                 f"(groups {self._group_of[shard.index]} and {gi})")
            self._group_of[shard.index] = gi
        self.param_groups.append({**self.defaults, **hyper, "params": params})

    def group_of(self, shard: Shard) -> dict:
        """The param group whose hyperparameters update `shard` (Note [parameter groups])."""
        return self.param_groups[self.group_index(shard)]

    def group_index(self, shard: Shard) -> int:
        gi = self._group_of.get(shard.index)
        if gi is None:
            raise RuntimeError(f"parameter {shard.name} got a gradient but is in no parameter group "
                               "(give every trainable parameter a group)")
        return gi

    def indexed(self) -> list[tuple[int, Shard]]:
        """(torch's state index, shard): the groups' params in order, the frozen ones
        counted but left out (they have no state)."""
        by_param = {id(s.param): s for s in self.shards}
        params = (p for g in self.param_groups for p in g["params"])
        return [(i, by_param[id(p)]) for i, p in enumerate(params) if id(p) in by_param]

    def beside_compute(self, sharing: bool) -> None:
        """Updates from now on beside the compute thread: overlap_threads, else every core."""
        self.kernel_threads = self.overlap_threads if sharing else self.step_threads

    # ---- the step -------------------------------------------------------
    # Note [the optimizer users drive]
    # Trainer, Accelerate and plain loops call optimizer.step() and
    # optimizer.zero_grad() themselves, and torch's LR schedulers wrap step().
    # So step() is the engine's whole update when an engine owns this
    # optimizer (`driver`: fp16 unscaling and overflow skips, the config's
    # gradient clipping, waiting for an async checkpoint, the config's LR
    # schedule), and update() is the Adam update alone, which the engine calls.
    # zero_grad() clears the gradient partitions, where the gradients are.

    @torch.no_grad()
    def step(self, closure=None):
        """The update; closure (as torch's optimizers take it, Lightning passes one):
        called first, with gradients enabled, to compute the loss and its backward."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.driver is not None:
            self.driver.update()
        else:
            self.update()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forgets the gradients accumulated since the last step (they live in the shards'
        fp32 partitions, not in param.grad); the next backward starts from zero."""
        self.settle("optimizer.zero_grad()")
        for shard in self.shards:
            shard.gradient.clear()

    @torch.no_grad()
    def update(self) -> None:
        """Updates every shard that has a gradient, on the calling thread, in order: the
        update in step() (clipping or an fp16 overflow check needed every gradient
        first). Updates that run beside backward or the next forward are the step's
        schedulers' (Note [optimizer overlap] in step/updates.py)."""
        shards = self.stepping()
        stream = self.open_stream(shards)
        try:
            for shard in shards:
                self.update_shard(shard, self.group_of(shard), stream)
        finally:
            try:
                self.close_stream(stream)
            finally:
                self.flush_publishes()  # the shards updated, failed step or not

    def stepping(self) -> list[Shard]:
        return [s for s in self.shards if s.gradient.pending]

    def open_stream(self, order: list[Shard], skip_master: frozenset = frozenset()) -> StateStream | None:
        """The NVMe state of `order`'s shards, read ahead of their updates (None where
        none of them has its state on NVMe)."""
        order = [s for s in order if self.states.state_tier(s) is Tier.NVME]
        if not order:
            return None
        states = self.states
        stream = StateStream(states.state_store, states.key, order, account=self.account,
                             timeline=self.timeline, cap_elems=self.sub_group_size, buffers=self.state_buffers,
                             ahead=self.ahead, layout_of=states.layout, read_master=states.read_master,
                             skip_master=skip_master)
        stream.start()
        return stream

    def close_stream(self, stream: StateStream | None) -> None:
        try:
            if stream is not None:
                stream.close()
        finally:
            if self.states.param_store is not None:
                # The next forward must read the new parameters, not a file
                # still being written.
                try:
                    self.states.param_store.store.wait_all()
                except OSError as exc:
                    self._param_write_error = self._param_write_error or exc
                while self._param_writes:
                    self._retire_param_write()
                error, self._param_write_error = self._param_write_error, None
                if error is not None:
                    raise error

    # Note [a failed step]
    # A step that raises (a read or write error, a checksum mismatch) leaves
    # each shard either updated (its gradient cleared, its step count moved,
    # its new value on disk or, when the write failed, kept by the store: Note
    # [failed in-place writes] in offload/aio/swap_store.py) or untouched (its
    # gradient kept). Errors of writes are collected and raised when the step
    # closes, never from the middle of a later shard's update; after the first
    # failure the overlapped updates not yet started are skipped, so a corrupt
    # file stops the step. update() again, after rewriting the kept values,
    # updates exactly the shards left: the result equals an uninterrupted step
    # (the engine's retry: StepRunner.step, offload/step/runner.py).

    def settle(self, reader: str | None = None) -> None:
        """Before state is read or rewritten outside the step: waits for the updates running
        under the next forward (Note [updates under the next forward] in step/updates.py);
        reader: refused, so named, while updates started in backward wait for step()."""
        if self.driver is None:
            return
        if reader is not None and self.driver.updating_in_backward():
            raise RuntimeError(f"{reader} while an overlapped update runs: call step() first")
        self.driver.settle()

    # ---- the state outside the step ------------------------------------------
    # Each read or write of values waits for the updates in flight first (settle);
    # the values themselves are self.states' (optim/states.py).
    def state_dict(self) -> dict:
        """torch's format, each shard's fp32 master beside its moments (optim/state_access.py)."""
        self.settle("optimizer.state_dict()")
        return state_dict_of(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's format, ours or torch's own Adam's (one process)."""
        self.settle()
        load_torch_state_dict(self, state_dict)

    def master_partition(self, shard: Shard) -> torch.Tensor:
        """This rank's fp32 master partition of `shard` (a copy, on the host); a frozen
        shard's home value in fp32 (it has no master: Note [frozen parameters])."""
        self.settle()
        return self.states.master_partition(shard)

    def state_tensors(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The live (master, exp_avg, exp_avg_sq) of a DEVICE/HOST-tier shard: not copies."""
        self.settle()
        return self.states.live(shard)

    def set_master(self, shard: Shard, master: torch.Tensor) -> None:
        """Replaces `shard`'s fp32 master: the weights were edited outside training
        (offload.gathered); the moments stay. A frozen shard has no master: its edited
        home is all there is."""
        if not shard.trainable:
            return
        self.settle()
        self.states.set_master(shard, master)

    def group_listing(self, shard: Shard) -> int | None:
        """The index of the parameter group a frozen shard's parameter is listed in (None:
        in none). With one group (none given) every parameter joins it: 0."""
        if self._one_group:
            return 0
        return next((gi for gi, g in enumerate(self.param_groups) if any(p is shard.param for p in g["params"])),
                    None)

    def adopt_unfrozen(self, shard: Shard, tier: Tier, init: torch.Tensor) -> None:
        """A parameter frozen when the optimizer was made, trainable now (Note [unfreezing]
        in engine/unfreeze.py): its state is made on `tier` (master `init`, this rank's
        fp32 partition; moments zero, step count 0), in the group that lists it. The
        caller checked the group and the budget; the shard is trainable already."""
        gi = self.group_listing(shard)
        if gi is None:
            raise RuntimeError(f"parameter {shard.name} is in no parameter group")
        self._frozen.pop(id(shard.param), None)
        self.shard_steps[shard.index] = 0
        if not self._one_group:
            self._group_of[shard.index] = gi
        self.shards = sorted([*self.shards, shard], key=lambda s: s.index)
        self.states.adopt(shard, tier, init)
        self._adopt(shard)

    def close(self) -> None:
        """Frees the state (the engine settled its step first: engine/engine.py close)."""
        self.state_buffers.clear()
        self.states.clear()
        if self._own_worker:
            self.worker.shutdown()

    # ---- one shard --------------------------------------------------------
    def update_shard(self, shard: Shard, group: dict, stream: StateStream | None,
                      master_value: torch.Tensor | None = None) -> None:
        with self.timeline.span("optimizer", shard.name):
            # Note [global gradient norm] (step/grad_norm.py): the gradients this update applies,
            # summed by the kernel as it reads them (added once it is applied: Note [a failed step]).
            if self.states.state_tier(shard) is not Tier.NVME:
                master, m, v = self.states.live(shard)
                grad_sq = self._update(shard, master, m, v, group)
            else:
                buf = stream.take(shard, master_value)  # the caller credits a charged master_value
                grad_sq = self._update(shard, *stream.layout(shard).views(buf), group)
                stream.put(shard, buf)
            shard.gradient.clear(applied=True)
            self.grad_sq += grad_sq

    def _update(self, shard: Shard, master, m, v, group: dict) -> float:
        """Adam over one shard; returns the sum of its gradient's squares."""
        beta1, beta2 = group["betas"]
        self.shard_steps[shard.index] += 1
        step = self.shard_steps[shard.index]
        grad = shard.gradient.part.to(master.device, non_blocking=True)
        home_out = self._home_out(shard)
        # Where the bytes are, not which layer (Note [one device choice]): the
        # native kernel reads host memory; masters in a GPU's memory take torch's.
        if master.device.type != "cpu":
            grad_sq = torch.linalg.vector_norm(grad, dtype=torch.float32).double().square()  # read later
            fused_torch_adam(master, grad, m, v, step, group)
            if home_out is not None:
                home_out.copy_(master)
        else:
            fused_out = home_out if home_out is not None and home_out.dtype != torch.float32 else None
            grad_sq = adam_step(master, grad, m, v, step=step, lr=group["lr"], beta1=beta1,
                                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                                adamw_mode=group["adamw_mode"], out=fused_out, num_threads=self.kernel_threads,
                                sum_grad_squares=True)
            if home_out is not None and fused_out is None:
                home_out.copy_(master)
        self._publish(shard, master, home_out)
        return grad_sq

    def _home_out(self, shard: Shard) -> torch.Tensor | None:
        """Where this shard's new compute-dtype partition is written, or None if the master is it."""
        on_device = self.states.state_tier(shard) is Tier.DEVICE
        if shard.home is Tier.HOST:
            return None if self.states.aliases_home(shard) else shard.host_part
        if shard.home is Tier.DEVICE and on_device:
            return None  # the home takes the master's value on the device (Shard.set_device_home)
        if shard.home is Tier.NVME and shard.dtype == torch.float32 and not on_device:
            return None  # the fp32 master is the value written home: no copy
        if not on_device:
            return self.state_buffers.take(shard.part_numel, shard.dtype)  # written to NVMe with no copy
        return torch.empty(shard.part_numel, dtype=shard.dtype, device=self.device)

    def uploads_after_update(self, shard: Shard) -> bool:
        """Whether the shard's device home takes its new value up the bus right after
        its update, on any thread (Note [device homes' new values]); else step()
        publishes it on the compute thread (flush_publishes)."""
        return (shard.home is Tier.DEVICE and self.states.state_tier(shard) is not Tier.DEVICE
                and shard.ctx.streams is not None and shard.ctx.pg.world_size == 1)

    def _publish(self, shard: Shard, master: torch.Tensor, written: torch.Tensor | None) -> None:
        if shard.home is Tier.DEVICE:
            if written is None:  # state on the device: the home is written there, from the master
                self._device_publishes.append((shard, master, True))
            elif self.uploads_after_update(shard):
                # Note [device homes' new values]: up the bus now, from the thread that updated it.
                shard.set_device_home(written)
            else:
                # Note [optimizer overlap]: the all-gather waits for the compute thread.
                self._device_publishes.append((shard, written, False))
        elif shard.home is Tier.NVME:
            if written is None:  # lent from the master, already charged where it lives
                part, nbytes = master, 0
            else:
                part = written if written.device.type == "cpu" else written.to("cpu")
                nbytes = part.numel() * part.element_size()
            self.account.charge(Tier.HOST, nbytes, f"new value of {shard.name} on its way to NVMe")
            self._param_writes.append((self.states.param_store.write(shard, part, borrow=True), nbytes, part))
            while len(self._param_writes) > 2:  # new values in flight: bounded host memory
                self._retire_param_write()

    def _retire_param_write(self) -> None:
        handle, nbytes, part = self._param_writes.popleft()
        try:
            handle.wait()
        except OSError as exc:  # the store kept the value; raised when the step closes (Note [a failed step])
            self._param_write_error = self._param_write_error or exc
        finally:
            self.account.credit(Tier.HOST, nbytes)
        if nbytes:
            self.state_buffers.give(part)

    def flush_publishes(self) -> None:
        if Tier.NVME in self.states.state_tiers:
            # Idle state buffers are reused within a step, not across steps: kept,
            # they would sit resident through the next forward, on top of its
            # activations (300 MiB of a 0.9 GiB peak, GPT 67M on NVMe).
            self.state_buffers.clear()
        while self._device_publishes:
            shard, part, on_device = self._device_publishes.pop(0)
            shard.set_device_home(part, on_device=on_device)
