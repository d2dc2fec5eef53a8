"""A DeepSpeed ZeRO-Infinity config, as DeepSpeed's documentation writes it,
loads unchanged and trains exactly like plain PyTorch; the keys with no
effect here are named once, at initialize (Note [DeepSpeed keys])."""
import copy
import logging

import pytest
import torch

import offload
from offload.aio import Backend
from tests.support.harness import batches, build, run_engine, run_reference

# DeepSpeed's configuration reference (deepspeed.ai/docs/config-json), its
# ZeRO-Infinity example and its "aio" section, with the documented values.
# Only nvme_path is changed (to the test's directory), plus an optimizer and a
# micro batch, which that example leaves to the rest of the file.
DS_DOCS_ZERO_INFINITY = {
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
    },
    "aio": {
        "block_size": 1048576,
        "queue_depth": 8,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    },
}


def docs_config(nvme_path, **top):
    cfg = copy.deepcopy(DS_DOCS_ZERO_INFINITY)
    for section in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][section]["nvme_path"] = str(nvme_path)
    cfg.update({"train_micro_batch_size_per_gpu": 3,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}, **top)
    return cfg


@pytest.mark.parametrize("persistence", ["as documented", 0])
def test_docs_zero_infinity_config_trains_like_pytorch(tmp_path, caplog, persistence):
    cfg = docs_config(tmp_path)
    if persistence == 0:  # every parameter on NVMe, not only those above 1e5 elements
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    model, data = build("tiny_gpt"), batches(8)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    with caplog.at_level(logging.WARNING, logger="offload"):
        weights, losses, engine = run_engine(model, data, cfg)
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
    assert engine.config.aio.intra_op_parallelism == 1  # aio.thread_count, mapped
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(lines) == 1  # once, at initialize
    assert "zero_optimization.offload_optimizer.fast_init:" in lines[0]
    assert "thread_count" not in lines[0]  # mapped, so it takes effect


def test_a_config_whose_every_key_takes_effect_logs_nothing(tmp_path, caplog):
    cfg = docs_config(tmp_path)
    del cfg["zero_optimization"]["offload_optimizer"]["fast_init"]
    del cfg["zero_optimization"]["offload_optimizer"]["pin_memory"]  # Note [pin_memory]: no effect
    with caplog.at_level(logging.WARNING, logger="offload"):
        run_engine(build("tiny_gpt"), batches(1), cfg)
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]


def test_thread_count_sets_the_io_threads_of_the_swap_store(tmp_path):
    cfg = docs_config(tmp_path)
    cfg["aio"]["thread_count"] = 3
    with offload.initialize(build("tiny_gpt"), cfg) as engine:
        assert engine.config.aio.intra_op_parallelism == 3
        assert [store.io.config.intra_op_parallelism for store in engine.swap_stores] == [3]


@pytest.mark.parametrize("key, value, seen", [
    ("block_size", 1 << 16, lambda io: io.config.block_size == 1 << 16),
    ("queue_depth", 5, lambda io: io.config.queue_depth == 5),
    ("intra_op_parallelism", 2, lambda io: io.config.intra_op_parallelism == 2),
    ("backend", "threads", lambda io: io.backend is Backend.THREADS),
])
def test_every_aio_key_reaches_the_swap_stores(tmp_path, key, value, seen):
    cfg = docs_config(tmp_path)
    cfg["aio"][key] = value
    if key == "intra_op_parallelism":
        del cfg["aio"]["thread_count"]
    with offload.initialize(build("tiny_gpt"), cfg) as engine:
        assert engine.swap_stores and all(seen(store.io) for store in engine.swap_stores)
