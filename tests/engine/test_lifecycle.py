"""After close: every public method refuses clearly, the model holds its values,
nothing of the engine stays alive; every rank of a two-rank run exits 0
(issue 16; Note [a closed engine] in offload/engine/closed.py, Note [releasing
the process group] in offload/transfers/collectives.py)."""
import collections
import gc
import os
import socket
import subprocess
import sys
import weakref

import pytest
import torch
import torch.multiprocessing as mp

import offload
from offload.engine.closed import ANSWERED_AFTER_CLOSE, EngineClosedError
from offload.engine.engine import Engine
from offload.transfers.collectives import ProcessGroupInfo, _GroupHandle
from tests.support.harness import batches, build, lm_loss, make_config, train_engine

# Every public method and property of the class (DeepSpeed's surface included).
PUBLIC = sorted(n for n in dir(Engine) if not n.startswith("_") and n not in ANSWERED_AFTER_CLOSE)
CLOSED = r"engine(\.optimizer)?\.\w+.*: this engine was closed \(engine\.close\(\)\)"


def _trained(tmp_path, param="nvme", optim="nvme"):
    model = build("tiny_gpt")
    engine = offload.initialize(model, make_config(param, optim, tmp_path))
    train_engine(engine, batches(2))
    return model, engine


@pytest.fixture(scope="module")
def closed(tmp_path_factory):
    """(model, closed engine, its optimizer, the weights read just before close)."""
    model, engine = _trained(tmp_path_factory.mktemp("closed"))
    before = {k: v.clone() for k, v in engine.full_state_dict(master=True).items()}
    optimizer = engine.optimizer
    engine.close()
    return model, engine, optimizer, before


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_method_refuses_after_close(closed, name):
    _, engine, _, _ = closed
    with pytest.raises(EngineClosedError, match=rf"^engine\.{name}: this engine was closed .*model's parameters "
                                                r"hold their values"):
        attr = getattr(engine, name)
        attr()  # not reached: the attribute itself refuses


DEEPSPEED_ONLY = sorted(n for n in vars(offload.deepspeed.DeepSpeedEngine)
                        if not n.startswith("_") and n != "forward")  # forward: the Engine's own call


@pytest.mark.parametrize("name", DEEPSPEED_ONLY)
def test_every_deepspeed_method_refuses_after_close(tmp_path, name):
    """DeepSpeedEngine's own methods (offload/deepspeed/engine.py) refuse as the Engine's do."""
    ds_engine, *_ = offload.deepspeed.initialize(model=build("tiny_gpt"),
                                                 config=make_config("cpu", "cpu", tmp_path))
    ds_engine.close()
    with pytest.raises(EngineClosedError, match=rf"^engine\.{name}: this engine was closed .*model's parameters "
                                                r"hold their values"):
        attr = getattr(ds_engine, name)
        attr(tmp_path) if name == "save_16bit_model" else attr()


def test_instance_attributes_refuse_after_close(closed):
    _, engine, _, _ = closed
    public = sorted(k for k in vars(engine) if not k.startswith("_") and k not in ANSWERED_AFTER_CLOSE)
    assert {"optimizer", "manager", "shards", "account", "pg", "step_runner", "checkpoints"} <= set(public)
    for name in public:
        with pytest.raises(EngineClosedError, match=CLOSED):
            getattr(engine, name)


@pytest.mark.parametrize("call", ["engine(x)", "with engine", "optimizer.step()", "optimizer.zero_grad()",
                                  "optimizer.state_dict()", "optimizer.load_state_dict({})",
                                  "optimizer.param_groups", "optimizer.add_param_group({})"])
def test_forward_and_the_optimizer_refuse_after_close(closed, call):
    _, engine, optimizer, _ = closed
    x = batches(1)[0][0][0]
    with pytest.raises(EngineClosedError, match=CLOSED):
        if call == "with engine":
            with engine:
                pass
        else:
            eval(call, {"engine": engine, "optimizer": optimizer, "x": x})


def test_close_again_and_what_still_answers(closed):
    model, engine, _, _ = closed
    engine.close()  # idempotent
    assert engine.module is model and engine.global_steps == 2 and engine.config is not None
    assert "closed" in repr(engine)


