"""A Hugging Face Llama through Trainer with the config's `compile` section (Note
[compiled blocks] in offload/compile/blocks.py): the decoder layers compiled at
initialize, no graph break inside them, and Trainer's losses and the weights equal
to plain Trainer with the same layers compiled the same way."""
import pytest
import torch
from torch._dynamo.utils import counters

import offload
from tests.support.layer_under_test import exact, test_device

pytestmark = [pytest.mark.any_device, pytest.mark.torch_release]  # Note [the device a test runs on] (tests/conftest.py)
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integrations.test_hf_trainer import _args, _data, _decay_groups, _model, _nvme_config  # noqa: E402

BACKEND = "aot_eager"  # AOTAutograd's forward and backward graphs, exact, without a compiler's minutes


def _layers(model):
    return [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def _losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.slow
def test_trainer_with_the_config_compile_section_matches_plain_trainer_compiled_the_same_way(tmp_path):
    torch._dynamo.reset()
    plain = _model()
    for layer in _layers(plain):
        layer.forward = torch.compile(type(layer).forward.__get__(layer), backend=BACKEND)
    trainer = transformers.Trainer(model=plain, args=_args(tmp_path / "plain"),
                                   train_dataset=_data())
    trainer.train()
    plain_losses = _losses(trainer)

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    cfg = _nvme_config(tmp_path / "nvme")
    cfg["compile"] = {"modules": ["LlamaDecoderLayer"], "backend": BACKEND}
    engine = offload.initialize(model, cfg, param_groups=_decay_groups(model))
    with engine:
        assert len(engine.compiled_blocks) == len(_layers(model)) == 2
        schedule = transformers.get_linear_schedule_with_warmup(engine.optimizer, 0, 8)
        trainer = transformers.Trainer(model=model, args=_args(tmp_path / "run"),
                                       train_dataset=_data(), optimizers=(engine.optimizer, schedule))
        trainer.train()
        weights = engine.full_state_dict(master=True)
    assert dict(counters["graph_break"]) == {}, "a graph break inside a compiled decoder layer"
    assert len(plain_losses) == 8
    torch.testing.assert_close(_losses(trainer), plain_losses, **exact())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name].cpu(), p.detach().cpu(), **exact(), msg=lambda m: f"{name}: {m}")
