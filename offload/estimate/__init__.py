"""`offload estimate`: bytes per tier, and the minimum device, host and NVMe,
for a model size and a configuration, before anything is allocated.

    est = estimate(7e9, config="ds.json", world_size=8)
    est = estimate(model_config="config.json", config={...}, trainable="adapter_config.json")
    print(est.format())

memory_model.py    Note [memory model]: bytes per tier per rank, the auto plan (Estimate, estimate)
model_shapes.py    a model's counts (ModelSizes) from a size or a Hugging Face config.json, adapters added
hf_config.py       a config.json read module by module: parameters, ties, the largest layer
trainable.py       Note [trainable share]: a count, a fraction, or a PEFT adapter config
cli.py             the command line
"""
import sys
import types

from offload.estimate.cli import add_arguments, main, run
from offload.estimate.hf_config import ModelSizes
from offload.estimate.memory_model import Estimate, estimate
from offload.estimate.model_shapes import model_sizes
from offload.estimate.trainable import parse_count

__all__ = ["Estimate", "ModelSizes", "add_arguments", "estimate", "main", "model_sizes", "parse_count", "run"]


class _CallableModule(types.ModuleType):
    """`offload.estimate` names both this package and its function: offload's lazy
    attribute gives the function until the package is imported, after which the
    package sits in its place. Called, the package is the function, so
    `offload.estimate(7e9, ...)` works whichever one the name holds."""

    def __call__(self, *args, **kwargs) -> Estimate:
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
