"""offload.consolidate / `offload consolidate`: one safetensors file that the
plain PyTorch model loads, equal to the engine's weights and outputs."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

import offload
from offload.checkpoint_io import CheckpointError
from offload.checkpoint_io.files import SafetensorsStream
from offload.cli import main as cli_main
from tests.checkpoint_io import checkpoint_runs as runs
from tests.support.harness import build, make_config


def _train_and_save(tmp_path, model_name, param, optim, precision="fp32"):
    engine = offload.initialize(build(model_name), make_config(param, optim, tmp_path / "swap",
                                                               precision=precision))
    runs.seed(0)
    runs.train(engine, 3)
    engine.save_checkpoint(tmp_path / "ck")
    return engine


@pytest.mark.parametrize("model_name,param,optim,precision", [
    ("tiny_gpt", "nvme", "nvme", "fp32"),
    ("tiny_gpt", "cpu", "cpu", "bf16"),
    ("shared_param", "none", "cpu", "fp32"),   # a parameter under two names
    ("with_unused", "cpu", "nvme", "fp32"),    # a buffer, frozen and unused parameters
])
def test_consolidated_file_loads_into_the_plain_model(tmp_path, model_name, param, optim, precision):
    with _train_and_save(tmp_path, model_name, param, optim, precision) as engine:
        masters = engine.full_state_dict(master=True)
        with torch.no_grad():
            engine_out = engine(runs.PROBE_INPUT).float()
    out = offload.consolidate(tmp_path / "ck", tmp_path / "model.safetensors", progress=False)
    plain = build(model_name, seed=9)
    missing, unexpected = load_model(plain, out)
    assert (missing, unexpected) == (set(), [])
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), masters[name]), name
    if precision == "fp32":  # bf16: the engine computes with the bf16 copies, the plain model in fp32
        torch.testing.assert_close(plain(runs.PROBE_INPUT), engine_out)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt"
        if model_name == "shared_param":  # saved once, the alias named in the metadata
            assert "b.weight" not in f.keys() and json.loads(meta["offload.tied"]) == {"b.weight": "a.weight"}
        assert set(f.keys()) == set(plain.state_dict()) - {"b.weight"}


def test_cli_writes_the_requested_dtype(tmp_path, capsys):
    with _train_and_save(tmp_path, "tiny_gpt", "cpu", "nvme") as engine:
        masters = engine.full_state_dict(master=True)
    assert cli_main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "m.safetensors"),
                     "--dtype", "bf16", "--tag", "global_step3"]) == 0
    assert capsys.readouterr().out.strip().endswith("m.safetensors")
    tensors = load_file(tmp_path / "m.safetensors")
    assert set(tensors) == set(masters)
    for name, value in masters.items():
        assert tensors[name].dtype == torch.bfloat16
        assert torch.equal(tensors[name], value.to(torch.bfloat16)), name


def test_cli_reports_a_corrupt_checkpoint(tmp_path, capsys):
    _train_and_save(tmp_path, "tiny_gpt", "cpu", "nvme").close()
    victim = tmp_path / "ck" / "global_step3" / "rank0" / "nvme" / "optim.0.swp"
    data = bytearray(victim.read_bytes())
    data[5000] ^= 1
    victim.write_bytes(bytes(data))
    assert cli_main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "m.safetensors")]) == 1
    assert "optim.0.swp fails its" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()
    with pytest.raises(CheckpointError, match="not found"):
        offload.consolidate(tmp_path / "ck", tmp_path / "m.safetensors", tag="nope")


@pytest.mark.slow
def test_world_size_two_checkpoint_consolidates_to_the_full_model(tmp_path, tmp_path_factory):
    cases, root, results = runs.world2_checkpoints(tmp_path_factory)
    for i, case in enumerate(cases):
        out = offload.consolidate(root / f"case{i}" / "ckpt", tmp_path / f"m{i}.safetensors",
                                  tag="at-half", progress=False)
        plain = build(case[0], seed=9)
        assert load_model(plain, out) == (set(), [])
        at_save = results[i]["at_save"]["master"]
        for name, p in plain.named_parameters():  # rank partitions joined, padding stripped
            assert torch.equal(p.detach(), at_save[name]), (case, name)
        torch.testing.assert_close(plain(runs.PROBE_INPUT), results[i]["output_at_save"])


@pytest.mark.parametrize("shapes", [[(), (1,), (0,), (3, 5, 7)], [(1, 1), (257,)]])
def test_streamed_safetensors_file_reads_back_with_the_library(tmp_path, shapes):
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8]
    tensors = {}
    for i, shape in enumerate(shapes):
        for dtype in dtypes:
            value = torch.randn(shape, generator=gen) * 100
            tensors[f"t{i}.{str(dtype)[6:]}"] = value.to(dtype) if dtype is not torch.bool else value > 0
    plan = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    stream = SafetensorsStream(tmp_path / "x.safetensors", plan, {"note": "streamed"})
    for name, value in tensors.items():
        stream.write(name, value)
    nbytes, _ = stream.close()
    assert nbytes == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name


def test_streamed_writer_refuses_out_of_plan_tensors(tmp_path):
    plan = [("a", torch.float32, (2,)), ("b", torch.float32, (3,))]
    stream = SafetensorsStream(tmp_path / "x.safetensors", plan)
    with pytest.raises(ValueError, match="expected tensor 'a' torch.float32 \\[2\\] next, got 'b'"):
        stream.write("b", torch.zeros(3))
    stream.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="closed after 1 of 2 tensors"):
        stream.close()
