"""A script written for DeepSpeed runs with only its import changed (`import offload.deepspeed
as deepspeed`), and trains like plain PyTorch; parameter groups, the DeepSpeedEngine
methods scripts call, and each refusal (offload/deepspeed)."""
import argparse
import copy
import functools
import json
import math
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload
from offload.checkpoint_io import CheckpointError
from tests.support.harness import assert_weights, batches, build, engine_weights, lm_loss, make_config

PLACEMENTS = [("cpu", "cpu"), ("nvme", "nvme")]


# ---- a training script as DeepSpeed's docs write it (the CIFAR-10 tutorial's shape) ----------
def ds_config(nvme_path, *, clip=1.0):
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": True},
            "stage3_param_persistence_threshold": 0,
        },
    }


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 19), nn.ReLU(), nn.Linear(19, 5))


def trainset():
    gen = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(22, 13, generator=gen),  # 22: a short last batch
                                          torch.randint(0, 5, (22,), generator=gen))


def ds_script(deepspeed, argv, model, data):
    """What a DeepSpeed user writes; `deepspeed` is the module it imported."""
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--ckpt_dir", type=str)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    deepspeed.init_distributed()
    assert args.local_rank == -1
    parameters = filter(lambda p: p.requires_grad, model.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=parameters, training_data=data)
    assert args.local_rank == model_engine.local_rank == 0 and model_engine.global_rank == 0
    criterion = nn.CrossEntropyLoss()
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    start, losses, norms = 0, [], []
    if args.resume:
        _, client_sd = model_engine.load_checkpoint(args.ckpt_dir)
        start = client_sd["epoch"] + 1
    for epoch in range(start, start + args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.detach())
            if model_engine.was_step_applied():
                norms.append(model_engine.get_global_grad_norm())
        model_engine.save_checkpoint(args.ckpt_dir, client_state={"epoch": epoch})
    return model_engine, losses, norms


