"""Weights read, saved and edited outside the engine's forward: real values, never
the placeholder (Note [reading a parameter outside the engine] in
offload/partition/managed.py)."""
import copy

import pytest
import torch

import offload
from tests.support.harness import batches, build, engine_weights, lm_loss, make_config, run_reference

PLACEMENTS = [("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "cpu")]


def _train(model, engine, data):
    for (x, y), in data:
        loss = lm_loss(model(x), y)
        loss.backward()
        engine.step()


@pytest.mark.parametrize("param,optim", PLACEMENTS)
def test_state_dict_and_reads_give_the_trained_weights(tmp_path, param, optim):
    model = build("tiny_gpt")
    data = batches(4)
    ref_model, _ = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    model = copy.deepcopy(model)
    with offload.initialize(model, make_config(param, optim, tmp_path)) as engine:
        _train(model, engine, data)
        state = model.state_dict()
        weights = engine_weights(engine)
        assert state.keys() == dict(ref_model.state_dict()).keys()
        for name, value in weights.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0)
            torch.testing.assert_close(state[name], ref_model.state_dict()[name])
        # Direct reads outside a forward: the real values, as copies.
        w = model.blocks[1].fc.weight
        torch.testing.assert_close(w.detach(), weights["blocks.1.fc.weight"], rtol=0, atol=0)
        torch.testing.assert_close(w.sum(), weights["blocks.1.fc.weight"].sum(), rtol=0, atol=0)
        assert "0.0000, 0.0000, 0.0000" not in repr(w)
        # Saved with torch and with safetensors, loaded into a plain model: equal.
        torch.save(model.state_dict(), tmp_path / "sd.pt")
        from safetensors.torch import load_model, save_model

        save_model(model, str(tmp_path / "m.safetensors"))
        # The model's own training goes on unaffected by the reads.
        _train(model, engine, batches(1, seed=9))
    for path in ("sd.pt", "m.safetensors"):
        plain = build("tiny_gpt", seed=1)
        if path.endswith(".pt"):
            plain.load_state_dict(torch.load(tmp_path / path, weights_only=True))
        else:
            load_model(plain, str(tmp_path / path))
        for name, p in plain.named_parameters():
            torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=0)


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_writes_outside_a_forward_reach_the_home_and_the_master_and_aliases_are_refused(tmp_path, param, optim):
    model = build("tiny_gpt")
    with offload.initialize(model, make_config(param, optim, tmp_path)) as engine:
        w = model.blocks[0].fc.weight
        before = engine_weights(engine)["blocks.0.fc.weight"]
        with torch.no_grad():
            assert w.add_(1.0) is w  # written through
        torch.testing.assert_close(engine_weights(engine)["blocks.0.fc.weight"], before + 1.0, rtol=0, atol=0)
        w.data = torch.full(w.shape, 0.5)  # PEFT's merge writes weights so: written through
        torch.testing.assert_close(engine_weights(engine)["blocks.0.fc.weight"], torch.full(w.shape, 0.5))
        # model.load_state_dict copies into every parameter in place: the values land.
        plain = build("tiny_gpt", seed=5)
        model.load_state_dict(plain.state_dict())
        for name, value in engine_weights(engine).items():
            torch.testing.assert_close(value, plain.state_dict()[name], rtol=0, atol=0)
        # A write elsewhere only reads the parameter.
        out = torch.empty(w.shape)
        with torch.no_grad():
            torch.add(w, 1.0, out=out)
        torch.testing.assert_close(out, plain.blocks[0].fc.weight.detach() + 1.0, rtol=0, atol=0)
        for refused in (lambda: w.data, lambda: setattr(w, "data", torch.ones(3))):
            with pytest.raises(RuntimeError, match=r"offload\.gathered\(params, modifier_rank=0\)"):
                refused()
        assert model.to("cpu") is model  # Trainer's move to its device: nothing gathered, nothing lost
        assert w.shape == (99, 24) and w.dtype == torch.float32 and w.requires_grad
        assert isinstance(w, torch.nn.Parameter)
        assert all(not s.held for s in engine.shards if s.home.value != "device")


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_gathered_edits_reach_the_home_and_the_master(tmp_path, param, optim):
    model = build("tiny_gpt")
    data = batches(4, seed=3)
    # Plain PyTorch: two steps, an edit, two steps.
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for i, ((x, y),) in enumerate(data):
        if i == 2:
            with torch.no_grad():
                ref.blocks[0].fc.weight.mul_(0.5)
                ref.ln_f.bias.fill_(0.25)
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    model = copy.deepcopy(model)
    with offload.initialize(model, make_config(param, optim, tmp_path)) as engine:
        for i, ((x, y),) in enumerate(data):
            if i == 2:
                params = [model.blocks[0].fc.weight, model.ln_f.bias]
                with offload.gathered(params, modifier_rank=0), torch.no_grad():
                    model.blocks[0].fc.weight.mul_(0.5)
                    model.ln_f.bias.fill_(0.25)
            lm_loss(model(x), y).backward()
            engine.step()
        weights = engine_weights(engine)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
        # A read-only block that changes a value is refused rather than losing the edit.
        with pytest.raises(RuntimeError, match="read-only block"):
            with offload.gathered(model.ln_f.bias), torch.no_grad():
                model.ln_f.bias.add_(1.0)
        torch.testing.assert_close(engine_weights(engine)["ln_f.bias"], weights["ln_f.bias"], rtol=0, atol=0)


