"""Swap data integrity: a flipped byte is caught before it is used, a failed
write never loses a value, and a full disk is named before anything is written
(issue 16; Note [swap data checksums], Note [failed in-place writes],
Note [a failed step], Note [free space for the stores])."""
import copy
import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

import offload
import offload.aio as aio
from offload.aio.swap_store import SwapStore
from offload.aio.swap_config import SwapConfig
from tests.support.harness import batches, build, engine_weights, lm_loss, make_config
from tests.aio.tmpfs import mounted_tmpfs


def _train(engine, data):
    for per_rank in data:
        x, y = per_rank[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()


def _swap_files(engine) -> dict[str, bytes]:
    """Every swap file's bytes: parameters, masters and moments on NVMe."""
    out = {}
    for store in engine.swap_stores:
        for path in Path(store.directory).glob("*.swp"):
            out[str(path)] = path.read_bytes()
    return out


def _flip(path, at: int = 4096 + 8) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def _nvme_engine(tmp_path, model=None, **kwargs):
    return offload.initialize(copy.deepcopy(model or build("tiny_gpt")),
                              make_config("nvme", "nvme", tmp_path / "swap", **kwargs))


# ------------------------------------------------------------------ checksums


def test_engine_swap_stores_verify_checksums_by_default(tmp_path):
    with _nvme_engine(tmp_path) as engine:
        assert engine.swap_stores and all(s.config.checksum for s in engine.swap_stores)


def test_flipped_byte_in_a_parameter_file_stops_the_forward(tmp_path):
    data = batches(2)
    with _nvme_engine(tmp_path) as engine:
        _train(engine, data[:1])
        shard = engine.shards[0]
        path = engine.shard_context.param_store.path_of(shard)
        _flip(path)
        before, steps = _swap_files(engine), dict(engine.optimizer.shard_steps)
        x, y = data[1][0]
        with pytest.raises(aio.CorruptFileError, match=f"{path}.*CRC32C? mismatch for key 'param.{shard.index}'"):
            engine.backward(lm_loss(engine(x), y))
        assert _swap_files(engine) == before and engine.optimizer.shard_steps == steps


def test_flipped_byte_in_an_optimizer_file_stops_the_step_before_any_update(tmp_path):
    data = batches(2)
    with _nvme_engine(tmp_path) as engine:
        _train(engine, data[:1])
        first = engine.step_runner.in_backward.arrival_order[0]  # the first update of the next step
        path = engine.optimizer.states.state_file(first)
        _flip(path)
        before, steps = _swap_files(engine), dict(engine.optimizer.shard_steps)
        x, y = data[1][0]
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(aio.CorruptFileError, match=f"{path}.*mismatch for key 'optim.{first.index}'"):
            engine.step()
        # The corrupt value was not used, and no other shard moved on without it.
        assert _swap_files(engine) == before and engine.optimizer.shard_steps == steps
        with pytest.raises(RuntimeError, match="after a failed engine.step"):
            engine(x)


def test_opt_out_key_turns_verification_off(tmp_path):
    data = batches(2)
    model = build("tiny_gpt")
    with _nvme_engine(tmp_path, model, extra={"aio": {"verify_swap_checksums": False}}) as engine:
        assert not any(s.config.checksum for s in engine.swap_stores)
        _train(engine, data[:1])
        _flip(engine.shard_context.param_store.path_of(engine.shards[0]))
        _train(engine, data[1:])  # the user accepted the risk: trained on, unnoticed


def test_opt_out_key_must_be_a_bool(tmp_path):
    from offload.config import ConfigError
    with pytest.raises(ConfigError, match="aio.verify_swap_checksums"):
        _nvme_engine(tmp_path, extra={"aio": {"verify_swap_checksums": "no"}})


# ------------------------------------------------------------- failed writes


def test_failed_lent_in_place_write_keeps_the_value(tmp_path):
    store = SwapStore(SwapConfig(nvme_path=tmp_path, capacity_bytes=16 << 20, buffer_bytes=64 << 10,
                                 atomic=False, checksum=True))
    store.swap_out("w", torch.zeros(1 << 18)).wait()
    new = aio.aligned_empty(1 << 20).view(torch.float32).fill_(3.0)
    store._io._inject_fault("pwrite", errno.ENOSPC, after_units=1)
    with pytest.raises(aio.AioError, match="No space left"):
        store.swap_out("w", new, borrow=True).wait()
    assert store.unwritten_keys == ["w"]
    new.fill_(7.0)  # the lender reuses its buffer: the store kept a copy
    torch.testing.assert_close(store.swap_in("w").wait(), torch.full((1 << 18,), 3.0), rtol=0, atol=0)
    store.rewrite_unwritten()
    assert store.unwritten_keys == []
    reader = SwapStore(SwapConfig(nvme_path=tmp_path, capacity_bytes=0, buffer_bytes=64 << 10,
                                  atomic=False, checksum=True))
    torch.testing.assert_close(reader.swap_in("w").wait(), torch.full((1 << 18,), 3.0), rtol=0, atol=0)
    reader.close()
    store.close()


def _inject(engine, err, after_units):
    # With one nvme_path the optimizer writes state and new parameter values through the state store.
    engine.optimizer.states.state_store._io._inject_fault("pwrite", err, after_units=after_units)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("after_units", [0, 5])
def test_write_failing_mid_step_then_retried_equals_the_uninterrupted_run(tmp_path, err, after_units):
    model, data = build("tiny_gpt"), batches(3)
    with _nvme_engine(tmp_path / "a", model) as engine:
        _train(engine, data)
        expected = engine_weights(engine)
    with _nvme_engine(tmp_path / "b", model) as engine:
        _train(engine, data[:1])
        _inject(engine, err, after_units)
        x, y = data[1][0]
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(aio.AioError, match=os.strerror(err)) as info:
            engine.step()
        assert any("retries this step" in note for note in info.value.__notes__)
        with pytest.raises(RuntimeError, match="call engine.step\\(\\) again to retry it"):
            engine(x)
        engine.step()  # the retry
        _train(engine, data[2:])
        got = engine_weights(engine)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_failed_step_then_load_checkpoint_equals_a_fresh_resume(tmp_path):
    model, data = build("tiny_gpt"), batches(3)
    with _nvme_engine(tmp_path / "a", model) as engine:
        _train(engine, data[:1])
        engine.save_checkpoint(tmp_path / "ckpt")
        _inject(engine, errno.ENOSPC, 3)
        x, y = data[1][0]
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(aio.AioError):
            engine.step()
        with pytest.raises(RuntimeError, match="after a failed engine.step"):
            engine.save_checkpoint(tmp_path / "ckpt")
        engine.load_checkpoint(tmp_path / "ckpt")
        _train(engine, data[1:])
        got = engine_weights(engine)
    with _nvme_engine(tmp_path / "b", model) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        _train(engine, data[1:])
        expected = engine_weights(engine)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_load_checkpoint_after_a_backward_without_step_trains_on(tmp_path):
    """An overlapped update left in flight (backward, no step) is finished, not left to block forwards."""
    model, data = build("tiny_gpt"), batches(2)
    with _nvme_engine(tmp_path / "a", model) as engine:
        engine.save_checkpoint(tmp_path / "ckpt")
        x, y = data[0][0]
        engine.backward(lm_loss(engine(x), y))
        engine.load_checkpoint(tmp_path / "ckpt")
        _train(engine, data)
        got = engine_weights(engine)
    with _nvme_engine(tmp_path / "b", model) as engine:
        _train(engine, data)
        expected = engine_weights(engine)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- free space


def _usage(free):
    return shutil._ntuple_diskusage(total=1 << 40, used=(1 << 40) - free, free=free)


def _model_values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_unchanged(model, before):
    for name, p in model.named_parameters():
        assert p.dtype == before[name].dtype, name
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_stores_on_one_file_system_are_checked_together(tmp_path, monkeypatch):
    model = build("tiny_gpt")
    before = _model_values(model)
    cfg = make_config("nvme", "nvme", tmp_path / "swap", precision="bf16")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _usage(0))
    with pytest.raises(aio.SwapStoreError, match="not enough free space") as info:
        offload.initialize(model, cfg)
    import re
    parts = [int(n) for n in re.findall(r"(\d+) bytes under", str(info.value))]
    assert len(parts) == 2  # the parameter and the optimizer-state store
    free = max(parts) + 4096  # room for either store alone, not for both
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _usage(free))
    with pytest.raises(aio.SwapStoreError, match=f"{sum(parts)} bytes needed.*{tmp_path}.*{free} bytes free"):
        offload.initialize(model, cfg)
    _assert_unchanged(model, before)