def torch_reference(model, data, *, epochs, gas=2, clip=1.0):
    """Plain PyTorch over DeepSpeed's sampling: DistributedSampler(seed 0), no set_epoch."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    losses, norms, micro = [], [], 0
    for _ in range(epochs):
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            (loss / gas).backward()
            losses.append(loss.detach())
            micro += 1
            if micro % gas == 0:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                opt.zero_grad()
    return model, losses, norms


def test_a_deepspeed_script_runs_with_offload_as_deepspeed_and_trains_like_pytorch(tmp_path):
    import offload.deepspeed as deepspeed  # the script's only change: its import
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(ds_config(tmp_path / "nvme")))
    model, data = net(), trainset()
    ref_model, ref_losses, ref_norms = torch_reference(model, data, epochs=2)
    argv = ["--deepspeed", "--deepspeed_config", str(config_path), "--ckpt_dir", str(tmp_path / "ck")]

    first = copy.deepcopy(model)
    engine, losses, norms = ds_script(deepspeed, argv, first, data)
    try:
        assert engine.train_micro_batch_size_per_gpu() == 4 and engine.gradient_accumulation_steps() == 2
        assert engine.train_batch_size() == 8 and engine.module is first
    finally:
        engine.close()
    # A second run resumes from the checkpoint the first saved (client_state names the epoch).
    engine, more, more_norms = ds_script(deepspeed, argv + ["--resume"], copy.deepcopy(model), data)
    try:
        torch.testing.assert_close(torch.stack(losses + more), torch.stack(ref_losses))
        torch.testing.assert_close(torch.tensor(norms + more_norms), torch.tensor(ref_norms))
        assert_weights(engine, ref_model)
        assert engine.global_steps == len(ref_norms)
    finally:
        engine.close()


def test_the_dataloader_is_deepspeeds(tmp_path):
    cfg = ds_config(tmp_path)

    def collate(samples):
        x, y = zip(*samples)
        return torch.stack(x) * 2, torch.stack(y)

    data = trainset()
    engine, opt, loader, sched = offload.deepspeed.initialize(model=net(), config=cfg, training_data=data, collate_fn=collate)
    with engine:
        assert opt is engine.optimizer and sched is None
        assert isinstance(loader.sampler, torch.utils.data.DistributedSampler) and loader.batch_size == 4
        order = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0))
        first_x, _ = next(iter(loader))
        torch.testing.assert_close(first_x, torch.stack([data[i][0] for i in order[:4]]) * 2)
        assert [len(b[0]) for b in loader] == [4, 4, 4, 4, 4, 2]
    engine, _, loader, _ = offload.deepspeed.initialize(model=net(), config={**cfg, "dataloader_drop_last": True},
                                              training_data=data)
    with engine:
        assert [len(b[0]) for b in loader] == [4, 4, 4, 4, 4]


def test_backward_returns_the_loss_and_global_samples_counts_the_batches(tmp_path):
    engine, *_ = offload.deepspeed.initialize(model=net(), config=ds_config(tmp_path))
    with engine:
        data = trainset()
        for step in range(2):
            for micro in range(2):  # gradient_accumulation_steps 2, micro batch 4
                x = torch.stack([data[4 * micro + i][0] for i in range(4)])
                y = torch.stack([data[4 * micro + i][1] for i in range(4)])
                loss = F.cross_entropy(engine(x), y)
                assert engine.backward(loss) is loss
                engine.step()
            assert engine.global_steps == step + 1 and engine.global_samples == 8 * (step + 1)


def test_offload_initialize_returns_one_engine_and_deepspeeds_its_tuple(tmp_path):
    engine = offload.initialize(net(), ds_config(tmp_path))
    with engine:
        assert isinstance(engine, offload.Engine)
        with pytest.raises(TypeError, match="offload.deepspeed.initialize"):
            _, _, _, _ = engine  # a DeepSpeed habit on the plain form: told where the tuple is
    model = net()
    assert offload.initialize(model=model, config=ds_config(tmp_path)).close() is None  # keywords: an Engine too
    out = offload.deepspeed.initialize(model=net(), config_params=ds_config(tmp_path))  # DeepSpeed's old name
    assert isinstance(out, tuple) and len(out) == 4
    assert isinstance(out[0], offload.deepspeed.DeepSpeedEngine) and isinstance(out[0].engine, offload.Engine)
    out[0].close()
    import offload as deepspeed  # the old drop-in line: each DeepSpeed name says where it went
    with pytest.raises(AttributeError, match="import offload.deepspeed as deepspeed"):
        deepspeed.add_config_arguments


# ---- parameter groups against torch.optim.AdamW with the same groups ------------------------------
def groups_of(model, lr_b=3e-3):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": lr_b, "betas": (0.8, 0.99), "eps": 1e-7}]


def run_groups_reference(model, data, *, gas, clip, scheduler_fn=None):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.01, foreach=False)
    sched = scheduler_fn(opt) if scheduler_fn else None
    losses, norms, lrs = [], [], []
    for i, ((x, y),) in enumerate(data):
        loss = lm_loss(model(x), y)
        (loss / gas).backward()
        losses.append(loss.detach())
        if (i + 1) % gas == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)))
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            lrs.append([g["lr"] for g in opt.param_groups])
    return model, torch.stack(losses), norms, lrs


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("param,optim", PLACEMENTS)
def test_each_group_trains_with_its_own_lr_and_weight_decay_like_adamw(tmp_path, param, optim, clip):
    model, data, gas = build("tiny_gpt"), batches(8, seed=3), 2
    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 1.0 / (1 + s))
    ref_model, ref_losses, ref_norms, ref_lrs = run_groups_reference(model, data, gas=gas, clip=clip,
                                                                      scheduler_fn=schedule)
    model = copy.deepcopy(model)
    cfg = make_config(param, optim, tmp_path, gas=gas, clip=clip)
    engine, opt, _, sched = offload.deepspeed.initialize(model=model, config=cfg, model_parameters=groups_of(model),
                                               lr_scheduler=schedule)
    with engine:
        assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and engine.lr_scheduler is sched
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        losses, norms, lrs = [], [], []
        for (x, y), in data:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            if engine.was_step_applied():
                norms.append(engine.get_global_grad_norm())
                lrs.append(engine.get_lr())
        torch.testing.assert_close(torch.stack(losses), ref_losses)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms))
        assert lrs == ref_lrs
        assert_weights(engine, ref_model)


def test_a_torch_adamw_given_without_an_optimizer_section_is_adopted(tmp_path):
    model, data = build("tiny_gpt"), batches(6, seed=4)
    ref_model, ref_losses, _, _ = run_groups_reference(model, data, gas=1, clip=0.0)
    model = copy.deepcopy(model)
    cfg = make_config("cpu", "cpu", tmp_path)
    del cfg["optimizer"]
    torch_opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.01)
    engine, opt, _, _ = offload.deepspeed.initialize(model=model, config=cfg, optimizer=torch_opt)
    with engine:
        assert opt is engine.optimizer and opt is not torch_opt
        losses = []
        for (x, y), in data:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        torch.testing.assert_close(torch.stack(losses), ref_losses)
        assert_weights(engine, ref_model)


def test_deepspeed_schedules_drive_every_group(tmp_path):
    # DeepSpeed itself (the peer, ../shared/tools/install-peers.sh) is the reference here.
    WarmupCosineLR = pytest.importorskip("deepspeed.runtime.lr_schedules").WarmupCosineLR

    params = {"total_num_steps": 6, "warmup_num_steps": 2}
    model = build("tiny_gpt")
    cfg = make_config("cpu", "cpu", tmp_path, scheduler={"type": "WarmupCosineLR", "params": params})
    ref = torch.optim.AdamW(groups_of(copy.deepcopy(model)), lr=1e-2)
    ref_sched = WarmupCosineLR(ref, **params)
    engine, _, _, sched = offload.deepspeed.initialize(model=model, config=cfg, model_parameters=groups_of(model))
    with engine:
        assert sched is engine.lr_scheduler
        for (x, y), in batches(5):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            ref.step()
            ref_sched.step()
            assert engine.get_lr() == [g["lr"] for g in ref.param_groups]


# ---- checkpoints with groups, and load_checkpoint's options -----------------------------------------
def make_engine(tmp_path, groups=True, seed=0):
    model = build("tiny_gpt", seed=seed)
    cfg = make_config("cpu", "nvme", tmp_path / "swap", scheduler={"type": "WarmupLR",
                                                                     "params": {"warmup_num_steps": 3}})
    engine, *_ = offload.deepspeed.initialize(model=model, config=cfg,
                                    model_parameters=groups_of(model) if groups else model.parameters())
    return engine


def train(engine, data):
    for (x, y), in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()


def test_a_checkpoint_keeps_each_groups_state_and_refuses_other_groups(tmp_path):
    data = batches(6, seed=7)
    with make_engine(tmp_path / "a") as straight:
        train(straight, data)
        expected = engine_weights(straight)
        expected_lrs = straight.get_lr()
    with make_engine(tmp_path / "b") as first:
        train(first, data[:3])
        first.save_checkpoint(tmp_path / "ck", client_state={"k": 1})
    with make_engine(tmp_path / "c", seed=5) as resumed:
        path, client = resumed.load_checkpoint(tmp_path / "ck")
        assert client == {"k": 1} and path == str(tmp_path / "ck" / "global_step3")
        train(resumed, data[3:])
        assert resumed.get_lr() == expected_lrs
        for name, value in engine_weights(resumed).items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    with make_engine(tmp_path / "d", groups=False) as other:
        before = engine_weights(other)
        with pytest.raises(CheckpointError, match="parameter group mismatch: 2 in the checkpoint, 1 in this"):
            other.load_checkpoint(tmp_path / "ck")
        for name, value in engine_weights(other).items():
            torch.testing.assert_close(value, before[name], rtol=0, atol=0)
        # The weights and counters alone load into any groups.
        other.load_checkpoint(tmp_path / "ck", load_optimizer_states=False, load_lr_scheduler_states=False)
        assert other.global_steps == 3 and all(n == 0 for n in other.optimizer.shard_steps.values())
        saved = engine_weights(other)
    with make_engine(tmp_path / "e", seed=9) as only:
        only.load_checkpoint(tmp_path / "ck", load_module_only=True)
        assert only.global_steps == 0
        for name, value in engine_weights(only).items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_load_checkpoint_where_nothing_was_saved_returns_none_as_deepspeed(tmp_path):
    with make_engine(tmp_path) as engine:
        (tmp_path / "empty").mkdir()
        assert engine.load_checkpoint(tmp_path / "empty") == (None, None)


def test_load_checkpoint_takes_the_root_with_or_without_tag_or_a_tag_directory_and_refuses_the_rest(tmp_path):
    """Each form resumes exactly where the run saved; a path that is no checkpoint raises,
    naming it, and the engine is left as it was: a run asked to resume never starts over."""
    with make_engine(tmp_path / "a") as engine:
        train(engine, batches(2))
        tag = engine.save_checkpoint(tmp_path / "ck")
        saved, steps = engine_weights(engine), engine.global_steps
    for where, kw in [(tmp_path / "ck", {}), (tmp_path / "ck", {"tag": tag}), (tmp_path / "ck" / tag, {}),
                      (str(tmp_path / "ck" / tag) + "/", {})]:
        with make_engine(tmp_path / "b", seed=9) as other:
            path, _ = other.load_checkpoint(where, **kw)
            assert os.path.samefile(path, tmp_path / "ck" / tag) and other.global_steps == steps
            for name, value in engine_weights(other).items():
                torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "run.log").write_text("x")
    with make_engine(tmp_path / "c", seed=9) as other:
        before = engine_weights(other)
        for bad, said in [(tmp_path / "ck_typo", "does not exist"), (tmp_path / "notes.txt", "is a file"),
                          (tmp_path / "other", "holds no checkpoint.*run.log")]:
            with pytest.raises(CheckpointError, match=said):
                other.load_checkpoint(bad)
        for name, value in engine_weights(other).items():
            torch.testing.assert_close(value, before[name], rtol=0, atol=0)
        assert other.global_steps == 0


def test_save_latest_false_leaves_latest_alone(tmp_path):
    with make_engine(tmp_path) as engine:
        train(engine, batches(2))
        engine.save_checkpoint(tmp_path / "ck", tag="one")
        train(engine, batches(2, seed=1))
        engine.save_checkpoint(tmp_path / "ck", tag="two", save_latest=False)
        assert (tmp_path / "ck" / "latest").read_text().strip() == "one"


# ---- the other DeepSpeedEngine methods -------------------------------------------------------------
@pytest.mark.parametrize("param,optim", PLACEMENTS)
def test_set_gradient_accumulation_boundary_steps_where_the_script_says(tmp_path, param, optim):
    model, data = build("tiny_gpt"), batches(6, seed=8)
    # The config says 3 micro-steps; the script ends a window every 2 (loss still divided by 3).
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for i, ((x, y),) in enumerate(data):
        (lm_loss(ref(x), y) / 3).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    model = copy.deepcopy(model)
    engine, *_ = offload.deepspeed.initialize(model=model, config=make_config(param, optim, tmp_path, gas=3))
    with engine:
        applied = []
        for i, ((x, y),) in enumerate(data):
            engine.set_gradient_accumulation_boundary(i % 2 == 1)
            assert engine.is_gradient_accumulation_boundary() == (i % 2 == 1)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            applied.append(engine.was_step_applied())
        assert applied == [False, True] * 3 and engine.global_steps == 3
        assert_weights(engine, ref)
        engine.set_gradient_accumulation_boundary(None)
        assert not engine.is_gradient_accumulation_boundary()  # 6 micro-steps: the 7th is not the 3rd of 3


def test_zero_grad_forgets_the_accumulated_gradients(tmp_path):
    model, data = build("tiny_gpt"), batches(3, seed=2)
    engine, *_ = offload.deepspeed.initialize(model=copy.deepcopy(model), config=make_config("cpu", "cpu", tmp_path, gas=2))
    with engine:
        (x, y), = data[0]
        engine.backward(lm_loss(engine(x), y))
        assert engine.gradients_pending
        engine.zero_grad()
        assert not engine.gradients_pending


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.safetensors"])
def test_save_16bit_model_writes_the_weights_in_the_compute_dtype(tmp_path, filename):
    model = build("tiny_gpt")
    engine, *_ = offload.deepspeed.initialize(model=model, config=make_config("nvme", "nvme", tmp_path, precision="bf16"))
    with engine:
        train(engine, batches(2))
        assert engine.save_16bit_model(tmp_path / "out", filename) is True
        expected = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    if filename.endswith(".safetensors"):
        from safetensors.torch import load_file

        saved = load_file(tmp_path / "out" / filename)
        assert set(saved) == set(expected)
    else:
        saved = torch.load(tmp_path / "out" / filename)
        assert saved.keys() == expected.keys()
    for k, v in saved.items():
        assert v.dtype == torch.bfloat16
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)


# ---- refusals, each naming why --------------------------------------------------------------------
class _Mpu:
    def get_data_parallel_world_size(self):
        return 1


REFUSALS = {
    "optimizer callable": (dict(optimizer=lambda params: torch.optim.SGD(params, lr=0.1)),
                           ValueError, "engine builds its own optimizer"),
    "optimizer SGD": (dict(optimizer="sgd"), ValueError, "only the engine's own Adam/AdamW"),
    "optimizer and section": (dict(optimizer="adamw"), ValueError, "both optimizer= and the config's"),
    "scheduler instance": (dict(lr_scheduler="instance"), ValueError, "bound to the optimizer it was made with"),
    "scheduler twice": (dict(lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0),
                             scheduler=True), ValueError, "both give a schedule"),
    "mpu": (dict(mpu=_Mpu()), ValueError, "model parallelism is not supported"),
    "mesh": (dict(mesh_param=(1, 1)), ValueError, "device meshes"),
    "subset": (dict(model_parameters="subset"), ValueError, "leaves out 1 trainable parameter"),
    "foreign tensor": (dict(model_parameters="foreign"), ValueError, "not a parameter of the model"),
    "twice": (dict(model_parameters="twice"), ValueError, "appears in more than one parameter group"),
    "amsgrad": (dict(model_parameters="amsgrad"), ValueError, "amsgrad=True is not supported"),
    "no config": (dict(config=None), ValueError, "needs a config"),
    "two configs": (dict(args=argparse.Namespace(deepspeed_config="x.json")), ValueError,
                    "both in args.deepspeed_config and as config="),
    "iterable data": (dict(training_data="iterable"), ValueError, "IterableDataset"),
    "unknown keyword": (dict(tensor_parallel=2), TypeError, "unexpected keyword arguments"),
}


@pytest.mark.parametrize("what", sorted(REFUSALS))
def test_initialize_refuses_what_it_cannot_honour(tmp_path, what):
    kwargs, error, message = REFUSALS[what]
    kwargs = dict(kwargs)
    model = net()
    cfg = ds_config(tmp_path)
    if kwargs.pop("scheduler", False):
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    opt = kwargs.get("optimizer")
    if opt == "sgd":
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    elif opt == "adamw":
        kwargs["optimizer"] = torch.optim.AdamW(model.parameters())
    if kwargs.get("lr_scheduler") == "instance":
        kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(model.parameters()),
                                                                   lambda s: 1.0)
    ps = list(model.parameters())
    kwargs["model_parameters"] = {
        "subset": ps[1:], "foreign": ps + [nn.Parameter(torch.zeros(3))],
        "twice": [{"params": ps}, {"params": ps[:1]}],
        "amsgrad": [{"params": ps, "amsgrad": True}]}.get(kwargs.get("model_parameters"),
                                                         kwargs.get("model_parameters"))
    if kwargs.get("training_data") == "iterable":
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter([])
        kwargs["training_data"] = Stream()
    kwargs.setdefault("config", cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=message):
        offload.deepspeed.initialize(model=model, **kwargs)
    for k, v in model.state_dict().items():  # the model is left as it was, usable
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_deepspeed_keywords_on_offload_initialize_name_the_deepspeed_surface(tmp_path):
    with pytest.raises(TypeError, match=r"\['model_parameters'\].*offload.deepspeed.initialize"):
        offload.initialize(net(), ds_config(tmp_path), model_parameters=[])
    with pytest.raises(TypeError, match="offload.deepspeed.initialize"):
        offload.initialize(model=net(), config=ds_config(tmp_path), training_data=trainset())


def test_engine_refusals(tmp_path):
    with make_engine(tmp_path) as engine:
        with pytest.raises(ValueError, match=r"load_module_strict=False\) is not supported"):
            engine.load_checkpoint(tmp_path, load_module_strict=False)
        with pytest.raises(ValueError, match="custom_load_fn"):
            engine.load_checkpoint(tmp_path, custom_load_fn=lambda *a: None)
        with pytest.raises(RuntimeError, match="groups are fixed when it is made"):
            engine.optimizer.add_param_group({"params": []})


def test_deepspeeds_positional_order_and_its_argument_parser(tmp_path):
    real = pytest.importorskip("deepspeed")  # the peer's own parser is the reference

    argv = ["--deepspeed", "--deepspeed_config", "ds.json"]
    ours = offload.deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(argv)
    theirs = real.add_config_arguments(argparse.ArgumentParser()).parse_args(argv)
    assert vars(ours) == vars(theirs)
    config_path = tmp_path / "ds.json"
    config_path.write_text(json.dumps(ds_config(tmp_path)))
    args = argparse.Namespace(deepspeed_config=str(config_path))
    engine, opt, loader, sched = offload.deepspeed.initialize(args, net(), None, None, trainset())  # DeepSpeed's order
    with engine:
        assert opt is engine.optimizer and loader.batch_size == 4 and sched is None
