"""Activation checkpointing and activation memory accounting.

    offload.checkpoint(fn, *args, **kwargs)   recompute fn in backward
    {"activation_checkpointing": {"modules": ["Block"], "cpu_checkpointing": true}}

recompute.py: the recomputation (Note [activation checkpointing]); saver.py:
saved activations charged to the device tier, checkpoint inputs kept on the
host (Note [activation bytes]); wrap.py: modules checkpointed by class name
(Note [checkpointed modules]).
"""
from offload.activations.recompute import checkpoint
from offload.activations.saver import ActivationSaver
from offload.activations.wrap import ActivationCheckpointing

__all__ = ["checkpoint", "ActivationSaver", "ActivationCheckpointing"]