def test_interrupted_initialize_gives_back_the_original_fp32_values(tmp_path, monkeypatch):
    from offload.optim.sharded_adam import ShardedAdam

    model = build("tiny_gpt")
    before = _model_values(model)
    calls = []
    real = ShardedAdam.init_state

    def failing(self, shard, init):
        calls.append(shard.index)
        if len(calls) == 5:  # four parameters already home in bf16, the fifth half way
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(self, shard, init)

    monkeypatch.setattr(ShardedAdam, "init_state", failing)
    with pytest.raises(OSError, match="injected"):
        offload.initialize(model, make_config("nvme", "nvme", tmp_path / "swap", precision="bf16"))
    _assert_unchanged(model, before)


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path, "400k", "the injected failure above covers the restore") as mnt:
        yield mnt


def test_real_disk_full_at_initialize(small_tmpfs, monkeypatch):
    model = build("tiny_gpt")
    before = _model_values(model)
    cfg = make_config("nvme", "nvme", small_tmpfs, precision="bf16")
    with pytest.raises(aio.SwapStoreError, match=f"bytes needed.*{small_tmpfs}.*bytes free"):
        offload.initialize(model, cfg)
    _assert_unchanged(model, before)
    # Told there is room, the disk fills while the parameters move home: the model still comes back whole.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _usage(1 << 30))
    with pytest.raises(OSError, match="No space left"):
        offload.initialize(model, cfg)
    _assert_unchanged(model, before)


def test_checkpoint_on_a_too_full_disk_names_path_and_bytes(tmp_path, monkeypatch):
    data = batches(2)
    ckpt = tmp_path / "ckpt"
    with _nvme_engine(tmp_path) as engine:
        _train(engine, data[:1])
        engine.save_checkpoint(ckpt, tag="a")
        _train(engine, data[1:])
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: _usage(10000))
        with pytest.raises(OSError, match=f"'b' not saved: {ckpt} has 10000 bytes free, this rank's files need"):
            engine.save_checkpoint(ckpt, tag="b")
        monkeypatch.setattr(shutil, "disk_usage", real)
        # A disk that fills during the write: the file named.
        from offload.checkpoint_io import files

        def full(src, dst):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(files, "copy_file", full)
        with pytest.raises(OSError, match="'b' not saved: No space left on device writing .*nvme/.*bytes needed"):
            engine.save_checkpoint(ckpt, tag="b")
        assert sorted(os.listdir(ckpt)) == ["a", "latest"] and (ckpt / "latest").read_text().strip() == "a"
        engine.load_checkpoint(ckpt)  # the previous checkpoint, intact
        assert engine.global_steps == 1
