"""The training step, a base of Engine: forward's entry, backward, step, the update
and its failure paths, and gradients taken in (Note [when updates run] in
engine/update_policy.py says when updates run; Note [step phases] where the step is).

How one training step flows (see docs/ARCHITECTURE.md for the whole picture):
  engine(*inputs)       forward; ParameterManager gathers each module's
                        parameters as it runs and releases them after
                        (Note [when parameters are gathered])
  engine.backward(loss) loss * (loss_scale / gradient_accumulation_steps)
                        backward; each parameter's gradient, once complete,
                        is averaged over ranks and added to its shard's fp32
                        partition on the optimizer's tier, then freed
  engine.step()         at an accumulation boundary: fp16 overflow check,
                        clipping by the global norm, the ShardedAdam update
                        (Note [optimizer state tiers]), LR schedule
"""
from __future__ import annotations

import logging
import torch

from offload.engine.gradients import NormTerms, all_finite, clip_by_global_norm, clip_coefficient
from offload.engine.step_phase import StepPhase
from offload.engine.memory import release_free_host_memory
from offload.tiers import Tier

log = logging.getLogger("offload")


class TrainingStep:
    """Engine's training step (a mixin: the attributes it reads are set by Engine.__init__)."""

    # ---- the training loop -------------------------------------------------
    def __call__(self, *args, **kwargs):
        """model(*args, **kwargs), timed: the model's own hooks gather its parameters
        (Note [the model is the interface] in partition/manager.py)."""
        self._check_open()
        with self._timeline.span("forward"):
            return self.module(*args, **kwargs)

    forward = __call__

    def _before_forward(self) -> None:
        self._check_open()
        self._unfreeze_if_asked()
        self._refuse_after_failed_step("a forward")
        if self.steps.updating_in_backward:
            raise RuntimeError(
                "engine.step() must follow engine.backward() before the next forward: at a gradient "
                "accumulation boundary the optimizer update runs during backward (Note [optimizer "
                "overlap]) and step() completes it")
        if self.activation_checkpointing.plan is not None:
            self.activation_checkpointing.plan.begin_forward(
                model_checkpoints=bool(getattr(self.module, "is_gradient_checkpointing", False)))

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of a scalar loss, scaled by 1 / gradient_accumulation_steps (and the fp16
        loss scale); at the window's last micro-batch the optimizer update starts during
        it, and step() completes it. Returns the loss as given."""
        self._check_open()
        self._refuse_after_failed_step("engine.backward()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("engine.backward(loss) takes a scalar loss tensor")
        # No check of module.training: backward in eval mode is plain PyTorch's too (a model
        # from from_pretrained starts in it); eval mode only turns dropout and the like off.
        if not loss.requires_grad:
            raise RuntimeError("loss does not require grad: was the forward run under "
                               "torch.no_grad() or with every parameter frozen?")
        if self.steps.updating_in_backward:
            raise RuntimeError(
                "engine.backward() called again before engine.step(): this window's last backward "
                "already started the optimizer update (Note [optimizer overlap]); call step() first")
        scale = 1.0 / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        self.optimizer.deferred.settle()  # the last step's updates, before new gradients arrive
        self._settle_grad_norm()  # summed by those updates (Note [global gradient norm])
        if self.steps.phase is StepPhase.UPDATING_UNDER_FORWARD:
            self.steps.to_ready(StepPhase.UPDATING_UNDER_FORWARD)
        if self._can_overlap():
            # Updates start during this backward: an async checkpoint must have
            # read what it saves first (Note [consistent async checkpoint]).
            self._before_update()
            self.optimizer.grad_sq = 0.0
            self.optimizer.overlap.begin()
            self.steps.to_updating_in_backward()
            self._follow_gradients(self._updates_outlast_backward())
        # Note [norm terms during backward] (engine/gradients.py)
        if self.config.gradient_clipping > 0 and self.loss_scaler is None and self._can_defer() \
                and self.is_gradient_accumulation_boundary():
            if self._norm_scratch is None:
                self._norm_scratch = NormTerms(max(s.part_numel for s in self.shards), self.account)
            self._norm_scratch.clear()
            self._norm_terms = self._norm_scratch
        else:
            self._norm_terms = None
        try:
            with self._timeline.span("backward"):
                (loss * scale).backward()
        except BaseException:
            self.manager.abandon_backward()
            if self.steps.updating_in_backward:
                self._abandon_overlap()
            raise
        if self.loss_scaler is not None:
            self.counters.scaled_passes += 1
        return loss  # as DeepSpeed's engine.backward: scripts log what it returns

    def _can_overlap(self) -> bool:
        """Whether this backward starts the updates (Note [when updates run])."""
        return self.update_policy.during_backward(self.optimizer.state_tiers,
                                                  at_boundary=self.is_gradient_accumulation_boundary())

    def _can_defer(self) -> bool:
        """Whether step() may leave its updates under the next forward (Note [when updates run])."""
        return self.update_policy.under_next_forward(self.optimizer.state_tiers, [s.home for s in self.shards])

    def _updates_outlast_backward(self) -> bool:
        """Whether this backward's updates may go on under the next forward (Note [head
        first after backward] in partition/device_copies.py)."""
        return self.manager.to_host is not None and self.update_policy.past_backward(
            self.optimizer.state_tiers, [s.home for s in self.shards], world_size=self.pg.world_size)

    def _follow_gradients(self, on: bool) -> None:
        """Each gradient going down is followed by the deferred updates (or no longer is)."""
        if self.manager.to_host is not None:
            deferred, step = self.optimizer.deferred, self.optimizer.overlap.step
            self.manager.to_host.gate = (lambda shard, taken_in: deferred.follow(shard, taken_in, step)) if on else None

    def _abandon_overlap(self) -> None:
        # A failed backward after some updates ran: wait for them so no thread
        # is left writing, then report the original error. Those shards were
        # updated with final gradients, as step() would have done; the others
        # keep their gradients.
        self._follow_gradients(False)
        try:
            self.optimizer.overlap.abandon()
        except Exception:  # noqa: BLE001 - the backward error is the one to raise
            log.exception("while finishing optimizer updates after a failed backward")
        finally:
            self.steps.to_ready(StepPhase.UPDATING_IN_BACKWARD)

    def step(self) -> None:
        """DeepSpeed's step: counts a micro-step; at the end of an accumulation window
        applies the update (as engine.optimizer.step()) and clears the gradients.
        After an update that raised, step() again (no new backward) retries it."""
        self._check_open()
        if self.steps.failed:
            self._boundary_update()
            return
        if self.manager.backward_passes == self.counters.passes_at_step:
            raise RuntimeError("engine.step() called without a backward since the last step "
                               "(engine.backward(loss) or loss.backward())")
        self.counters.passes_at_step = self.manager.backward_passes
        boundary = self.is_gradient_accumulation_boundary()  # DeepSpeed's: asked before counting
        self.micro_steps += 1
        self._step_applied = False
        if not boundary:
            self.counters.micro_in_window += 1
            return
        self._boundary_update()

    def _boundary_update(self) -> None:
        # Through optimizer.step(), so that a torch LR scheduler on it sees the step.
        self._in_engine_step = True
        skipped = self.skipped_steps
        try:
            self.optimizer.step()
        finally:
            self._in_engine_step = False
        self.counters.micro_in_window = 0
        self._step_applied = self.skipped_steps == skipped
        self._zero_grads()

    def _refuse_after_failed_step(self, what: str) -> None:
        if self.steps.failed:
            error = self.steps.failure[0]
            raise RuntimeError(
                f"{what} after a failed engine.step() ({type(error).__name__}: {error}): call engine.step() "
                "again to retry it (the shards it did not update keep their gradients, values whose write "
                "failed are held in memory), or engine.load_checkpoint(...)")

    def _applying(self, update, clipped_norm: float | None = None) -> None:
        """Runs the optimizer's update; one that raises leaves the step to retry (Note [a failed step])."""
        try:
            update()
        except BaseException as exc:
            self.steps.to_failed(exc, clipped_norm)
            exc.add_note("engine.step() again retries this step (after freeing disk space, say); "
                         "engine.load_checkpoint(...) restores the last checkpoint")
            raise

    def _retry_update(self) -> None:
        """Note [a failed step]: the values whose write failed go to disk first, then the
        shards the failed step did not update are; the step then ends as it would have."""
        _, clipped_norm = self.steps.failure
        self._applying(self._rewrite_unwritten, clipped_norm)
        self._applying(self.optimizer.update, clipped_norm)
        self.steps.to_ready(StepPhase.FAILED)
        self._finish_update(clipped_norm)

    def _rewrite_unwritten(self) -> None:
        for store in self._stores:
            store.rewrite_unwritten()

    def _update(self) -> None:
        """The engine's whole update: engine.step() at a boundary, and
        engine.optimizer.step() from a user's loop (Note [the optimizer users drive])."""
        self._check_open()
        from_engine_step = self._in_engine_step
        if self.steps.failed:
            self._retry_update()
            return
        to_host = self.manager.to_host
        if self.steps.updating_in_backward and to_host is not None and to_host.gate is not None:
            # Note [head first after backward] (partition/device_copies.py): they go on.
            self._follow_gradients(False)
            to_host.head_first()
            self.optimizer.overlap.leave_running([u.shard for u in self.optimizer.deferred.pending])
            self.steps.to_ready(StepPhase.UPDATING_IN_BACKWARD)
            self.steps.to_updating_under_forward()
            self._finish_update()
            return
        if self.steps.updating_in_backward:
            self._applying(self.optimizer.update)  # waits for the updates that ran during backward
            self.steps.to_ready(StepPhase.UPDATING_IN_BACKWARD)
            self._finish_update()
            return
        if self.loss_scaler is not None:
            unscaled = self.manager.backward_passes - self.counters.passes_at_update - self.counters.scaled_passes
            if not from_engine_step or unscaled:
                what = ("engine.optimizer.step() was called" if not from_engine_step
                        else f"{unscaled} backward pass(es) ran outside engine.backward")
                raise RuntimeError(
                    f"fp16 with loss scaling: {what}. Gradients must come from engine.backward(loss), "
                    "which scales the loss, and be applied by engine.step(), which unscales them and "
                    "skips overflowed steps. To drive the optimizer from your own loop, use bf16")
            overflow = self.pg.any_flag(not all_finite(self.shards), self.device)
            self.counters.passes_at_update, self.counters.scaled_passes = self.manager.backward_passes, 0
            if overflow:
                self.loss_scaler.update(True, self.global_steps + self.skipped_steps + 1)
                self.skipped_steps += 1
                self._zero_grads()
                return
            for s in self.shards:  # unscale with the scale backward used
                if s.has_grad:
                    s.grad_part.div_(self.loss_scaler.scale)
            self.loss_scaler.update(False, self.global_steps + self.skipped_steps + 1)
        self._settle_grad_norm()  # the last update's, before this one's sum starts
        clipped_norm, coef, defer = None, None, self._can_defer()
        terms, self._norm_terms = self._norm_terms, None
        if self.config.gradient_clipping > 0 and defer:  # the coefficient goes with each update
            clipped_norm, coef = clip_coefficient(self.shards, self.config.gradient_clipping, self.device,
                                                  self.pg, terms)
        elif self.config.gradient_clipping > 0:
            clipped_norm = clip_by_global_norm(self.shards, self.config.gradient_clipping, self.device, self.pg)
        self.optimizer.grad_sq = 0.0
        self._before_update()  # Note [consistent async checkpoint] (offload/checkpoint_io/save.py)
        if defer:  # Note [updates under the next forward] (offload/optim/overlap.py)
            self.optimizer.deferred.start(self.shards, grad_scale=coef)
            self.steps.to_updating_under_forward()
        else:
            self._applying(self.optimizer.update, clipped_norm)
        self._finish_update(clipped_norm)

    def _finish_update(self, grad_norm: float | None = None) -> None:
        self._record_grad_norm(grad_norm)  # Note [global gradient norm] (engine/deepspeed_methods.py)
        if self._placement.uses(Tier.NVME):
            # Host memory is what an NVMe run is short of, and its step waits on
            # the disk anyway (Note [engine bytes and the OS]).
            release_free_host_memory()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self._timeline.end_step()
        # DeepSpeed's logging keys; with wall_clock_breakdown and no steps_per_print, its default of 10.
        every = self.config.steps_per_print or (10 if self.config.wall_clock_breakdown else None)
        if every and self.global_steps % every == 0 and self.pg.rank == 0:
            scale = f", loss scale {self.loss_scaler.scale:g}" if self.loss_scaler is not None else ""
            _progress("step %d: lr %g%s, %d skipped", self.global_steps, self.optimizer.param_groups[0]["lr"],
                      scale, self.skipped_steps)
            if self.config.wall_clock_breakdown:
                tl = self._timeline.last_step()
                _progress("step %d took %.3f s: %s", self.global_steps, tl["wall_s"],
                          ", ".join(f"{k} {v:.3f} s" for k, v in tl["seconds"].items()))

    # ---- gradients -----------------------------------------------------------
    def _take_grad(self, shard, grad: torch.Tensor, owned: bool = False, trailing: bool = False,
                   master: torch.Tensor | None = None) -> None:
        """trailing: the gradient went down in a backward whose step has ended, its update
        still to run (Note [head first after backward] in partition/device_copies.py).
        master: the parameter's partition that came down with it (Note [masters down
        with their gradients]), valid during the call."""
        overlapped = trailing or self.steps.updating_in_backward
        if overlapped and self.update_policy.from_staging(shard, grad, self.optimizer.state_tier(shard)):
            # Note [updates from the staging buffer] (engine/gradients.py): no copy into the partition.
            kept, shard.grad_part, shard.has_grad = shard.grad_part, grad, True
            try:
                self.optimizer.overlap.submit(shard, trailing=trailing)  # on the host worker: updates now
            finally:
                staged, shard.grad_part = shard.grad_part, kept
                if shard.has_grad and staged is not None:  # not updated (a failed step): kept for the retry
                    shard.has_grad = False
                    shard.take_grad(staged)
            return
        shard.take_grad(grad, owned=owned)
        terms = self._norm_terms
        if terms is not None:  # on the host worker (Note [norm terms during backward])
            terms.take(shard)
        if overlapped and shard.grad_tier is not Tier.DEVICE:
            # State on the device: updated at step() (overlap.finish).
            self.optimizer.overlap.submit(shard, trailing=trailing, master=master)

    def _brings_master(self, shard) -> bool:
        """Whether the parameter's partition goes down with this gradient: its update
        follows the take-in and takes the master from it (Note [masters down with their
        gradients] in partition/device_copies.py)."""
        return self.steps.updating_in_backward and self.optimizer.shares_master(shard)

    @property
    def gradients_pending(self) -> bool:
        """Whether a backward since the last optimizer step left gradients not yet applied."""
        return any(s.has_grad for s in self.shards)

    def _zero_grads(self) -> None:
        for s in self.shards:
            s.clear_grad()


def _progress(msg: str, *args) -> None:
    """steps_per_print's line: on the `offload` logger where the script configured logging,
    else printed, as DeepSpeed's own logger (which has a handler of its own) shows it."""
    if log.hasHandlers():  # the script's logging decides, its level included
        log.info(msg, *args)
    else:
        print("[offload] " + msg % args, flush=True)
