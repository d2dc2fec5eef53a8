"""Activation checkpointing: the same training as plain PyTorch without it,
activation bytes on the device tier against a closed form, nothing left
held after a step, and the config's refusals."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload
from offload.config import Config, ConfigError
from offload.partition.shard_context import Residency
from offload.tiers import Tier
from tests.support.harness import (batches, build, lm_loss, make_config, run_engine, run_reference,
                                  run_reference_mixed)
from tests.support.models import VOCAB, Block, TinyGPT

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)

CKPT = {"activation_checkpointing": {"modules": ["Block"]}}
CKPT_HOST = {"activation_checkpointing": {"modules": ["Block"], "cpu_checkpointing": True}}
STEPS = 6


def _assert_same(weights, ref_model):
    expected = dict(ref_model.named_parameters())
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name].detach(), msg=lambda m: f"{name}: {m}")


@pytest.mark.any_device  # Note [the device a test runs on] (tests/conftest.py)
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("extra", [CKPT, CKPT_HOST], ids=["device", "cpu_checkpointing"])
def test_fp32_checkpointed_blocks_match_pytorch(tmp_path, param, extra):
    model = build("tiny_gpt")
    data = batches(STEPS, seed=1)
    ref_model, ref_losses = run_reference(model, data, gas=2, clip=0.0, lr=1e-2, weight_decay=0.01)
    weights, losses, engine = run_engine(model, data, make_config(param, param, tmp_path, gas=2, extra=extra))
    torch.testing.assert_close(losses, ref_losses[:, 0])
    _assert_same(weights, ref_model)


@pytest.mark.any_device  # Note [the device a test runs on] (tests/conftest.py)
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_bf16_checkpointed_blocks_match_pytorch_mixed_precision(tmp_path, param):
    model = build("tiny_gpt")
    data = batches(STEPS, seed=2)
    ref_model, ref_losses = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=1, lr=1e-2,
                                                weight_decay=0.01)
    weights, losses, _ = run_engine(model, data, make_config(param, "cpu", tmp_path, precision="bf16",
                                                             extra=CKPT))
    torch.testing.assert_close(losses, ref_losses[:, 0])
    _assert_same(weights, ref_model)


class CheckpointsInForward(nn.Module):
    """Calls offload.checkpoint itself: the region reads the embedding's weight
    outside its owner's forward (gathered on use in the recomputation too),
    draws dropout (the recomputation must see the same mask), and takes a
    non-tensor argument and a keyword tensor."""

    def __init__(self, hidden=13):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.a = nn.Linear(hidden, 2 * hidden + 1)
        self.b = nn.Linear(2 * hidden + 1, hidden)

    def region(self, h, scale, *, shift):
        z = F.dropout(F.gelu(self.a(h)), p=0.3, training=self.training)
        z = self.b(z) * scale + shift
        return z @ self.emb.weight.t()

    def forward(self, idx):
        h = self.emb(idx)
        shift = torch.tanh(h[..., :1])
        return offload.checkpoint(self.region, h, 0.5, shift=shift)


@pytest.mark.any_device  # Note [the device a test runs on] (tests/conftest.py)
@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_checkpoint_call_in_model_matches_pytorch(tmp_path, param):
    torch.manual_seed(0)
    model = CheckpointsInForward()
    data = batches(4, seed=3)
    torch.manual_seed(7)  # dropout masks: both runs draw the same sequence
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.0)
    torch.manual_seed(7)
    weights, losses, _ = run_engine(model, data, make_config(param, param, tmp_path, weight_decay=0.0))
    torch.testing.assert_close(losses, ref_losses[:, 0])
    _assert_same(weights, ref_model)


def test_checkpoint_outside_an_engine_is_torch_checkpoint():
    torch.manual_seed(0)
    block = Block(12, 3)
    x = torch.randn(2, 5, 12, requires_grad=True)
    ref = copy.deepcopy(block)
    ref_x = x.detach().clone().requires_grad_()
    offload.checkpoint(block, x).square().sum().backward()
    ref(ref_x).square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    for (name, p), q in zip(block.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")
    with pytest.raises(TypeError, match=r"offload\.checkpoint: fn must be callable, got int"):
        offload.checkpoint(3, x)


# ---- memory ----------------------------------------------------------------

def _block_saved_bytes(b, t, c, heads):
    """Bytes one TinyGPT Block saves for backward (fp32; parameters excluded):
    ln1 and ln2 each save their input (btc) and mean and rstd (bt each); the
    qkv, proj, fc inputs (btc each) and the out input (btf); gelu's input
    (btf); the attention matmuls save contiguous copies of q, k, v (btc
    each) and the softmax output (b h t t), once; masked_fill its bool t x t
    mask. Views of one storage count once (Note [activation bytes])."""
    f = 4 * c + 3
    return 4 * (8 * b * t * c + 4 * b * t + b * heads * t * t + 2 * b * t * f) + t * t


@pytest.mark.parametrize("mode", ["none", "device", "cpu_checkpointing"])
def test_peak_device_bytes_match_the_closed_form(tmp_path, mode):
    """TinyGPT, 8 layers, hidden 24, 3 heads, sequence 512, batch 2, fp32,
    parameters in host memory (zero-copy on a CPU-only host, so the device
    tier holds activations only). With
      B = one block's saved bytes (_block_saved_bytes), I = 4btc (a block's
      input), E = 8bt (the embedding's saved token ids), H = 4(2btc + 2bt)
      (ln_f's input, mean, rstd and the LM head's input),
    the device-tier peak is
      no checkpointing:   E + L*B + H                    (end of forward)
      checkpointed:       max(E + L*I + H, E + (L-1)*I + B)
                          (end of forward; or recomputing the last block,
                          whose input is already counted among the L)
      cpu_checkpointing:  max(E + H, E + B - I), and the host tier's peak
                          rises by L*I."""
    b, t, c, heads, layers = 2, 512, 24, 3, 8
    B, I, E, H = _block_saved_bytes(b, t, c, heads), 4 * b * t * c, 8 * b * t, 4 * (2 * b * t * c + 2 * b * t)
    expected = {"none": E + layers * B + H,
                "device": max(E + layers * I + H, E + (layers - 1) * I + B),
                "cpu_checkpointing": max(E + H, E + B - I)}[mode]
    extra = {"none": {}, "device": CKPT, "cpu_checkpointing": CKPT_HOST}[mode]
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, hidden=c, heads=heads, layers=layers, seq=t)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (b, t), generator=gen) for _ in range(2))
    with offload.initialize(model, make_config("cpu", "cpu", tmp_path, extra=extra)) as engine:
        # The closed form is the cpu layer's (the suite's default): zero-copy gather.
        assert not engine.device_layer.separate_memory
        host_resting = engine.memory_report()["host"]["now"]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        report = engine.memory_report()
    assert report["device"]["peak"] == expected
    assert report["device"]["now"] == 0
    host_extra = layers * I if mode == "cpu_checkpointing" else 0
    assert report["host"]["peak"] == host_resting + host_extra


# ---- nothing left held --------------------------------------------------------

@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("extra", [{}, CKPT, CKPT_HOST], ids=["plain", "device", "cpu_checkpointing"])
def test_no_holds_or_bytes_left_after_each_step(tmp_path, param, extra):
    model = build("tiny_gpt", seed=4)
    with offload.initialize(model, make_config(param, param, tmp_path, extra=extra)) as engine:
        resting = {tier: engine.memory_report()[tier]["now"] for tier in ("device", "host", "nvme")}
        # Swap stores keep the staging buffers they allocate, and the buffer
        # caches their idle buffers, up to their budgets.
        staging = sum(store.config.buffer_bytes for store in engine._stores)
        staging += engine.optimizer.state_buffers.max_bytes
        staging += getattr(engine.shards[0].ctx.gathered_buffers, "max_bytes", 0)
        for per_rank in batches(3, seed=4):
            x, y = per_rank[0]
            loss = lm_loss(engine(x), y)
            assert engine.activation_report()["device_bytes"] > 0 or extra is CKPT_HOST
            engine.backward(loss)
            del loss
            engine.step()
            report = engine.memory_report()
            now = {tier: report[tier]["now"] for tier in ("device", "host", "nvme")}
            assert (now["device"], now["nvme"]) == (resting["device"], resting["nvme"])
            assert resting["host"] <= now["host"] <= resting["host"] + staging
            assert engine.activation_report()["device_bytes"] == 0
            assert engine.activation_checkpointing.saver.held_storages() == 0
            assert not engine.manager._backward_holds and not engine.manager._on_demand
            for shard in engine.shards:
                if shard.home is not Tier.DEVICE:
                    assert shard.residency is Residency.RELEASED and not shard.held, shard


def test_a_dropped_graph_gives_its_bytes_back(tmp_path):
    """A forward whose loss is never backpropagated (evaluation in train mode):
    the saved activations and checkpoint inputs go when the graph does."""
    model = build("tiny_gpt", seed=5)
    with offload.initialize(model, make_config("cpu", "cpu", tmp_path, extra=CKPT)) as engine:
        x, y = batches(1, seed=5)[0][0]
        loss = lm_loss(engine(x), y)
        assert engine.memory_report()["device"]["now"] > 0
        del loss
        assert engine.memory_report()["device"]["now"] == 0


# ---- wrapping --------------------------------------------------------------------

def test_checkpointed_modules_keep_names_and_get_their_class_back(tmp_path):
    model = build("tiny_gpt")
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict().keys())
    engine = offload.initialize(model, make_config("cpu", "cpu", tmp_path, extra=CKPT))
    assert engine.activation_report()["checkpointed_modules"] == 2
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict().keys()) == keys
    assert all(isinstance(blk, Block) and type(blk) is not Block for blk in model.blocks)
    engine.close()
    assert all(type(blk) is Block for blk in model.blocks)


def test_unknown_module_class_fails_at_initialize_with_the_model_unchanged(tmp_path):
    model = build("tiny_gpt")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = make_config("nvme", "nvme", tmp_path, extra={"activation_checkpointing": {"modules": ["Block", "Blok"]}})
    with pytest.raises(ValueError, match=r"activation_checkpointing\.modules: no module of class 'Blok' in the "
                                         r"model \(its module classes: .*Block"):
        offload.initialize(model, cfg)
    assert all(type(blk) is Block for blk in model.blocks)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n])


def test_a_function_that_changes_between_forward_and_recomputation_is_an_error(tmp_path):
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 8)
            self.calls = 0

        def region(self, h):
            self.calls += 1
            return h.exp() if self.calls == 1 else h.exp().exp()

        def forward(self, idx):
            return offload.checkpoint(self.region, self.emb(idx)) @ self.emb.weight.t()

    with offload.initialize(Flaky(), make_config("cpu", "cpu", tmp_path)) as engine:
        x, y = batches(1)[0][0]
        loss = lm_loss(engine(x), y)
        with pytest.raises(RuntimeError, match=r"recomputation of .*region saved more tensors than its forward"):
            engine.backward(loss)


def test_activations_over_the_device_budget_fail_naming_them(tmp_path):
    # Room for the largest offloaded parameter (initialize's check), not for a block's activations.
    cfg = make_config("cpu", "cpu", tmp_path, extra={"memory": {"device_budget": 10_000}})
    with offload.initialize(build("tiny_gpt"), cfg) as engine:
        x, _ = batches(1, seq=9)[0][0]
        with pytest.raises(MemoryError, match=r"device tier budget exceeded allocating \d+ bytes for saved "
                                              r"activation"):
            engine(x)


# ---- config ----------------------------------------------------------------------

def test_config_section_round_trips():
    cfg = Config.load({"activation_checkpointing": {"modules": ["Block"], "cpu_checkpointing": True,
                                                    "synchronize_checkpoint_boundary": True, "profile": True,
                                                    "partition_activations": False,
                                                    "contiguous_memory_optimization": False,
                                                    "number_checkpoints": None}})
    ac = cfg.activation_checkpointing
    assert ac.modules == ("Block",) and ac.cpu_checkpointing and ac.profile
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert Config.load({}).activation_checkpointing.modules == ()


@pytest.mark.parametrize("section, message", [
    ({"partition_activations": True},
     r"^activation_checkpointing\.partition_activations: true is not supported: .*no model parallelism"),
    ({"contiguous_memory_optimization": True},
     r"^activation_checkpointing\.contiguous_memory_optimization: true is not supported"),
    ({"number_checkpoints": 4}, r"^activation_checkpointing\.number_checkpoints: 4 is only used"),
    ({"number_checkpoints": 0}, r"^activation_checkpointing\.number_checkpoints: 0 is not an integer >= 1"),
    ({"modules": "Block"}, r"^activation_checkpointing\.modules: 'Block' is not a list of module class names"),
    ({"modules": ["Block", ""]}, r"^activation_checkpointing\.modules: \['Block', ''\] is not a list"),
    ({"modules": ["Block", "Block"]}, r"is not a list without repeated class names"),
    ({"cpu_checkpointing": "yes"}, r"^activation_checkpointing\.cpu_checkpointing: 'yes' is not true or false"),
    ({"profile": 1}, r"^activation_checkpointing\.profile: 1 is not true or false"),
    ({"cpu_checkpoint": True}, r"unknown key 'activation_checkpointing\.cpu_checkpoint' \(did you mean "
                               r"'cpu_checkpointing'"),
])
def test_bad_config_values_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        Config.load({"activation_checkpointing": section})


def test_profile_times_forwards_and_recomputations(tmp_path):
    extra = {"activation_checkpointing": {"modules": ["Block"], "profile": True}}
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path, extra=extra)) as engine:
        x, y = batches(1)[0][0]
        engine.backward(lm_loss(engine(x), y))
        report = engine.activation_report()
    assert report["checkpointed_calls"] == 2 and report["recomputations"] == 2
    assert report["checkpointed_forward_s"] > 0 and report["recompute_s"] > 0
