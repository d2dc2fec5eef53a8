"""The engine's step phases (Note [step phases] in offload/step/phase.py):
each transition checks where it starts, and a run goes through the phases
the Note names, beside the sim device as beside the CPU."""
import pytest

import offload
from offload.step.phase import StepPhase, StepPhases

from tests.support.harness import batches, build, lm_loss, make_config


def test_a_transition_from_the_wrong_phase_is_refused():
    steps = StepPhases()
    steps.to_updating_in_backward()
    with pytest.raises(AssertionError, match="updating in backward"):
        steps.to_updating_deferred()
    steps.to_failed(OSError("disk full"), 1.5)
    assert steps.failed and steps.failure[1] == 1.5
    with pytest.raises(AssertionError, match="failed"):
        steps.to_updating_in_backward()
    with pytest.raises(AssertionError, match="failed"):
        steps.to_ready(StepPhase.UPDATING_IN_BACKWARD)  # a caller that expected another phase
    with pytest.raises(TypeError, match="names the phases"):
        steps.to_ready()
    steps.to_ready(StepPhase.FAILED)
    assert steps.phase is StepPhase.READY and steps.failure is None


@pytest.mark.parametrize("layer,clip,after_backward,after_step", [
    ("cpu", 0.0, StepPhase.READY, StepPhase.READY),  # host Adam beside a CPU backward: in step
    # during backward, then on under the next forward (Note [head first after backward])
    ("sim", 0.0, StepPhase.UPDATING_IN_BACKWARD, StepPhase.UPDATING_DEFERRED),
    ("sim", 0.05, StepPhase.READY, StepPhase.UPDATING_DEFERRED),
])
def test_a_run_goes_through_the_phases(tmp_path, monkeypatch, layer, clip, after_backward, after_step):
    monkeypatch.setenv("OFFLOAD_DEVICE", layer)
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path, clip=clip)) as engine:
        for per_rank in batches(2, seed=3):
            x, y = per_rank[0]
            engine.backward(lm_loss(engine(x), y))
            assert engine.step_runner.phase is after_backward
            engine.step()
            assert engine.step_runner.phase is after_step


def test_the_step_counters_save_and_load_as_one_object():
    """Note [step counters]: what a checkpoint keeps, and the pass marks taken from this
    process's count at load (a window not restored starts afresh)."""
    from offload.step.counters import StepCounters

    saved = StepCounters(global_steps=7, micro_steps=15, skipped_steps=1, micro_in_window=1, scaled_passes=1,
                         passes_at_step=40, passes_at_update=39).state_dict()
    assert saved == {"global_steps": 7, "micro_steps": 15, "skipped_steps": 1, "micro_in_window": 1,
                     "scaled_passes": 1}
    into = StepCounters()
    into.load_state_dict(saved, backward_passes=3)
    assert (into.global_steps, into.micro_in_window, into.passes_at_step, into.passes_at_update) == (7, 1, 3, 2)
    module_only = StepCounters(global_steps=2)
    module_only.load_state_dict(saved, backward_passes=3, window=False, steps=False)
    assert (module_only.global_steps, module_only.micro_in_window, module_only.scaled_passes) == (2, 0, 0)
    assert module_only.passes_at_update == 3
