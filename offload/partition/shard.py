"""One parameter's partition and the single owner of its residency.

Note [shard layout]
A parameter of n elements is flattened and padded to world * part elements
(part = ceil(n / world)); rank r owns elements [r * part, (r + 1) * part).
The shard keeps this rank's partition at its home tier, in compute dtype:
  Tier.DEVICE  the full parameter stays on the device (offload_param none,
               or below the persistence threshold); gather/release are no-ops
  Tier.HOST    a flat host tensor of `part` elements
  Tier.NVME    a file in the parameter swap store; nothing held in RAM
Gathering builds the full parameter on the device tier (all-gathering the
partitions across ranks) and points param.data at it; releasing points
param.data back at a placeholder and frees the device bytes. Nothing else is
attached to the nn.Parameter.

The placeholder has the parameter's full shape but stride 0 over a single
element: model code that reads `.shape` keeps working, and autograd's
AccumulateGrad (which checks a gradient's layout against the parameter's
current metadata) accepts the gradient of a parameter whose backward did not
need its value (a bias), without the parameter being gathered for it.
"""
from __future__ import annotations

import torch

from offload.aio.memory import aligned_tensor
from offload.partition.shard_gradient import GradientPartition
from offload.partition.shard_context import InFlight, Residency, ShardContext, _FailedRead, partition_numel
from offload.tiers import Tier


