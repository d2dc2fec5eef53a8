"""The training step, owned by one object: StepRunner.

It holds everything a step is in the middle of: the phase (Note [step
phases] in step/phase.py), the counters (Note [step counters]), the
accumulation boundary, whether the last step applied its update, the global
gradient norm (Note [global gradient norm] in step/grad_norm.py), the loss
scaler and the LR schedule. The optimizer (offload/optim) keeps the update's
arithmetic and its state; the engine (offload/engine) builds the runner and
hands it every call of the step. Checkpoints take its state_dict().

How one training step flows (see docs/ARCHITECTURE.md for the whole picture):
  engine(*inputs)       forward; ParameterManager gathers each module's
                        parameters as it runs and releases them after
                        (Note [when parameters are gathered]); at its
                        start, forward_starts() refuses a forward the step
                        cannot take
  engine.backward(loss) loss * (loss_scale / gradient_accumulation_steps)
                        backward; each parameter's gradient, once complete,
                        is averaged over ranks and added to its shard's fp32
                        partition on the optimizer's tier (take_grad), then
                        freed; where updates run in backward they start here
  engine.step()         at an accumulation boundary: fp16 overflow check,
                        clipping by the global norm, the ShardedAdam update
                        (Note [optimizer state tiers]), LR schedule
When updates run is Note [when updates run] and their names Note [update
names], both in step/update_policy.py.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from offload.transfers.device_copies import NO_PLAN, BackwardPlan
from offload.process_memory import release_free_host_memory
from offload.step.counters import StepCounters
from offload.step.grad_norm import GradNorm
from offload.step.gradients import all_finite, clip_by_global_norm, clip_coefficient
from offload.step.phase import StepPhase, StepPhases
from offload.step.update_policy import UpdatePolicy
from offload.step.updates import DeferredUpdates, OverlappedUpdates
from offload.tiers import Tier

log = logging.getLogger("offload")


class StepRunner:
    """One engine's training step: its state and every transition of it."""

    def __init__(self, *, config, shards, pg, device: torch.device, account, timeline, manager, optimizer,
                 policy: UpdatePolicy, stores, uses_nvme: bool, loss_scaler, lr_scheduler,
                 before_update: Callable[[], None], host_worker):
        """before_update(): called before any update writes (Note [consistent async
        checkpoint] in checkpoint_io/save.py). host_worker: where updates beside backward
        and the next forward run (Note [the host worker] in offload/host_worker.py)."""
        self.config, self.shards, self.pg, self.device = config, shards, pg, device
        self.timeline, self.manager, self.optimizer, self.policy = timeline, manager, optimizer, policy
        self._stores, self._uses_nvme, self._before_update = stores, uses_nvme, before_update
        self.loss_scaler = loss_scaler
        self.lr_scheduler = lr_scheduler
        self.phases = StepPhases()  # Note [step phases]; a failed update's (error, clipped norm) kept there
        self.counters = StepCounters()  # Note [step counters]
        # The update schedulers (Note [update names] in step/update_policy.py); the
        # optimizer reaches them only through its driver (optim/driver.py).
        largest = max((s.part_numel for s in optimizer.shards), default=1)
        self.in_backward = OverlappedUpdates(optimizer, host_worker, pending_grad_elems=policy.pending_cap(largest))
        self.deferred = DeferredUpdates(optimizer, host_worker)
        self.grad_norm = GradNorm(optimizer, self.deferred, pg, device, shards, account)
        self.boundary: bool | None = None  # set_gradient_accumulation_boundary; None: by micro_steps
        self.step_applied = False  # whether the last step() updated the parameters
        self._in_engine_step = False  # optimizer.step() reached through engine.step()

    # ---- where the step is ---------------------------------------------------
    @property
    def phase(self) -> StepPhase:
        return self.phases.phase

    def accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_boundary(self) -> bool:
        """Whether the next step() applies the update."""
        if self.boundary is not None:
            return self.boundary
        return (self.counters.micro_steps + 1) % self.accumulation_steps() == 0

    @property
    def gradients_pending(self) -> bool:
        """Whether a backward since the last update left gradients not yet applied."""
        return any(s.gradient.pending for s in self.shards)

    def state_dict(self) -> dict:
        """What a checkpoint saves of the step: the counters and the loss scale."""
        return {**self.counters.state_dict(),
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, state: dict, *, window: bool, steps: bool, loss_scale: bool) -> None:
        """A checkpoint's counters (and loss scale); the step is back at READY, with no
        gradients but the window's where window (Note [saving inside an accumulation window])."""
        if loss_scale and self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.counters.load_state_dict(state, backward_passes=self.manager.backward_passes, window=window,
                                      steps=steps)

    def refuse_save_mid_step(self) -> None:
        """Note [saving inside an accumulation window] (checkpoint_io/save.py): after any
        step(), not between a backward and the step() that counts it."""
        c = self.counters
        if self.phases.updating_in_backward or (self.gradients_pending and (
                c.micro_in_window == 0 or self.manager.backward_passes != c.passes_at_step)):
            raise RuntimeError(
                f"save_checkpoint between a backward and the engine.step() that counts it (micro-step "
                f"{c.micro_steps}, gradient_accumulation_steps {self.accumulation_steps()}): "
                "call engine.step() first. Inside an accumulation window a save after step() keeps the "
                "gradients accumulated so far; with your own loop (loss.backward(), optimizer.step()), "
                "save after optimizer.step()")

    def settle(self) -> None:
        """No update running, in backward or deferred (before checkpoint files are rewritten)."""
        if self.phases.updating_in_backward:
            self._abandon_in_backward()
        self.deferred.settle()

    def finish_updates(self) -> None:
        """At engine.close: every update started has run, those of a backward no step()
        followed (their error raised), then those under the next forward (their error,
        already raised to whatever read the shard, logged)."""
        if self.in_backward.active:
            self.in_backward.finish()
        try:
            self.deferred.settle()
        except Exception:  # noqa: BLE001 - the shard's reads raised it; close goes on
            log.exception("engine.close(): an update left running under the next forward failed")

    def adopted(self, shard) -> None:
        """A shard unfrozen since the optimizer was made has state now (Note [unfreezing] in
        engine/unfreeze.py): its gradients join the updates in backward."""
        # Never under one partition (Note [when updates run]); the budgets reserved no more.
        self.in_backward.pending_grad_elems = max(self.in_backward.pending_grad_elems, shard.part_numel)
        self.in_backward.arrival_order = None  # learned again, with this shard's gradient in it

    def loaded(self) -> None:
        """After a checkpoint load: every key was rewritten, a failed step's retry is moot."""
        self.phases.to_ready(StepPhase.READY, StepPhase.UPDATING_DEFERRED, StepPhase.FAILED)

    # ---- forward and backward ---------------------------------------------------
    def forward_starts(self) -> None:
        """A forward opens: refused after a failed step, or between the window's last backward and step()."""
        self.refuse_after_failed_step("a forward")
        if self.phases.updating_in_backward:
            raise RuntimeError(
                "engine.step() must follow engine.backward() before the next forward: at a gradient "
                "accumulation boundary the optimizer update runs during backward (Note [optimizer "
                "overlap]) and step() completes it")

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        self.refuse_after_failed_step("engine.backward()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("engine.backward(loss) takes a scalar loss tensor")
        # No check of module.training: backward in eval mode is plain PyTorch's too (a model
        # from from_pretrained starts in it); eval mode only turns dropout and the like off.
        if not loss.requires_grad:
            raise RuntimeError("loss does not require grad: was the forward run under "
                               "torch.no_grad() or with every parameter frozen?")
        if self.phases.updating_in_backward:
            raise RuntimeError(
                "engine.backward() called again before engine.step(): this window's last backward "
                "already started the optimizer update (Note [optimizer overlap]); call step() first")
        scale = 1.0 / self.accumulation_steps()
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        self.deferred.settle()  # the last step's updates, before new gradients arrive
        self.grad_norm.settle()  # summed by those updates (Note [global gradient norm])
        if self.phases.phase is StepPhase.UPDATING_DEFERRED:
            self.phases.to_ready(StepPhase.UPDATING_DEFERRED)
        if self.policy.during_backward(self.optimizer.states.state_tiers, at_boundary=self.is_boundary()):
            # Updates start during this backward: an async checkpoint must have
            # read what it saves first (Note [consistent async checkpoint]).
            self._before_update()
            self.optimizer.grad_sq = 0.0
            self.in_backward.begin()
            self.phases.to_updating_in_backward()
            self._plan_backward(carried=self._carried())
        # Note [norm terms during backward] (step/gradients.py)
        self.grad_norm.take_terms(self.config.gradient_clipping > 0 and self.loss_scaler is None
                                  and self._deferred() and self.is_boundary())
        try:
            with self.timeline.span("backward"):
                (loss * scale).backward()
        except BaseException:
            self.manager.abandon_backward()
            if self.phases.updating_in_backward:
                self._abandon_in_backward()
            raise
        if self.loss_scaler is not None:
            self.counters.scaled_passes += 1
        return loss  # as DeepSpeed's engine.backward: scripts log what it returns

    def _deferred(self) -> bool:
        """Whether step() may defer its updates under the next forward (Note [update names])."""
        return self.policy.deferred(self.optimizer.states.state_tiers, [s.home for s in self.shards])

    def _carried(self) -> bool:
        """Whether this backward's updates may be carried under the next forward (Note [head
        first after backward] in transfers/device_copies.py)."""
        return self.manager.to_host is not None and self.policy.carried(
            self.optimizer.states.state_tiers, [s.home for s in self.shards], world_size=self.pg.job_size)

    def _plan_backward(self, carried: bool) -> None:
        """The copy-down path's plan for this backward (BackwardPlan, transfers/device_copies.py): each gradient
        going down is followed by its update (or not)."""
        to_host = self.manager.to_host
        if to_host is None:
            return
        if not carried:
            to_host.begin_backward(NO_PLAN)
            return
        deferred, step = self.deferred, self.in_backward.step
        to_host.begin_backward(BackwardPlan(follow=lambda shard, taken_in: deferred.follow(shard, taken_in, step)))

    def _abandon_in_backward(self) -> None:
        # A failed backward after some updates ran: wait for them so no thread
        # is left writing, then report the original error. Those shards were
        # updated with final gradients, as step() would have done; the others
        # keep their gradients.
        self._plan_backward(carried=False)
        try:
            self.in_backward.abandon()
        except Exception:  # noqa: BLE001 - the backward error is the one to raise
            log.exception("while finishing optimizer updates after a failed backward")
        finally:
            self.phases.to_ready(StepPhase.UPDATING_IN_BACKWARD)

    # ---- step ---------------------------------------------------------------------
    def step(self) -> None:
        if self.phases.failed:
            self._boundary_update()
            return
        if self.manager.backward_passes == self.counters.passes_at_step:
            raise RuntimeError("engine.step() called without a backward since the last step "
                               "(engine.backward(loss) or loss.backward())")
        self.counters.passes_at_step = self.manager.backward_passes
        boundary = self.is_boundary()  # DeepSpeed's: asked before counting
        self.counters.micro_steps += 1
        self.step_applied = False
        if not boundary:
            self.counters.micro_in_window += 1
            return
        self._boundary_update()

    def _boundary_update(self) -> None:
        # Through optimizer.step(), so that a torch LR scheduler on it sees the step.
        self._in_engine_step = True
        skipped = self.counters.skipped_steps
        try:
            self.optimizer.step()
        finally:
            self._in_engine_step = False
        self.counters.micro_in_window = 0
        self.step_applied = self.counters.skipped_steps == skipped
        self.zero_grads()

    def refuse_after_failed_step(self, what: str) -> None:
        if self.phases.failed:
            error = self.phases.failure[0]
            raise RuntimeError(
                f"{what} after a failed engine.step() ({type(error).__name__}: {error}): call engine.step() "
                "again to retry it (the shards it did not update keep their gradients, values whose write "
                "failed are held in memory), or engine.load_checkpoint(...)")

    def _applying(self, update, clipped_norm: float | None = None) -> None:
        """Runs the optimizer's update; one that raises leaves the step to retry (Note [a failed step])."""
        try:
            update()
        except BaseException as exc:
            self.phases.to_failed(exc, clipped_norm)
            exc.add_note("engine.step() again retries this step (after freeing disk space, say); "
                         "engine.load_checkpoint(...) restores the last checkpoint")
            raise

    def _retry_update(self) -> None:
        """Note [a failed step]: the values whose write failed go to disk first, then the
        shards the failed step did not update are; the step then ends as it would have."""
        _, clipped_norm = self.phases.failure
        self._applying(self._rewrite_unwritten, clipped_norm)
        self._applying(self._apply, clipped_norm)
        self.phases.to_ready(StepPhase.FAILED)
        self._finish_update(clipped_norm)

    def _rewrite_unwritten(self) -> None:
        for store in self._stores:
            store.rewrite_unwritten()

    def update(self) -> None:
        """The whole update: engine.step() at a boundary, and engine.optimizer.step()
        from a user's loop (Note [the optimizer users drive] in optim/sharded_adam.py)."""
        from_engine_step = self._in_engine_step
        if self.phases.failed:
            self._retry_update()
            return
        to_host = self.manager.to_host
        if self.phases.updating_in_backward and to_host is not None and to_host.plan.carried:
            # Note [head first after backward] (transfers/device_copies.py): they are carried.
            self._plan_backward(carried=False)
            to_host.head_first()
            self.in_backward.carry([u.shard for u in self.deferred.pending])
            self.phases.to_ready(StepPhase.UPDATING_IN_BACKWARD)
            self.phases.to_updating_deferred()
            self._finish_update()
            return
        if self.phases.updating_in_backward:
            self._applying(self._apply)  # waits for the updates that ran during backward
            self.phases.to_ready(StepPhase.UPDATING_IN_BACKWARD)
            self._finish_update()
            return
        for s in self.shards if self.pg.replicas > 1 else ():  # a loop that steps the optimizer itself
            s.gradient.sum_share_across()  # (Note [gradients across groups once a window])
        c = self.counters
        if self.loss_scaler is not None:
            unscaled = self.manager.backward_passes - c.passes_at_update - c.scaled_passes
            if not from_engine_step or unscaled:
                what = ("engine.optimizer.step() was called" if not from_engine_step
                        else f"{unscaled} backward pass(es) ran outside engine.backward")
                raise RuntimeError(
                    f"fp16 with loss scaling: {what}. Gradients must come from engine.backward(loss), "
                    "which scales the loss, and be applied by engine.step(), which unscales them and "
                    "skips overflowed steps. To drive the optimizer from your own loop, use bf16")
            overflow = self.pg.any_flag(not all_finite(self.shards), self.device)
            c.passes_at_update, c.scaled_passes = self.manager.backward_passes, 0
            if overflow:
                self.loss_scaler.update(True, c.global_steps + c.skipped_steps + 1)
                c.skipped_steps += 1
                self.zero_grads()
                return
            for s in self.shards:  # unscale with the scale backward used
                if s.gradient.pending:
                    s.gradient.part.div_(self.loss_scaler.scale)
            self.loss_scaler.update(False, c.global_steps + c.skipped_steps + 1)
        self.grad_norm.settle()  # the last update's, before this one's sum starts
        clipped_norm, coef, defer = None, None, self._deferred()
        terms = self.grad_norm.taken_terms()
        clip = self.config.gradient_clipping
        if clip > 0 and defer:  # the coefficient goes with each update
            clipped_norm, coef = clip_coefficient(self.shards, clip, self.device, self.pg, terms)
        elif clip > 0:
            clipped_norm = clip_by_global_norm(self.shards, clip, self.device, self.pg)
        self.optimizer.grad_sq = 0.0
        self._before_update()  # Note [consistent async checkpoint] (offload/checkpoint_io/save.py)
        if defer:  # Note [updates under the next forward] (offload/step/updates.py)
            self.deferred.start(self.shards, grad_scale=coef)
            self.phases.to_updating_deferred()
        else:
            self._applying(self._apply, clipped_norm)
        self._finish_update(clipped_norm)

    def _apply(self) -> None:
        """Finishes the updates that ran during backward (Note [optimizer overlap] in
        step/updates.py), or runs every update here, in step()."""
        if self.in_backward.active:
            self.in_backward.finish()
            return
        self.deferred.settle()
        self.optimizer.update()

    def _finish_update(self, grad_norm: float | None = None) -> None:
        self.grad_norm.record(grad_norm)  # Note [global gradient norm] (step/grad_norm.py)
        if self._uses_nvme:
            # Host memory is what an NVMe run is short of, and its step waits on
            # the disk anyway (Note [engine bytes and the OS]).
            release_free_host_memory()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        c = self.counters
        c.global_steps += 1
        self.timeline.end_step()
        # DeepSpeed's logging keys; with wall_clock_breakdown and no steps_per_print, its default of 10.
        every = self.config.steps_per_print or (10 if self.config.wall_clock_breakdown else None)
        if every and c.global_steps % every == 0 and self.pg.job_rank == 0:
            scale = f", loss scale {self.loss_scaler.scale:g}" if self.loss_scaler is not None else ""
            _progress("step %d: lr %g%s, %d skipped", c.global_steps, self.optimizer.param_groups[0]["lr"],
                      scale, c.skipped_steps)
            if self.config.wall_clock_breakdown:
                tl = self.timeline.last_step()
                _progress("step %d took %.3f s: %s", c.global_steps, tl["wall_s"],
                          ", ".join(f"{k} {v:.3f} s" for k, v in tl["seconds"].items()))

    # ---- gradients -----------------------------------------------------------
    def take_grad(self, shard, grad: torch.Tensor, owned: bool = False, carried: bool = False,
                  master: torch.Tensor | None = None) -> None:
        """carried: the gradient went down in a backward whose step has ended, its update
        still to run (Note [head first after backward] in transfers/device_copies.py).
        master: the parameter's partition that came down with it (Note [masters down
        with their gradients]), valid during the call."""
        in_backward = carried or self.phases.updating_in_backward
        if in_backward and self.policy.from_staging(shard, grad, self.optimizer.states.state_tier(shard)):
            # Note [updates from the staging buffer] (step/gradients.py): no copy into the partition.
            kept = shard.gradient.lend(grad)
            try:
                self.in_backward.submit(shard, carried=carried)  # on the host worker: updates now
            finally:
                shard.gradient.restore(kept)  # not updated (a failed step): kept for the retry
            return
        shard.gradient.take(grad, owned=owned)
        terms = self.grad_norm.terms
        if terms is not None:  # on the host worker (Note [norm terms during backward])
            terms.take(shard)
        if in_backward and shard.gradient.tier is not Tier.DEVICE:
            # State on the device: updated at step() (in_backward.finish).
            self.in_backward.submit(shard, carried=carried, master=master)

    def brings_master(self, shard) -> bool:
        """Whether the parameter's partition goes down with this gradient: its update
        follows the take-in and takes the master from it (Note [masters down with their
        gradients] in transfers/device_copies.py)."""
        return self.phases.updating_in_backward and self.optimizer.states.shares_master(shard)

    def zero_grads(self) -> None:
        for s in self.shards:
            s.gradient.clear()


def _progress(msg: str, *args) -> None:
    """steps_per_print's line: on the `offload` logger where the script configured logging,
    else printed, as DeepSpeed's own logger (which has a handler of its own) shows it."""
    if log.hasHandlers():  # the script's logging decides, its level included
        log.info(msg, *args)
    else:
        print("[offload] " + msg % args, flush=True)
