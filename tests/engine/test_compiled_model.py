"""torch.compile around a model the engine manages (Note [compiled models] in
offload/partition/compiled_model.py): the step stays right, and the first traced call
warns once, naming what to do instead; an eager run says nothing."""
import copy
import warnings

import pytest
import torch

import offload
from offload.partition.compiled_model import COMPILED_MODEL_WARNING

from tests.support.harness import batches, build, lm_loss, make_config

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)


def _train(model, cfg, data, compile_it):
    with offload.initialize(model, cfg) as engine, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # backend="eager": dynamo traces as any backend does, without a compiler's minutes
        forward = torch.compile(model, backend="eager") if compile_it else model
        losses = []
        for per_rank in data:
            x, y = per_rank[0]
            loss = lm_loss(forward(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
    return torch.stack(losses), [w for w in caught if str(w.message) == COMPILED_MODEL_WARNING]


def test_a_compiled_model_trains_the_same_and_is_warned_about_once(tmp_path):
    model, data = build("tiny_gpt"), batches(3, seed=4)
    eager, said = _train(copy.deepcopy(model), make_config("cpu", "cpu", tmp_path / "a"), data, False)
    assert said == []
    compiled, said = _train(copy.deepcopy(model), make_config("cpu", "cpu", tmp_path / "b"), data, True)
    assert len(said) == 1 and said[0].category is RuntimeWarning
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