class Shard:
    def __init__(self, index: int, name: str, param: torch.nn.Parameter, *,
                 compute_dtype: torch.dtype, home: Tier, ctx: ShardContext):
        self.index = index
        self.name = name
        self.param = param
        self.shape = param.shape
        self.numel = param.numel()
        self.original_dtype = param.dtype
        self.dtype = compute_dtype
        self.home = home
        self.ctx = ctx
        # False: frozen when the engine was built, a home and nothing else (Note [frozen
        # parameters] in offload/placement.py); build.py sets it from the plan.
        self.trainable = True
        world = ctx.pg.world_size
        self.part_numel = partition_numel(self.numel, world)
        self.padded_numel = self.part_numel * world
        self.residency = Residency.RELEASED
        self._refs = 0
        self._full: torch.Tensor | None = None  # padded flat device buffer while gathered
        self._full_lent = False  # _full is left to its other users when released (lend_gathered_buffer)
        # Note [zero-copy gather]: with one rank and the device tier in host
        # memory (CPU-only), a host partition already is the full parameter:
        # gathering points param.data at it and costs no bytes and no copy.
        self._zero_copy = (home is Tier.HOST and ctx.pg.world_size == 1
                           and not ctx.layer.separate_memory)
        self.in_flight = InFlight()  # reads, copies, all-gathers and updates under way
        self.host_part: torch.Tensor | None = None  # HOST home only
        self.pinned_home = False  # host_part is pinned memory (engine/build.py _home_pinner)
        self._host_alias: torch.Tensor | None = None  # host_part as the layer's pinned buffer
        # fp32 gradient partition, accumulated across micro-steps, on the
        # optimizer's side (Note [gradient partitions] in shard_gradient.py).
        self.gradient = GradientPartition(self, ctx.grad_tier)
        self._placeholder = torch.zeros(1, dtype=compute_dtype, device=ctx.device).expand(self.shape)

    # ---- construction --------------------------------------------------
    def my_slice(self, flat_full: torch.Tensor) -> torch.Tensor:
        """This rank's partition of a flat full-size tensor (zero-padded copy if short)."""
        start = self.ctx.pg.rank * self.part_numel
        piece = flat_full[start:start + self.part_numel]
        if piece.numel() == self.part_numel:
            return piece
        padded = torch.zeros(self.part_numel, dtype=flat_full.dtype, device=flat_full.device)
        padded[:piece.numel()] = piece
        return padded

    def join(self, ctx: ShardContext) -> None:
        """Moves a shard built under offload.init into the engine's context.

        Only what the engine adds may change (its stores over the same files,
        the gradient tier, gathered-buffer reuse): the device, the ranks and the
        memory account the shard's bytes are charged to must be the same ones.
        """
        if ctx.device != self.ctx.device or ctx.pg != self.ctx.pg or ctx.account is not self.ctx.account:
            raise RuntimeError(f"shard {self.name}: built for device {self.ctx.device}, rank "
                               f"{self.ctx.pg.rank}/{self.ctx.pg.world_size}; the engine runs on "
                               f"{ctx.device}, rank {ctx.pg.rank}/{ctx.pg.world_size} with its own "
                               "memory account: initialize the model where offload.init built it")
        self.ctx = ctx

    def adopt(self, value: torch.Tensor) -> None:
        """Takes the parameter's initial value (any dtype/device) into its home."""
        flat = value.detach().reshape(-1).to(self.dtype)
        nbytes = self.part_numel * self.dtype.itemsize
        if self.home is Tier.DEVICE:
            # Replicated on every rank (padded so an updated partition can be
            # all-gathered straight into it after the optimizer step).
            self._full = self._alloc_full()
            if self.ctx.streams is None:
                self._full[:self.numel].copy_(flat)
                self._full[self.numel:].zero_()
            else:
                padded = torch.zeros(self.padded_numel, dtype=self.dtype)
                padded[:self.numel].copy_(flat)
                self.publish(padded)
                self._await_copy_in()
            self.param.data = self._compute_view()
            self.residency = Residency.GATHERED
            return
        part = self.my_slice(flat)
        if self.home is Tier.HOST:
            self.ctx.account.charge(Tier.HOST, nbytes, self.name)
            self.host_part = part.to("cpu", copy=True).contiguous()
        else:
            self.ctx.account.charge(Tier.NVME, nbytes, self.name)
            self.ctx.param_store.write(self, part.to("cpu").contiguous()).wait()
        self.param.data = self._placeholder

    # ---- residency transitions ----------------------------------------
    @property
    def reads_ahead(self) -> bool:
        """Whether bringing this parameter to the device is a transfer worth starting
        early: an NVMe read, or a copy-in to a separate device (Note [copy streams])."""
        return self.home is Tier.NVME or (self.home is Tier.HOST and self.ctx.streams is not None)

    def await_update(self) -> None:
        """Returns once no update is writing this shard's home or reading its gradient."""
        if self.in_flight.update is not None:
            self.in_flight.update.result()  # an update that raised raises here too

    def prefetch(self) -> None:
        """Starts bringing the parameter to the device without waiting."""
        if self.residency is not Residency.RELEASED or not self.reads_ahead:
            return
        self.await_update()
        self._full = self._alloc_full()
        try:
            if self.home is Tier.NVME:
                self.in_flight.read = self.ctx.param_store.read_full(self, self._full)
            else:
                self.in_flight.copy_in = self.ctx.streams.to_device(self.own_slice(self._full), self._host_copy_source())
        except BaseException:
            self._drop_full()
            raise
        self.residency = Residency.FETCHING

    def gather(self) -> torch.Tensor:
        """Holds the full parameter on the device (refcounted); returns param.data.

        A gather that fails (the device budget refuses the buffer, a read fails)
        holds nothing and charges nothing: the hold is counted only once the
        parameter is there, so the caller's error leaves the shard as it was."""
        if self.residency is not Residency.GATHERED:
            self.await_update()
            self._materialize()
        elif self.in_flight.update is not None or self.in_flight.copy_in is not None:  # a device home's update
            self.await_update()  # it started the copy (Note [device homes' new values])
            if self.in_flight.copy_in is not None:
                self._await_copy_in()
                self.param.data = self._compute_view()
        self._refs += 1
        return self.param.data

    def _materialize(self) -> None:
        if self.residency is Residency.RELEASED and self._zero_copy:
            self._full = self.host_part
        elif self.ctx.streams is not None:
            self._materialize_separate()
            return
        elif self.residency is Residency.RELEASED:
            self._full = self._alloc_full()  # a refused charge raises here, before any state changes
            try:
                if self.home is Tier.HOST:
                    self.ctx.pg.all_gather(self._full, self.host_part)
                else:
                    self.ctx.param_store.read_full(self, self._full).wait()
            except BaseException:
                self._drop_full()  # gives the buffer and its charge back
                raise
        else:  # FETCHING
            self.in_flight.read.wait()
            self.in_flight.read = None
        self.param.data = self._full[:self.numel].view(self.shape)
        self.residency = Residency.GATHERED

    def _materialize_separate(self) -> None:
        """_materialize on a device with memory of its own (Note [copy streams])."""
        if self.in_flight.all_gather is not None:  # started ahead: the whole value is on its way
            self._finish_all_gather()
            self.param.data = self._compute_view()
            self.residency = Residency.GATHERED
            return
        self.prefetch()  # the copy-in (or NVMe read), unless a read ahead started it
        try:
            if self.in_flight.read is not None:
                fetch, self.in_flight.read = self.in_flight.read, None
                self.in_flight.copy_in = fetch.wait()  # the bytes are staged; their copy-in is under way
            self._await_copy_in()
            if self.ctx.pg.world_size > 1:
                full = self.ctx.layer.lend(self._full, write=True)
                # A copy of the own partition: gloo's all-gather takes no input inside its output.
                self.ctx.pg.all_gather(full, self.own_slice(full).clone())
        except BaseException:
            self._drop_full()
            raise
        self.param.data = self._compute_view()
        self.residency = Residency.GATHERED

    def ready_to_gather_ahead(self) -> bool:
        """Whether this parameter joins an all-gather ahead of its use (Note [all-gathers
        ahead]): not when its value is gathered or being gathered already; else its
        partition is copied in now, for the collective to read."""
        if self.residency is Residency.GATHERED or self.in_flight.all_gather is not None:
            return False
        self.prefetch()
        try:
            if self.in_flight.read is not None:
                fetch, self.in_flight.read = self.in_flight.read, None
                self.in_flight.copy_in = fetch.wait()
            if self.in_flight.copy_in is not None:
                # The collective reads the partition from the host side (gloo's threads;
                # NCCL would wait the event on its stream): the copy-in must be done.
                self.in_flight.copy_in.synchronize()
                self._await_copy_in()
        except BaseException:
            self._drop_full()
            raise
        return True

    def full_buffer(self) -> torch.Tensor:
        """The padded flat device buffer while the shard holds one."""
        return self._full

    def _finish_all_gather(self) -> None:
        packed, self.in_flight.all_gather = self.in_flight.all_gather, None
        packed.finish()

    def _host_copy_source(self) -> torch.Tensor:
        """host_part as a copy-in reads it: the layer's pinned buffer when the home is
        pinned (asynchronous), else the pageable tensor (the layer copies it synchronously)."""
        if not self.pinned_home:
            return self.host_part
        alias = self._host_alias
        if alias is None or alias.data_ptr() != self.host_part.data_ptr() or alias.numel() != self.host_part.numel():
            alias = self._host_alias = self.ctx.layer.register_pinned(self.host_part, f"host home of {self.name}")
        return alias

    def advance(self) -> None:
        """A read ahead whose bytes are in starts its copy-in now, not when the step
        needs the parameter: the copy then overlaps compute too (Note [copy streams])."""
        if self.in_flight.read is not None and self.ctx.streams is not None and self.in_flight.read.bytes_ready():
            fetch, self.in_flight.read = self.in_flight.read, None
            try:
                self.in_flight.copy_in = fetch.wait()
            except Exception as exc:  # noqa: BLE001 - this parameter's own gather raises it
                self.in_flight.read = _FailedRead(exc)

    def _await_copy_in(self) -> None:
        if self.in_flight.copy_in is not None:
            self.ctx.streams.wait(self.in_flight.copy_in)  # compute-after-h2d (Note [copy streams])
            self.in_flight.copy_in = None

    def _compute_view(self) -> torch.Tensor:
        """The gathered value as the model sees it (on a separate device, lent to compute)."""
        full = self._full if self.ctx.streams is None else self.ctx.layer.lend(self._full, write=False)
        return full[:self.numel].view(self.shape)

    def gathered_own_part(self) -> torch.Tensor | None:
        """This rank's partition of the gathered value on a separate device, lent to
        compute for reading; None where it is not gathered there."""
        if self.residency is not Residency.GATHERED or self.ctx.streams is None or self._full is None:
            return None
        return self.own_slice(self.ctx.layer.lend(self._full, write=False))

    def own_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's partition of a padded flat buffer (a view; my_slice pads a short one)."""
        start = self.ctx.pg.rank * self.part_numel
        return flat[start:start + self.part_numel]

    def publish(self, padded_or_part: torch.Tensor) -> None:
        """A device home's new value (host; the padded full value, or this rank's
        partition, which the caller then all-gathers) starts its copy to the device;
        compute waits for it at the next gather (Note [copy streams])."""
        dst = self._full if padded_or_part.numel() == self.padded_numel else self.own_slice(self._full)
        self.in_flight.copy_in = self.ctx.streams.to_device_staged(dst, padded_or_part)

    def release(self) -> None:
        """Drops one hold; the last one frees the device copy (home copy stays authoritative)."""
        if self._refs == 0:
            raise RuntimeError(f"release of parameter {self.name} that is not held")
        self._refs -= 1
        if self._refs == 0 and self.home is not Tier.DEVICE:
            self._drop_full()

    def force_release(self) -> None:
        """End of a pass: drop every hold (parameters gathered on demand, frozen ones)."""
        self._refs = 0
        if self.home is not Tier.DEVICE and self.residency is not Residency.RELEASED:
            if self.in_flight.read is not None:
                self.in_flight.read.cancel()  # the bytes only: no collective outside use order
                self.in_flight.read = None
            if self.in_flight.copy_in is not None:  # a copy-in nobody used: done before its buffer is freed
                self.in_flight.copy_in.synchronize()
                self.in_flight.copy_in = None
            if self.in_flight.all_gather is not None:  # every rank started it: it completes
                self._finish_all_gather()
            self._drop_full()

    @property
    def gathers_to_a_buffer(self) -> bool:
        """Whether gathering allocates a buffer of its own (not the home itself: a device
        home, or a zero-copy host home, Note [zero-copy gather])."""
        return self.home is not Tier.DEVICE and not self._zero_copy

    @property
    def held(self) -> bool:
        return self._refs > 0 or self.home is Tier.DEVICE

    @property
    def refs(self) -> int:
        return self._refs

    def _alloc_full(self) -> torch.Tensor:
        self.ctx.account.charge(Tier.DEVICE, self.padded_numel * self.dtype.itemsize, self.name)
        if self.ctx.layer.separate_memory:
            return self.ctx.layer.alloc(self.padded_numel, self.dtype, self.name)
        if self.ctx.device.type == "cpu":
            # Aligned, so an NVMe read lands in it with no staging copy; reused
            # from step to step (Note in offload/aio/memory.py BufferCache).
            if self.ctx.gathered_buffers is not None:
                return self.ctx.gathered_buffers.take(self.padded_numel, self.dtype)
            return aligned_tensor(self.padded_numel, self.dtype)
        return torch.empty(self.padded_numel, dtype=self.dtype, device=self.ctx.device)

    def lend_gathered_buffer(self) -> None:
        """The gathered buffer goes with whoever still references it (autograd, for a frozen
        value read in backward: Note [frozen holds in backward]): when released it is left
        to them, not reused. A host buffer on a CPU device only."""
        if self.residency is not Residency.GATHERED or self.ctx.layer.separate_memory or self._zero_copy:
            raise RuntimeError(f"parameter {self.name}: only a gathered host buffer can be lent")
        self._full_lent = True

    def _drop_full(self) -> None:
        self.param.data = self._placeholder
        lent, self._full_lent = self._full_lent, False
        if self.ctx.layer.separate_memory:
            self.ctx.layer.free(self._full)
        elif self.ctx.gathered_buffers is not None and not self._zero_copy and self._full.device.type == "cpu":
            if lent:  # autograd holds it: the cache must not (a leak of one buffer a read, found at 70B)
                self.ctx.gathered_buffers.forget(self._full)
            else:
                self.ctx.gathered_buffers.give(self._full)
        self._full = None
        if not self._zero_copy:
            self.ctx.account.credit(Tier.DEVICE, self.padded_numel * self.dtype.itemsize)
        self.residency = Residency.RELEASED

    def full_storage_ptr(self) -> int | None:
        """Address of the gathered buffer's storage (to recognise saved views of it)."""
        if self.residency is not Residency.GATHERED:
            return None
        return self.param.data.untyped_storage().data_ptr()

    # ---- edits of the gathered value (offload.gathered) -------------------
    def full_value_buffer(self) -> torch.Tensor:
        """The padded flat gathered buffer (held), which edits of the parameter write."""
        if self.residency is not Residency.GATHERED:
            raise RuntimeError(f"parameter {self.name} is not gathered")
        if self.ctx.streams is not None:
            return self.ctx.layer.lend(self._full, write=True)
        return self._full

    def gathered_partition(self) -> torch.Tensor:
        """This rank's partition of the gathered value (a view)."""
        start = self.ctx.pg.rank * self.part_numel
        return self.full_value_buffer()[start:start + self.part_numel]

    def write_home(self) -> None:
        """After an edit of the gathered value: this rank's partition goes home."""
        part = self.gathered_partition()
        if self.home is Tier.DEVICE or (self.home is Tier.HOST and self._zero_copy):
            return  # the gathered buffer is the home
        if self.home is Tier.HOST:
            self.host_part.copy_(part)
        else:
            self.ctx.param_store.write(self, part.to("cpu").contiguous()).wait()

    def full_storage_offset(self) -> int:
        """Where the gathered buffer starts in its storage, in elements."""
        return self._full.storage_offset()

    def home_partition(self) -> torch.Tensor:
        """A copy of this rank's compute-dtype partition, from wherever it lives."""
        self.await_update()
        if self.home is Tier.DEVICE:
            if self.ctx.streams is None:
                return self.own_slice(self._full).clone()
            self._await_copy_in()
            part = torch.empty(self.part_numel, dtype=self.dtype)
            self.ctx.layer.copy(part, self.own_slice(self._full)).synchronize()  # pageable: synchronous
            return part
        if self.home is Tier.HOST:
            return self.host_part.clone()
        part = torch.empty(self.part_numel, dtype=self.dtype)
        self.ctx.param_store.read_part(self, part).wait()
        return part

    def set_device_home(self, part: torch.Tensor, *, on_device: bool = False) -> None:
        """A DEVICE-home shard's new partition (this rank's, from the optimizer or a
        checkpoint) goes to the device and is all-gathered there. With one rank on
        a separate device the copy-in is left running; the next gather waits for
        it (Note [copy streams]). on_device: `part` was computed in the device's
        memory (optimizer state on the device, any float dtype): written into the
        home by compute, in the compute dtype, with nothing over the bus."""
        assert self.home is Tier.DEVICE
        if self.ctx.streams is None:
            self.ctx.pg.all_gather(self._full, part.to(self.ctx.device, self.dtype))
            return
        if on_device:
            self._await_copy_in()  # a checkpoint's value may still be on its way up
            full = self.ctx.layer.lend(self._full, write=True)
            self.own_slice(full).copy_(part.detach().reshape(-1))
            if self.ctx.pg.world_size > 1:
                self.ctx.pg.all_gather(full, self.own_slice(full).clone())
            self.param.data = self._compute_view()
            return
        self.publish(part.detach().reshape(-1).contiguous())
        if self.ctx.pg.world_size > 1:
            self._await_copy_in()
            full = self.ctx.layer.lend(self._full, write=True)
            self.ctx.pg.all_gather(full, self.own_slice(full).clone())
            self.param.data = self._compute_view()

    def __repr__(self) -> str:
        return (f"Shard({self.name}, shape={tuple(self.shape)}, home={self.home.value}, "
                f"{self.residency.value}, refs={self._refs})")

    # ---- construction from a partition (offload.init; engine/build.py) ----
    def adopt_partition(self, part: torch.Tensor) -> None:
        """Takes this rank's partition of the initial value (any dtype) into a HOST or NVME home."""
        if self.home is Tier.DEVICE:
            raise ValueError(f"{self.name}: a device home takes the full value (adopt), not a partition")
        part = part.detach().reshape(-1).to("cpu", self.dtype)
        self.ctx.account.charge(Tier.HOST if self.home is Tier.HOST else Tier.NVME,
                                self.part_numel * self.dtype.itemsize, self.name)
        if self.home is Tier.HOST:
            self.host_part = part.clone().contiguous()
        else:
            self.ctx.param_store.write(self, part.contiguous()).wait()
        self.param.data = self._placeholder
