"""What a closed engine answers.

Note [a closed engine]
engine.close() waits for the work in flight, gives each parameter its value
back as a plain tensor when the model fits in memory (else reads of it raise,
naming why: Note [reading a parameter outside the engine] in
offload/partition/managed.py), removes the hooks and swap files and releases
the process group (Note [releasing the process group]). Then the engine and
its optimizer are closed off: `close_off` gives each a subclass of its class
whose public attributes (methods, properties, counters) raise
EngineClosedError, so every public method, present or added later, refuses
alike and nothing reaches a store whose files are gone (`full_state_dict()`
raised AttributeError from a closed file before). Only `close()` (a no-op
again), `module` (the model, with its values back), `config` and the step
counters still answer (ANSWERED_AFTER_CLOSE).
Costs nothing while the engine is open: its own class is untouched until close.

To keep the weights of a model too large to be given back, save before
closing: engine.save_checkpoint(dir) (then offload.consolidate(dir, path)) or
engine.save_pretrained(dir).

What an engine hands to objects it owns (the manager's StepHooks, the
optimizer's UpdateDriver: EngineHooks in engine/hooks.py) holds it weakly: a
bound method would make a reference cycle through the engine, and an engine
kept alive by a cycle is destroyed only by the garbage collector, possibly at
the interpreter's exit, along with what it still holds.
"""
from __future__ import annotations



class EngineClosedError(RuntimeError):
    """A public method of an engine (or its optimizer) called after engine.close()."""


# The run's facts stay readable (logging after training): the model, the
# config, the step counters. Everything else raises.
ANSWERED_AFTER_CLOSE = frozenset({"close", "module", "config", "global_steps", "micro_steps", "skipped_steps",
                                  "placement"})

_closed_classes: dict[type, type] = {}


def close_off(obj, what: str, reason: str) -> None:
    """Note [a closed engine]: obj's public attributes raise EngineClosedError from now on.

    what: how the user reaches obj ("engine", "engine.optimizer"); reason: the
    line on what became of the parameters."""
    base = type(obj)
    if base in _closed_classes.values():
        return
    closed = _closed_classes.get(base)
    if closed is None:
        closed = _closed_classes[base] = type(f"Closed{base.__name__}", (base,), {
            "__getattribute__": _refuse_public, "__call__": _refuse_call, "__enter__": _refuse_enter,
            "__repr__": lambda self: f"<closed {base.__name__}>"})
    obj.__dict__["_closed_as"] = (what, reason)
    # A class swap: attribute lookup, the instance's own attributes included, goes through
    # the class's __getattribute__; a flag checked in every method would miss those.
    obj.__class__ = closed


def closed_error(obj, name: str) -> EngineClosedError:
    """The error `obj.name` raises once its engine is closed."""
    what, reason = object.__getattribute__(obj, "_closed_as")
    return EngineClosedError(f"{what}.{name}: this engine was closed (engine.close()); {reason}")


def _refuse_public(self, name: str):
    if name.startswith("_") or name in ANSWERED_AFTER_CLOSE:
        return object.__getattribute__(self, name)
    raise closed_error(self, name)


def _refuse_call(self, *args, **kwargs):
    raise closed_error(self, "__call__ (forward)")


def _refuse_enter(self):
    raise closed_error(self, "__enter__")
