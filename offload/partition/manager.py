"""Gathers parameters just before they are used and releases them after.

Note [when parameters are gathered]
Forward: a module's forward pre-hook gathers the parameters it owns directly
(recurse=False) and its forward hook releases them. A parameter used outside
its owner's forward (a tied LM head reading the embedding's weight in the
parent's forward, a parameter read directly by an ancestor) is caught by a
TorchFunctionMode active during the engine's forward: any torch function
given a released managed parameter gathers it first; those holds end with
the root module's forward.
Backward: autograd's saved-tensor hooks replace every saved tensor that is
(a view of) a gathered parameter by a small record; unpacking the record
during backward gathers the parameter again and rebuilds the view. So no
parameter stays resident between forward and backward, whatever the module
structure, and none is gathered in backward unless backward needs its value.
A parameter's backward holds end in its post-accumulate-grad hook, which
also moves the gradient into the shard's fp32 partition and frees it.

Note [the model is the interface]
Users call their own module (`model(x)`, Hugging Face's Trainer, Accelerate)
as often as `engine(x)`, and recompute activations with any checkpoint
function. So the hooks live for the engine's life, and every module also
carries a pair that opens the forward context above around the outermost
module call, whichever module that is: `engine(x)` is just `model(x)`.
A module called during backward is a recomputation (torch's or Hugging
Face's checkpointing, reentrant or not; ours); it joins the pass under way
and pushes no saved-tensor hooks, because such hooks do not stack and the
checkpoint function's own pair must stay innermost to catch what it saves.
What a recomputation saves may then be a gathered parameter itself, so the
holds it takes are not dropped after its forward but kept, as backward holds,
until that parameter's gradient is final (its post-accumulate-grad hook) or
the backward ends. The end of a backward is learned from autograd (a
callback queued on the first graph task that touched a parameter), not from
`engine.backward`, so `loss.backward()` ends a pass the same way and several
backward calls before one optimizer step accumulate, as in PyTorch.

Note [bookkeeping outside the mode]
While the forward runs, every torch call made in Python goes through the
TorchFunctionMode above, which costs about 2 us a call. The model makes a
few hundred such calls per step; the manager's own hooks, the shards, the
swap store and the saver made about 3,400 (numel, views, data_ptr of I/O
buffers), taxing a 3.3M-parameter GPT's step 7-10 ms. So the hooks run their
bookkeeping with torch function handling disabled (`_bookkeeping`): the mode
would only have passed those calls through (the `_internal` flag keeps it from
gathering), and a user's mode around the forward (`with torch.device(...)`)
has no business placing the engine's I/O buffers either.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from offload.timeline import Timeline
from offload.host_worker import HostWorker
from offload.transfers.device_copies import GradientsToHost
from offload.transfers.gather_ahead import start_all_gather_ahead
from offload.transfers.grad_buckets import GradientBuckets
from offload.partition.hooks import StepHooks
from offload.partition.prefetch import PrefetchScheduler
from offload.partition.shard import Shard
from offload.partition.compiled_model import warn_compiled_model
from offload.partition.gather_on_use import GatherOnUse
from offload.partition.shard_context import Residency
from offload.tiers import Tier


# Note [bookkeeping outside the mode]
_bookkeeping = torch._C.DisableTorchFunction


@dataclass(frozen=True)
class _SavedParamView:
    shard: Shard
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class ParameterManager:
    def __init__(self, module: torch.nn.Module, shards: list[Shard], hooks: StepHooks,
                 prefetch: PrefetchScheduler | None = None, timeline: Timeline | None = None,
                 reduce_bucket_elems: int | None = None, host_worker: HostWorker | None = None):
        """hooks: the step's side (partition/hooks.py). hooks.take_grad gets each parameter's
        final gradient, this rank's partition averaged over ranks (with one rank, the gradient
        itself, owned=True: autograd's tensor, which no one else holds); beside a
        separate device, on host_worker once its copy to the host is done (Note [the
        host worker] in offload/host_worker.py). hooks.forward_starts() as a forward pass
        opens (the engine's checks; Note [the model is the interface]); hooks.edited(shard,
        fp32 value) with an edited partition's value for the optimizer's master
        (offload.gathered with modifier_rank; Note [reading a parameter outside the engine]).
        prefetch: reads ahead in the learned order (Note [prefetch order]);
        None reads on demand.
        reduce_bucket_elems: gradient elements per reduce-scatter with several ranks
        (Note [gradient buckets]); None: the largest padded parameter."""
        self.module = module
        self.shards = shards
        self.shard_of = {id(s.param): s for s in shards}
        self.hooks = hooks
        on_grad = hooks.take_grad
        # On a device with memory of its own each gradient (each rank's reduced
        # partition) is copied to the host on the d2h stream (Note [copy streams]),
        # unless the shard's optimizer state, and so its gradient, is on the device.
        self.to_host: GradientsToHost | None = None
        ctx = shards[0].ctx if shards else None
        going_down = [s for s in shards if s.gradient.tier is not Tier.DEVICE]
        if ctx is not None and ctx.streams is not None and going_down:
            if host_worker is None:
                raise ValueError("gradients copied to the host need the host worker that takes them in")
            # The ring sized for the trainable ones: a frozen parameter has no gradient.
            largest = max((s.part_numel for s in going_down if s.trainable), default=1)
            self.to_host = GradientsToHost(ctx.streams, largest * 4, on_grad,
                                           host_worker, brings_master=hooks.brings_master,
                                           ledger=ctx.account.pinned, pin=ctx.layer.page_locks)
            on_grad = self._route_grad  # a reduced partition goes down as well
        self.grad_buckets: GradientBuckets | None = None  # one rank: gradients go straight to take_grad
        if ctx is not None and ctx.pg.job_size > 1:
            self.grad_buckets = GradientBuckets.for_shards(ctx.pg, shards, reduce_bucket_elems, on_grad, hooks)
        self.prefetch = prefetch or PrefetchScheduler(bucket_elems=0, max_live_elems=0,
                                                      reuse_distance=-1, enabled=False)
        self.timeline = timeline or Timeline(enabled=False)
        self._internal = False  # set while the manager itself touches parameters
        self.compile_warned = False  # Note [compiled models]
        self._on_demand: list[Shard] = []
        self._backward_holds: dict[Shard, int] = {}
        self._module_depth = 0  # module calls under way
        self._opened: list[tuple[int, contextlib.ExitStack]] = []  # (depth, context) opened by module hooks
        self._context_depth = 0  # forward contexts open (module-opened or explicit)
        self._recomputing = 0  # forward contexts open inside a backward (a recomputation)
        self._backward_tasks: list[int] = []  # autograd graph tasks under way that touched a parameter
        self.backward_passes = 0  # completed backward passes (engine.step counts them)
        # Storage address of each gathered buffer -> its shard, to recognise
        # saved tensors that are parameters (or views of them).
        self._live: dict[int, Shard] = {}
        for s in shards:
            self._track(s)
        self._handles = []
        self._install_hooks()
        # Note [prefetch within the device budget]; held weakly, so the account
        # (which outlives the manager in every shard's context) keeps no manager alive.
        self._account = shards[0].ctx.account if shards else None
        if self._account is not None:
            reclaim = weakref.WeakMethod(self.reclaim_device)
            self._account.add_reclaimer(Tier.DEVICE, lambda n: reclaim() and reclaim()(n))

    # ---- holds -----------------------------------------------------------
    def _track(self, shard: Shard) -> None:
        ptr = shard.full_storage_ptr()  # reads param.data: callers hold _internal
        # Never leave an address of a freed buffer behind: a saved activation
        # allocated there later would be taken for this parameter.
        for k in [k for k, v in self._live.items() if v is shard and k != ptr]:
            del self._live[k]
        if ptr is not None:
            self._live[ptr] = shard

    def hold(self, shard: Shard) -> torch.Tensor:
        self._internal = True
        try:
            retained = self.prefetch.is_retained(shard)
            taken_into_use = shard.refs == 0 or (retained and shard.refs == 1)
            if taken_into_use:
                # This parameter's own read goes first, then the reads ahead of
                # it: the store finishes transfers in submission order.
                shard.prefetch()
                handed_over = self.prefetch.on_use(shard)
                if shard.ctx.streams is not None:
                    self.prefetch.advance()
                    ahead = [s for s in self.prefetch.gathers_ahead() if s.ready_to_gather_ahead()]
                    if ahead:  # Note [all-gathers ahead]
                        start_all_gather_ahead(ahead)
            if shard.residency is Residency.GATHERED:
                data = shard.gather()
            else:
                with self.timeline.span("wait", shard.name):
                    data = shard.gather()
            if taken_into_use and handed_over:
                shard.release()  # the reference kept for reuse passes to this hold
            self._track(shard)
        finally:
            self._internal = False
        return data

    def drop(self, shard: Shard) -> None:
        self._internal = True
        try:
            if shard.refs == 1 and self.prefetch.should_retain(shard):
                return  # Note [prefetch order]: kept for a reuse close ahead
            shard.release()
            if not shard.held:
                self._track(shard)
                self.prefetch.on_released(shard)
        finally:
            self._internal = False

    # ---- hooks -----------------------------------------------------------
    def _install_hooks(self) -> None:
        self._module_handles: dict[int, list] = {}  # id(module) -> its gather and context hooks
        for mod in self.module.modules():
            self._hook_module(mod, [self.shard_of[id(p)] for p in mod.parameters(recurse=False) if id(p) in self.shard_of])
        for shard in (s for s in self.shards if s.trainable):  # Note [frozen parameters] in offload/placement.py
            self.watch_gradients(shard)

    def watch_gradients(self, shard: Shard) -> None:
        """Takes the shard's gradients; a frozen one's once unfrozen (Note [unfreezing] in engine/unfreeze.py)."""
        self._handles.append(shard.param.register_post_accumulate_grad_hook(self._make_grad_hook(shard)))

    def _hook_module(self, mod: torch.nn.Module, shards: list[Shard]) -> None:
        """`shards` gathered around mod's forward; the forward context (Note [the model is the interface])."""
        gather = [mod.register_forward_pre_hook(self._make_pre_hook(shards)),
                  mod.register_forward_hook(self._make_post_hook(shards), always_call=True)] if shards else []
        self._module_handles[id(mod)] = gather + [mod.register_forward_pre_hook(self._enter_module, prepend=True),
                                                  mod.register_forward_hook(self._leave_module, always_call=True)]

    def gather_at_boundary(self, block: torch.nn.Module):
        """(gather, release) of all under the block, for its caller; no hooks inside (Note [compiled blocks])."""
        for h in [h for mod in block.modules() for h in self._module_handles.pop(id(mod), [])]:
            h.remove()
        self._hook_module(block, [])
        own = [self.shard_of[id(p)] for p in block.parameters() if id(p) in self.shard_of]
        return self._make_pre_hook(own), self._make_post_hook(own)

    def _make_pre_hook(self, own: list[Shard]):
        def pre_hook(module, args):
            with _bookkeeping():
                for shard in own:
                    self.hold(shard)
        return pre_hook

    def _make_post_hook(self, own: list[Shard]):
        def post_hook(module, args, output):
            with _bookkeeping():
                for shard in own:
                    if shard.held:
                        self._drop_or_hold(shard, hold=self._recomputing > 0)
        return post_hook

    def _drop_or_hold(self, shard: Shard, hold: bool) -> None:
        """Ends a forward hold; in a recomputation during backward (hold), keeps it
        until the parameter's gradient is final (Note [the model is the interface])."""
        if hold:
            self._note_backward()
            self._backward_holds[shard] = self._backward_holds.get(shard, 0) + 1
        else:
            self.drop(shard)

    @staticmethod
    def _lends_to_autograd(shard: Shard) -> bool:
        """Note [frozen holds in backward]: a frozen value unpacked in backward from a host
        buffer on a CPU device is left to autograd instead of held to its end."""
        return not shard.trainable and shard.gathers_to_a_buffer and not shard.ctx.layer.separate_memory

    def _make_grad_hook(self, shard: Shard):
        def grad_hook(param):
            self._note_backward()
            with _bookkeeping():  # the real .grad (Note [gradients users read] in managed.py)
                grad = param.grad
                param.grad = None
            if self.grad_buckets is not None:
                self.grad_buckets.add(shard, grad)
            else:
                self._route_grad(shard, grad, owned=True)
            for _ in range(self._backward_holds.pop(shard, 0)):
                self.drop(shard)
        return grad_hook

    def _route_grad(self, shard: Shard, grad: torch.Tensor, owned: bool = False) -> None:
        """A final gradient (one rank's reduced partition with several) goes down to
        the host, or straight to hooks.take_grad where the shard's gradient stays on the device."""
        if self.to_host is not None and shard.gradient.tier is not Tier.DEVICE:
            self.to_host.put(shard, grad)
        else:
            self.hooks.take_grad(shard, grad, owned=owned)

    # ---- the outermost module call opens the forward context ---------------
    def _enter_module(self, module, args) -> None:
        self._module_depth += 1  # first: _leave_module runs even if what follows raises
        if self._context_depth:
            return
        if torch.compiler.is_compiling():  # True only while dynamo traces this hook
            warn_compiled_model(self)
        in_backward = torch._C._current_graph_task_id() != -1
        stack = contextlib.ExitStack()
        stack.enter_context(self.forward_context(new_pass=not in_backward, recomputing=in_backward))
        self._opened.append((self._module_depth, stack))

    def _leave_module(self, module, args, output) -> None:
        depth = self._module_depth
        self._module_depth -= 1
        if self._opened and self._opened[-1][0] == depth:
            self._opened.pop()[1].close()

    # ---- the end of a backward pass -----------------------------------------
    def _note_backward(self) -> None:
        """Called from every hook that runs in backward: the first time a graph
        task touches a parameter, asks autograd to tell us when it ends."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._backward_tasks:
            return
        self._backward_tasks.append(task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(task))

    def _backward_done(self, task: int) -> None:
        if task in self._backward_tasks:
            self._backward_tasks.remove(task)
        if not self._backward_tasks:  # the outermost (a reentrant checkpoint's inner one ends first)
            if self.grad_buckets is not None:
                self.grad_buckets.flush()  # Note [gradient buckets]
            if self.to_host is not None and not self.to_host.plan.carried:
                # Every gradient in its partition before the optimizer reads them, unless
                # their updates go on (Note [head first after backward] in device_copies.py).
                self.to_host.drain()
            self.end_backward()
            self.backward_passes += 1

    def abandon_backward(self) -> None:
        """After a backward that raised (autograd runs no callback then)."""
        if self.grad_buckets is not None:
            self.grad_buckets.discard()  # no collective the other ranks may never join
        if self.to_host is not None:
            self.to_host.discard()
        if self._backward_tasks:
            self._backward_tasks.clear()
            self.end_backward()

    @property
    def in_forward(self) -> bool:
        return self._context_depth > 0

    closed = False  # set by the engine's close when the values were not given back

    def write_edit(self, shard: Shard) -> None:
        """The held parameter was edited: its partition goes home, and to the optimizer."""
        self._internal = True
        try:
            shard.write_home()
            if self.hooks is not None:
                self.hooks.edited(shard, shard.gathered_partition().float())
        finally:
            self._internal = False

    def gather_on_use(self, shard: Shard) -> None:
        self.hold(shard)
        self._on_demand.append(shard)

    # ---- saved tensors ---------------------------------------------------
    # Hook point: the engine's offload.activations.ActivationSaver, given every
    # saved tensor that is not a parameter (Note [activation bytes]); None: kept as is.
    activations = None

    def _pack(self, t: torch.Tensor):
        with _bookkeeping():
            shard = None
            if self._live and t.layout == torch.strided and t.device.type != "meta":
                shard = self._live.get(t.untyped_storage().data_ptr())
            if shard is not None:
                if t.dtype != shard.dtype or shard.home is Tier.DEVICE:
                    return t
                # The offset from the start of the gathered buffer: the next gather's
                # buffer starts at its own place in its own storage (aligned buffers).
                return _SavedParamView(shard, t.size(), t.stride(),
                                       t.storage_offset() - shard.full_storage_offset())
        # Outside _bookkeeping: the saver detaches t, which keeps a subclass its type.
        return t if self.activations is None else self.activations.pack(t)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParamView):
            return saved if self.activations is None else self.activations.unpack(saved)
        with _bookkeeping():  # a recomputation's unpack runs inside forward_context
            self._note_backward()
            shard = saved.shard
            data = self.hold(shard)
            view = data.as_strided(saved.size, saved.stride, shard.full_storage_offset() + saved.offset)
            if not shard.trainable and shard.gathers_to_a_buffer:
                # Note [frozen holds in backward]
                if self._lends_to_autograd(shard):
                    shard.lend_gathered_buffer()
                else:
                    view = view.clone()
                self.drop(shard)
                return view
            self._backward_holds[shard] = self._backward_holds.get(shard, 0) + 1
            return view

    @contextlib.contextmanager
    def forward_context(self, new_pass: bool = True, recomputing: bool = False):
        """Active around the outermost forward: on-demand gathering and saved-tensor records.
        new_pass=False: a recomputation inside backward (activation checkpointing),
        part of the pass under way (Note [prefetch order]). recomputing=True: run by
        another checkpoint function, whose saved-tensor hooks must stay innermost
        (Note [the model is the interface])."""
        if new_pass:
            if self._backward_tasks and torch._C._current_graph_task_id() == -1:
                self.abandon_backward()  # a backward that raised left its holds
            if self.hooks is not None:
                self.hooks.forward_starts()
            self._end_pass()
            self.prefetch.begin_pass((self.module.training, torch.is_grad_enabled()))
        active = contextlib.nullcontext() if self.activations is None else self.activations.active()
        saved = (contextlib.nullcontext() if recomputing
                 else torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        self._context_depth += 1
        self._recomputing += recomputing
        try:
            with GatherOnUse(self), saved, active:
                yield
        finally:
            self._context_depth -= 1
            self._recomputing -= recomputing
            with _bookkeeping():
                while self._on_demand:
                    shard = self._on_demand.pop()
                    if shard.held:
                        self._drop_or_hold(shard, hold=recomputing)

    # Note [frozen holds in backward]
    # A trainable parameter gathered again in backward (its value unpacked for a
    # gradient) is held until its gradient hook says its gradient is final. A
    # frozen one has no hook: held so, every frozen weight backward reads would
    # stay gathered to the end of backward (a LoRA of a 19B Llama with 21.6 GiB of
    # its base on NVMe was OOM-killed at 24 GB in its first backward). So a frozen
    # value gathered into a buffer is handed to autograd and the hold dropped at
    # once: on a CPU device the buffer itself, lent (Shard.lend_gathered_buffer:
    # never reused, freed when autograd lets go of it), beside a device with memory
    # of its own a copy (its buffers belong to the device layer's streams). The
    # lent bytes are not in the device tier's count while autograd holds them.
    # Frozen weights in a recomputed forward (activation checkpointing) are still
    # held to the end of backward: autograd saves the parameter itself there (a
    # leaf), so its `.data` must stay the gathered value until its node has run,
    # and nothing says when that is.
    def end_backward(self) -> None:
        """After backward: drop holds whose gradient hook never ran (frozen params)."""
        for shard, count in list(self._backward_holds.items()):
            for _ in range(count):
                self.drop(shard)
        self._backward_holds.clear()
        self._end_pass()

    def _end_pass(self) -> None:
        """Releases what the prefetcher kept (for reuse, or read ahead and not used)."""
        self._internal = True
        try:
            for shard in self.prefetch.end_pass():
                if shard.refs > 0:
                    shard.release()  # the scheduler's reference
                elif shard.residency is not Residency.RELEASED:
                    shard.force_release()
                if not shard.held:
                    self._track(shard)
                    self.prefetch.on_released(shard)
        finally:
            self._internal = False

    def reclaim_device(self, nbytes: int) -> None:
        """A charge on the device tier would pass the budget: releases what only
        the prefetcher holds (Note [prefetch within the device budget])."""
        internal, self._internal = self._internal, True
        try:
            with _bookkeeping():
                for shard in self.prefetch.reclaim():
                    if shard.refs > 0:
                        shard.release()  # the scheduler's reference
                    elif shard.residency is not Residency.RELEASED:
                        shard.force_release()  # a read ahead: waits for its bytes, then frees them
                    if not shard.held:
                        self._track(shard)
                        self.prefetch.on_released(shard)
        finally:
            self._internal = internal

    def release_all(self) -> None:
        self.prefetch.end_pass()
        self._internal = True
        try:
            for shard in self.shards:
                shard.force_release()
                self._track(shard)
                self.prefetch.on_released(shard)
        finally:
            self._internal = False
        for pending in (self._backward_holds, self._on_demand, self._backward_tasks):
            pending.clear()
        if self.grad_buckets is not None:
            self.grad_buckets.discard()
        if self.to_host is not None:
            self.to_host.discard()

    def remove_hooks(self) -> None:
        for h in self._handles + [h for hs in self._module_handles.values() for h in hs]:
            h.remove()
        self._handles.clear()
        self._module_handles.clear()
        if self.to_host is not None:
            self.to_host.close()  # its pinned buffers and their charge
        if self._account is not None:
            self._account.remove_reclaimer(Tier.DEVICE)
        # Closing: no cycles left through what it attached (Note [a closed engine] in offload/engine/closed.py).
        self.activations = self.hooks = None
