"""What `offload` exports: each name documented (docs/reference.md renders the docstrings,
so a missing one is a blank entry), listed in docs/reference.md, and the errors the
engine raises importable from `offload` itself."""
import inspect
from pathlib import Path

import pytest

import offload

ROOT = Path(__file__).resolve().parents[1]


def _public_definitions():
    """(name, object) for every name of offload.__all__ and, for a class, each of its public
    methods and properties defined in offload (not those inherited from torch or Python)."""
    from offload.optim.cpu_adam import CPUAdam

    exported = {n: getattr(offload, n) for n in offload.__all__ if n != "__version__"}
    for name, obj in {**exported, "CPUAdam": CPUAdam}.items():
        yield name, obj
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        for member, value in inspect.getmembers(obj):
            if member.startswith("_") or not (callable(value) or isinstance(value, property)):
                continue
            owner = value.fget if isinstance(value, property) else value
            if str(getattr(owner, "__module__", "")).startswith("offload"):
                yield f"{name}.{member}", value


def test_every_public_name_has_a_docstring():
    missing = [name for name, obj in _public_definitions() if not (inspect.getdoc(obj) or "").strip()]
    assert missing == []


def test_docs_reference_lists_every_exported_name():
    reference = (ROOT / "docs" / "reference.md").read_text()
    absent = [n for n in offload.__all__ if n != "__version__" and f"`{n}" not in reference
              and f"offload.{n}" not in reference]
    assert absent == []


@pytest.mark.parametrize("name", ["ConfigError", "CheckpointError", "WeightsError", "EngineClosedError",
                                  "TierBudgetError", "SwapStoreError", "AioError", "CorruptFileError"])
def test_the_engines_errors_are_importable_from_offload(name):
    error = getattr(offload, name)
    assert issubclass(error, Exception) and error.__name__ == name and name in offload.__all__
    assert (inspect.getdoc(error) or "").strip()


def test_budget_errors_are_caught_by_their_exported_name(monkeypatch):
    """Refused at initialize (the state does not fit) and in forward (the activations do not):
    both a TierBudgetError, still a MemoryError."""
    import torch

    monkeypatch.setenv("OFFLOAD_DEVICE", "cpu")

    def config(budget, side):
        return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, "offload_param": {"device": side},
                                      "offload_optimizer": {"device": side}},
                "memory": {"device_budget": budget}}

    with pytest.raises(offload.TierBudgetError, match="device tier budget exceeded: this configuration needs"):
        offload.initialize(torch.nn.Linear(64, 64), config(1000, "none"))
    with offload.initialize(torch.nn.Linear(64, 64), config(40_000, "cpu")) as engine:
        with pytest.raises(offload.TierBudgetError, match="saved activation"):
            engine(torch.randn(256, 64)).tanh().square().mean()
    assert issubclass(offload.TierBudgetError, MemoryError)