def test_the_model_holds_its_values_after_close(closed):
    """Plain parameters with the trained (fp32 master) values; the model runs as plain PyTorch."""
    model, _, _, before = closed
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
    x, y = batches(1)[0][0]
    reference = build("tiny_gpt")
    reference.load_state_dict(before)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    lm_loss(model(x), y).backward()  # trains on as a plain model
    assert model.wte.weight.grad is not None


def test_values_that_do_not_fit_raise_on_read_and_methods_say_save_first(tmp_path, monkeypatch):
    """The documented way out is to save before closing; after close every read of a parameter
    (and every engine method) says so rather than returning placeholders."""
    model, engine = _trained(tmp_path)
    saved = engine.full_state_dict(master=True)  # what a user saves before closing (or save_checkpoint)
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: collections.namedtuple("VM", "available")(0))
    engine.close()
    monkeypatch.undo()
    gone = r"its engine was closed and its value did not fit in memory to be given back; read or save"
    for read in (lambda: model.state_dict(), lambda: model.wte.weight.sum(), lambda: model.wpe.detach(),
                 lambda: model(batches(1)[0][0][0]), lambda: model.blocks[0].fc.weight.data):
        with pytest.raises(RuntimeError, match=gone):
            read()
    with pytest.raises(EngineClosedError, match=r"did not fit in memory and were not given back: save before "
                                                r"closing \(engine\.save_checkpoint, engine\.save_pretrained\)"):
        engine.full_state_dict()
    assert saved["wte.weight"].abs().sum() > 0  # the saved copy is the way to the weights


@pytest.mark.parametrize("param,optim", [("nvme", "nvme"), ("cpu", "cpu"), ("none", "none")])
def test_nothing_of_the_engine_stays_alive_after_del(tmp_path, param, optim):
    """The engine, its manager, optimizer, shards and their context go with the last reference
    (reference counting alone: no cycle through them); the rest after gc.collect()."""
    model, engine = _trained(tmp_path, param, optim)
    core = [engine, engine.manager, engine.optimizer, engine.shard_context, *engine.shards]
    rest = [engine.account, *engine.swap_stores]
    core_refs, rest_refs = [weakref.ref(p) for p in core], [weakref.ref(p) for p in rest]
    engine.close()
    del core, rest, engine
    gc.disable()
    try:
        alive = [r() for r in core_refs if r() is not None]
        assert not alive, f"alive after del without the garbage collector: {alive}"
    finally:
        gc.enable()
    gc.collect()
    assert not [r() for r in rest_refs if r() is not None]
    assert model(batches(1)[0][0][0]).shape[-1] == 37  # the model is the user's, intact


def test_the_process_group_is_released_for_every_holder():
    handle = _GroupHandle(object())
    info = ProcessGroupInfo(1, 2, _handle=handle)
    held_elsewhere = info  # a ShardContext, a store, a checkpoint job hold the same info
    assert info.group is handle.group
    info.release()
    assert handle.group is None
    with pytest.raises(RuntimeError, match=r"rank 1: this engine was closed and released its process group"):
        held_elsewhere.all_gather(torch.empty(2), torch.empty(1))
    assert ProcessGroupInfo().group is None  # one process: nothing to hold


# ---- every rank exits 0 -------------------------------------------------------
# Each launch is two fresh processes importing torch: 10-17 s on a 2-core VM.
LAUNCHES = int(os.environ.get("OFFLOAD_EXIT_LAUNCHES", "2"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_rank_spawn_runs_exit_0(tmp_path):
    from tests.engine.two_rank_train import spawn_main

    ctx = mp.get_context("spawn")
    codes = []
    for launch in range(LAUNCHES):
        port = _free_port()
        procs = [ctx.Process(target=spawn_main, args=(r, 2, port, str(tmp_path / f"l{launch}")))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
            if p.is_alive():
                p.kill()
                p.join()
        codes.append([p.exitcode for p in procs])
    assert all(c == [0, 0] for c in codes), f"exit codes per launch: {codes}"


@pytest.mark.slow
def test_two_rank_torchrun_runs_exit_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    failures = []
    for launch in range(max(1, LAUNCHES // 2)):
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
             str(_free_port()), "-m", "tests.engine.two_rank_train", str(tmp_path / f"l{launch}")],
            env=env, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            failures.append((launch, run.returncode, run.stderr[-3000:]))
    assert not failures, failures
