"""Sizing a run before it starts (`offload estimate`, the function `offload.estimate`):
bytes per tier, and the minimum device, host and NVMe, for a model size and a
configuration, before anything is allocated; the activations forward saves.

    est = estimate(7e9, config="ds.json", world_size=8)
    est = estimate(model_config="config.json", config={...}, trainable="adapter_config.json")
    print(est.format())

memory_model.py    Note [memory model]: bytes per tier per rank, the auto plan (Estimate, estimate)
model_shapes.py    a model's counts (ModelSizes) from a size or a Hugging Face config.json, adapters added
hf_config.py       a config.json read module by module: parameters, ties, the largest layer
trainable.py       Note [trainable share]: a count, a fraction, or a PEFT adapter config
activations.py     Note [activation estimate]: saved-activation bytes, the forward on fake tensors
cli.py             the command line
"""
from offload.sizing.cli import add_arguments, main, run
from offload.sizing.hf_config import ModelSizes
from offload.sizing.memory_model import Estimate, estimate
from offload.sizing.model_shapes import model_sizes
from offload.sizing.trainable import parse_count

__all__ = ["Estimate", "ModelSizes", "add_arguments", "estimate", "main", "model_sizes", "parse_count", "run"]
