"""Updates started during backward go on under the next forward, head first
(Note [head first after backward] in offload/transfers/device_copies.py): on the
sim with the host Adam made slow, step() returns before every update ran; the
rest run newest gradient first; every read of a value waits for its own update,
so losses and weights equal the CPU engine's bit for bit; a failed update is
raised by what reads its value next."""
import copy
import threading
import time

import pytest
import torch

import offload
from offload.step.phase import StepPhase
from offload.optim.sharded_adam import ShardedAdam
from offload.transfers.device_copies import GradientsToHost
from offload.partition.shard import Shard

from tests.support.harness import batches, build, engine_weights, lm_loss, make_config, train_engine

STEPS = 3


def _cpu_engine(model, data, cfg, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cpu")
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        losses = train_engine(engine, data)
        return losses, engine_weights(engine)


def _slow_updates(monkeypatch, log):
    """Each update sleeps first; log gets (shard index, whether step() had returned)."""
    update = ShardedAdam.update_shard

    def slow(self, shard, *args):
        time.sleep(0.004)
        log.append((shard.index, log_state["stepped"]))
        return update(self, shard, *args)

    log_state = {"stepped": False}
    monkeypatch.setattr(ShardedAdam, "update_shard", slow)
    return log_state


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_updates_go_on_under_the_next_forward_head_first_with_the_same_bits(tmp_path, monkeypatch, precision):
    model, data = build("tiny_gpt"), batches(STEPS, seed=11)
    cfg = make_config("cpu", "cpu", tmp_path, precision=precision)
    expected_losses, expected_weights = _cpu_engine(model, data, cfg, monkeypatch)

    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    log, sent = [], []
    state = _slow_updates(monkeypatch, log)
    put = GradientsToHost.put
    monkeypatch.setattr(GradientsToHost, "put", lambda self, shard, grad: (sent.append(shard.index), put(self, shard, grad))[1])
    losses, after_step = [], []
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        for per_rank in data:
            x, y = per_rank[0]
            state["stepped"], sent[:] = False, []
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            state["stepped"] = True
            assert engine.step_runner.phase is StepPhase.UPDATING_DEFERRED
            losses.append(loss.detach().float())
            engine.step_runner.deferred.settle()  # the step's updates, all of them, before the next
            late = [i for i, stepped in log if stepped]
            log.clear()
            after_step.append((late, list(sent)))
        weights = engine_weights(engine)
    torch.testing.assert_close(torch.stack(losses), expected_losses, rtol=0, atol=0)
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    # Some updates ran after step() returned; after the one already under way, newest gradient first.
    for late, sent_order in after_step:
        assert len(late) >= 3, after_step
        assert late[1:] == [i for i in reversed(sent_order) if i in late[1:]], (late, sent_order)


def test_a_value_read_after_step_is_the_updated_one(tmp_path, monkeypatch):
    """A parameter read between step() and the next forward waits for its update;
    with the gate removed (Shard.await_update a no-op) the read is the old value."""
    model, data = build("tiny_gpt"), batches(1, seed=12)
    cfg = make_config("cpu", "cpu", tmp_path)
    _, expected = _cpu_engine(model, data, cfg, monkeypatch)
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    _slow_updates(monkeypatch, [])

    def first_value_read_after_step():
        with offload.initialize(copy.deepcopy(model), cfg) as engine:
            x, y = data[0][0]
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            name, param = next(iter(engine.module.named_parameters()))  # the head: updated last... or first
            value = param.detach().clone()
            engine.step_runner.deferred.settle()
            return name, value

    name, value = first_value_read_after_step()
    torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    monkeypatch.setattr(Shard, "await_update", lambda self: None)
    name, value = first_value_read_after_step()
    assert not torch.equal(value, expected[name])


def test_an_update_that_fails_under_the_next_forward_is_raised_by_it(tmp_path, monkeypatch):
    model, data = build("tiny_gpt"), batches(2, seed=13)
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    update = ShardedAdam.update_shard
    calls = {"n": 0}

    def failing(self, shard, *args):
        calls["n"] += 1
        if calls["n"] == len(self.shards) + 1:  # the second step's first update
            raise OSError("injected update failure")
        return update(self, shard, *args)

    monkeypatch.setattr(ShardedAdam, "update_shard", failing)
    with offload.initialize(copy.deepcopy(model), make_config("cpu", "cpu", tmp_path)) as engine:
        x, y = data[0][0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        x, y = data[1][0]
        with pytest.raises(OSError, match="injected update failure"):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            engine(x)
        assert threading.active_count() >= 1  # the engine closes cleanly below