def test_close_gives_the_values_back_to_a_plain_model(tmp_path):
    model = build("tiny_gpt")
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path)) as engine:
        _train(model, engine, batches(2))
        weights = engine_weights(engine)
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=0)
    (x, y), = batches(1)[0]
    lm_loss(model(x), y).backward()  # a plain model again


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_save_pretrained_streams_shards_in_hugging_faces_layout(tmp_path, param, optim):
    import json

    from safetensors import safe_open

    model = build("tiny_gpt")
    with offload.initialize(model, make_config(param, optim, tmp_path / "swap")) as engine:
        _train(model, engine, batches(2))
        weights = engine_weights(engine)
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "model.safetensors").write_bytes(b"an earlier save")  # stale: removed
        engine.save_pretrained(tmp_path / "out", max_shard_size="8KiB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # The tied LM head is the embedding: saved once, under its first name.
    assert set(index["weight_map"]) == set(weights)
    for name in files:
        with safe_open(tmp_path / "out" / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                torch.testing.assert_close(f.get_tensor(key), weights[key], rtol=0, atol=0)
                assert index["weight_map"][key] == name


@pytest.mark.parametrize("optim", ["cpu", "nvme"])
def test_save_pretrained_master_writes_the_fp32_masters_of_a_bf16_run(tmp_path, optim):
    from safetensors.torch import load_file

    model = build("tiny_gpt")
    with offload.initialize(model, make_config("nvme", optim, tmp_path / "swap", precision="bf16")) as engine:
        _train(model, engine, batches(2))
        masters = engine.full_state_dict(master=True)
        copies = engine.full_state_dict()
        engine.save_pretrained(tmp_path / "masters", master=True)
        engine.save_pretrained(tmp_path / "copies")
    saved_masters = load_file(tmp_path / "masters" / "model.safetensors")
    saved_copies = load_file(tmp_path / "copies" / "model.safetensors")
    assert set(saved_masters) == set(masters)
    for key, value in masters.items():
        assert saved_masters[key].dtype == torch.float32 and saved_copies[key].dtype == torch.bfloat16
        torch.testing.assert_close(saved_masters[key], value, rtol=0, atol=0)
        torch.testing.assert_close(saved_copies[key], copies[key], rtol=0, atol=0)
    # The masters carry what bf16 rounds away.
    assert any(not torch.equal(saved_masters[k].to(torch.bfloat16).float(), saved_masters[k]) for k in masters)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers, transformers.LlamaForCausalLM(config)


@pytest.mark.slow
def test_hugging_face_save_pretrained_and_ours_load_with_from_pretrained(tmp_path):
    transformers, model = _tiny_llama()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 12), generator=gen)
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path / "swap")) as engine:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            engine.step()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        model.save_pretrained(tmp_path / "hf")  # transformers' own save: state_dict() values
        engine.save_pretrained(tmp_path / "ours", max_shard_size="40KB")
    for where in ("hf", "ours"):
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / where)
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, logits, msg=lambda m: f"{where}: {m}")
