"""One device choice (Note [one device choice] in offload/device/__init__.py):
the selected layer decides where compute runs for the engine, offload.init and
init_distributed alike, and nothing in offload/ decides by a layer's name."""
import ast
from pathlib import Path

import pytest
import torch

import offload
import offload.device
from tests.support.harness import batches, make_config, run_reference, train_engine
from tests.support.models import TinyGPT

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)

OFFLOAD = Path(offload.__file__).resolve().parent


@pytest.mark.parametrize("param,optim", [("nvme", "nvme"), ("cpu", "cpu"), ("nvme", "cpu")])
def test_a_model_built_under_offload_init_trains_on_the_sim_like_pytorch(tmp_path, monkeypatch, param, optim):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    torch.manual_seed(7)
    plain = TinyGPT()
    cfg = make_config(param, optim, tmp_path)
    torch.manual_seed(7)
    with offload.init(cfg) as builder:
        model = TinyGPT()
    assert builder.ctx.layer.name == "sim"
    data = batches(6, seed=2)
    ref_model, ref_losses = run_reference(plain, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    with offload.initialize(model, cfg) as engine:
        # The builder's layer is the engine's: one layer per run, every shard on it.
        assert engine.device_layer is builder.ctx.layer
        assert all(s.ctx.layer is engine.device_layer for s in engine.shards)
        losses = train_engine(engine, data)
        weights = engine.full_state_dict(master=True)
        copies = engine.device_layer.counters.copies
    assert copies > 0  # the parameters did go through the sim's copy streams
    torch.testing.assert_close(losses, ref_losses[:, 0], rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_the_selected_layer_decides_the_compute_device_and_the_backend(monkeypatch, name):
    monkeypatch.setenv("OFFLOAD_DEVICE", name)
    layer = offload.device.from_env()
    try:
        assert layer.name == name and layer.device == torch.device("cpu")
    finally:
        layer.close()
    assert offload.device.collective_backend() == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_cuda_asked_for_where_there_is_none_is_refused_by_offload_init_and_initialize(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="OFFLOAD_DEVICE=cuda: CUDA is not available here"):
        with offload.init(make_config("cpu", "cpu", tmp_path)):
            TinyGPT()
    with pytest.raises(RuntimeError, match="OFFLOAD_DEVICE=cuda: CUDA is not available here"):
        offload.initialize(TinyGPT(), make_config("cpu", "cpu", tmp_path))


def _decisions_by_name(tree: ast.AST):
    """Comparisons that decide by a layer's name (`x.name == "cuda"|"sim"|"cpu"`) or by
    a device type other than the host's (`x.type == "cuda"`). `.type == "cpu"` stays
    allowed: it asks where bytes are (the native kernels and the file I/O read host
    memory only), not which layer runs."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        attrs = {o.attr for o in operands if isinstance(o, ast.Attribute)}
        literals = {o.value for o in operands if isinstance(o, ast.Constant)}
        if ("name" in attrs and literals & {"cuda", "sim", "cpu"}) or ("type" in attrs and literals & {"cuda", "sim"}):
            yield node.lineno, ast.unparse(node)


def test_no_decision_in_offload_asks_a_layer_name_or_a_device_type():
    found = [f"offload/{path.relative_to(OFFLOAD).as_posix()}:{line}: {text}"
             for path in sorted(OFFLOAD.rglob("*.py"))
             for line, text in _decisions_by_name(ast.parse(path.read_text(), str(path)))]
    assert not found, "decide by the layer's capabilities (Note [one device choice]):\n" + "\n".join(found)
