"""Lightning drives the engine with no Strategy of ours: a LightningModule whose
configure_optimizers returns engine.optimizer (a torch optimizer over the model's
parameters) trains like plain PyTorch, gradient clipping and accumulation
included. Skipped without lightning."""
import copy

import pytest
import torch

import offload
from tests.support.harness import batches, build, lm_loss, make_config

L = pytest.importorskip("lightning")


class _Module(L.LightningModule):
    def __init__(self, model, make_optimizer):
        super().__init__()
        self.model = model
        self.make_optimizer = make_optimizer

    def training_step(self, batch, index):
        x, y = batch
        return lm_loss(self.model(x), y)

    def configure_optimizers(self):
        return self.make_optimizer(self.model)


def _fit(module, data):
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.05,
                        accumulate_grad_batches=2)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))


@pytest.mark.slow
def test_a_lightning_module_over_engine_optimizer_trains_like_pytorch(tmp_path):
    data = [(x, y) for ((x, y),) in batches(8, seed=4)]
    base = build("tiny_gpt")
    plain = copy.deepcopy(base)
    _fit(_Module(plain, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)),
         data)
    model = copy.deepcopy(base)
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path)) as engine:
        _fit(_Module(model, lambda m: engine.optimizer), data)
        weights = engine.full_state_dict(master=True)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
