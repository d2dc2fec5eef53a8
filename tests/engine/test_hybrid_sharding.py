"""Two nodes of two ranks each, on this one machine: four gloo ranks, OFFLOAD_NODE naming
ranks 0-1 node n0 and ranks 2-3 node n1 (Note [node names] in offload/node.py).

The hybrid layout (Note [hybrid sharding] in offload/transfers/layout.py, the default
"node") against the flat one ("world"), each with cpu, nvme and auto offload, fp32 and
bf16:
  - losses and weights equal plain PyTorch on the global batch (four micro-batches);
  - the bytes each link class carried in a step (Note [link classes]) equal the closed
    form, to the byte. Per rank, with G the shard group's size (2 hybrid, 4 flat),
    P = sum over tiny_gpt's parameters of G * partition_numel (the padded gradients)
    and the gathers of tests/engine/test_collective_bytes.py (each parameter at its use
    in forward and again where backward needs it, less those kept across the turn):
      shard group     reduce_scatter: one call per bucket, 4 * P sent, 4 * P / G
                      received; all_gather: itemsize * padded numel of each gather
                      received, 1/G of it sent; all_reduce: scalars (< 64 bytes)
      replica group   (hybrid only) all_reduce: one call per bucket, 4 * P / G sent
                      and received; nothing else
    The hybrid layout's shard group is within a node and its replica group across the
    nodes: across nodes it carries only those gradient partitions. The flat layout's
    one group spans both nodes: everything it carries crosses them, nothing stays
    within a node.
Gradient accumulation, clipping by the global norm and frozen parameters, hybrid
against plain PyTorch too (WINDOW_CASES: losses and weights). With a window of 2
the gradients cross the nodes once, at its last backward (Note [gradients across
groups once a window] in offload/transfers/grad_buckets.py), whether engine.step(),
a loop of the user's own or a checkpoint saved inside the window drives it
(_once_a_window). Resuming a hybrid checkpoint at one node of two ranks and at two nodes of one rank
each: tests/checkpoint_io/test_resume_world_size.py."""
import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from offload.partition.shard_context import partition_numel
import offload
from tests.engine.collective_counts import Gathers, arrival_order, expected_buckets, expected_gathers, \
    saved_for_backward
from tests.engine.ranks import run_ranks
from tests.support.harness import (batches, build, lm_loss, make_config, run_reference, run_reference_mixed,
                                  train_engine)

pytestmark = pytest.mark.slow  # spawns four ranks

WORLD, PER_NODE = 4, 2
BUCKET = 2000  # elements, as in test_collective_bytes: several buckets a step
STEPS = 2      # counted, after one warm-up step (the prefetch order is learned there)
FP32 = 4
CASES = [  # layout, offload_param, offload_optimizer, precision
    ("node", "cpu", "cpu", "fp32"),
    ("world", "cpu", "cpu", "fp32"),
    ("node", "nvme", "nvme", "fp32"),
    ("world", "nvme", "nvme", "fp32"),
    ("node", "auto", "auto", "fp32"),
    ("world", "auto", "auto", "fp32"),
    ("node", "cpu", "cpu", "bf16"),
    ("world", "nvme", "cpu", "bf16"),
]
WINDOW_CASES = [  # layout, offload_param, offload_optimizer, accumulation steps, clip, frozen prefix
    ("node", "cpu", "cpu", 2, 0.05, None),
    ("node", "nvme", "nvme", 3, 0.0, "blocks.0."),
    ("node", "cpu", "nvme", 1, 0.05, "wte"),
]


def _config(layout, param, optim, precision, nvme_path):
    cfg = make_config(param, optim, nvme_path, precision=precision)
    zero = cfg["zero_optimization"]
    zero.update(reduce_bucket_size=BUCKET, shard_group_size=layout)
    for section in ("offload_param", "offload_optimizer"):
        if zero[section]["device"] == "auto":
            zero[section]["nvme_path"] = str(nvme_path)
    return cfg


def _worker(rank, world, port, nvme_root, device, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OFFLOAD_DEVICE=device,
                      OFFLOAD_SIM_SEED=str(rank), OFFLOAD_NODE=f"n{rank // PER_NODE}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put((rank, "deepspeed", _deepspeed_surface(rank, world, os.path.join(nvme_root, "ds"))))
        results.put((rank, "refused", _budget_refusal()))
        results.put((rank, "offload.init", _built_under_init(rank, world, os.path.join(nvme_root, "init"))))
        results.put((rank, "once a window", _once_a_window(rank, world, os.path.join(nvme_root, "window"))))
        for i, case in enumerate(CASES + WINDOW_CASES):
            run = _run_case if i < len(CASES) else _run_window_case
            try:
                results.put((rank, i, run(rank, world, case, os.path.join(nvme_root, f"case{i}"))))
            except Exception:  # noqa: BLE001 - reported to the parent test
                results.put((rank, i, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _run_case(rank, world, case, nvme_path):
    layout, param, optim, precision = case
    group = PER_NODE if layout == "node" else world
    model = build("tiny_gpt")
    data = batches(1 + STEPS, world=world, seed=7)
    if precision == "fp32":
        ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01,
                                              world=world)
    else:
        ref_model, ref_losses = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=1, lr=1e-2,
                                                    weight_decay=0.01, world=world)
    padded = {n: group * partition_numel(p.numel(), group) for n, p in model.named_parameters()}
    buckets = expected_buckets([padded[n] for n in arrival_order(model, *data[0][rank])], BUCKET)
    grad_bytes = FP32 * sum(padded.values())
    gathers_before_reuse = expected_gathers(list(padded), saved_for_backward(model, *data[0][rank]))
    # Kept gathered from forward into backward, as in test_collective_bytes: where homes are
    # read ahead (NVMe, or any home on a device with memory of its own).
    prefetching = param == "nvme" or os.environ.get("OFFLOAD_DEVICE") == "sim"
    kept_across_turn = (sorted(["blocks.1.out.weight", "ln_f.bias", "ln_f.weight", "wte.weight"])
                        if prefetching else [])

    figures = []
    with offload.initialize(copy.deepcopy(model), _config(layout, param, optim, precision, nvme_path)) as engine:
        pg = engine.pg
        assert (pg.world_size, pg.replicas, pg.rank, pg.replica) == (
            group, world // group, rank % group, rank // group)
        hybrid = layout == "node"
        assert pg.links == ({"shard": "within_node", "replica": "across_nodes"} if hybrid
                            else {"shard": "across_nodes", "replica": "across_nodes"})
        losses = [train_engine(engine, data[:1], rank=rank)]  # warm-up: learns the prefetch order
        for step in data[1:]:
            pg.reset_collective_counts()
            with Gathers() as gathers:
                losses.append(train_engine(engine, [step], rank=rank))
            shard = pg.collective_counts("within_node" if hybrid else "across_nodes")
            other = pg.collective_counts("across_nodes" if hybrid else "within_node")
            where = f"{case}: shard group {shard}, other link {other}"
            figures.append({"shard": shard, "other": other})

            assert shard["reduce_scatter"] == {"calls": len(buckets), "bytes_sent": grad_bytes,
                                               "bytes_received": grad_bytes // group}, where
            not_gathered = list(gathers_before_reuse)
            for name, _, _ in gathers.taken:
                not_gathered.remove(name)
            assert sorted(not_gathered) == kept_across_turn, (where, gathers.taken)
            gathered = sum(n * size for _, n, size in gathers.taken)
            assert shard["all_gather"]["bytes_received"] == gathered, where
            assert shard["all_gather"]["bytes_sent"] == gathered // group, where
            assert shard["all_reduce"]["bytes_sent"] < 64 and shard["broadcast"]["calls"] == 0, where
            if hybrid:  # across the nodes: the gradient partitions' all_reduce, nothing else
                assert other["all_reduce"] == {"calls": len(buckets), "bytes_sent": grad_bytes // group,
                                               "bytes_received": grad_bytes // group}, where
                for kind in ("reduce_scatter", "all_gather", "broadcast"):
                    assert other[kind]["calls"] == other[kind]["bytes_sent"] == 0, where
            else:  # one group spanning both nodes: nothing stays within a node
                assert all(c["calls"] == 0 for c in other.values()), where
        weights = {n: v.detach().cpu().clone() for n, v in engine.full_state_dict(master=True).items()}
    torch.testing.assert_close(torch.cat(losses), ref_losses[:, rank], msg=lambda m: f"{case} losses: {m}")
    for name, p in ref_model.named_parameters():  # fp32 masters, the reference's and the engine's
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{case} {name}: {m}")
    return {"ok": True, "figures": figures}


def _deepspeed_surface(rank, world, root):
    """A DeepSpeed script's view of a hybrid job: the job's ranks, not the group's; its
    loader samples over all four; a checkpoint saved and loaded on every rank."""
    try:
        import offload.deepspeed as ds

        cfg = make_config("cpu", "cpu", root)
        data = torch.utils.data.TensorDataset(torch.randint(0, 37, (16, 7)))
        engine, _, loader, _ = ds.initialize(model=build("tiny_gpt"), config=cfg, training_data=data)
        with engine:
            assert (engine.world_size, engine.global_rank) == (world, rank)
            assert (engine.pg.world_size, engine.pg.replicas) == (PER_NODE, world // PER_NODE)
            assert (loader.sampler.num_replicas, loader.sampler.rank) == (world, rank)
            assert engine.train_batch_size() == 3 * world
            engine.save_checkpoint(os.path.join(root, "ck"))
            before = {n: v.clone() for n, v in engine.module.state_dict().items()}
            engine.load_checkpoint(os.path.join(root, "ck"))
            for n, v in engine.module.state_dict().items():
                torch.testing.assert_close(v, before[n], rtol=0, atol=0)
        return {"ok": True, "figures": None}
    except Exception:  # noqa: BLE001 - reported to the parent test
        return traceback.format_exc()


def _built_under_init(rank, world, root):
    """A model built under offload.init, straight into the group's partitions (each rank
    1/2 of every parameter, not 1/4), then trained: equal to plain PyTorch."""
    try:
        cfg = make_config("nvme", "nvme", root)
        plain = build("tiny_gpt")
        with offload.init(cfg) as builder:
            model = build("tiny_gpt")
        assert builder.ctx.pg.replicas == 2
        assert all(s.part_numel == partition_numel(s.numel, PER_NODE) for s in builder.shards)
        data = batches(2, world=world, seed=3)
        ref_model, ref_losses = run_reference(plain, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01, world=world)
        with offload.initialize(model, cfg) as engine:
            assert engine.pg is builder.ctx.pg  # the builder's groups, not a second set
            losses = train_engine(engine, data, rank=rank)
            weights = {n: v.detach().cpu().clone() for n, v in engine.full_state_dict(master=True).items()}
        torch.testing.assert_close(losses, ref_losses[:, rank])
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
        return {"ok": True, "figures": None}
    except BaseException:  # noqa: BLE001 - reported to the parent test
        return traceback.format_exc()


def _once_a_window(rank, world, root):
    """Note [gradients across groups once a window] (offload/transfers/grad_buckets.py):
    across the nodes the gradients go once a window, at its last backward (4P/G bytes
    sent, nothing at the others); equal to torch whichever way the window is driven:
    engine.step(), a loop stepping the optimizer itself with the config's window or with
    its own, and through a checkpoint saved inside the window and resumed."""
    try:
        model = build("tiny_gpt")
        data = batches(4, world=world, seed=13)
        ref_model, ref_losses = run_reference(model, data, gas=2, clip=0.0, lr=1e-2, weight_decay=0.01, world=world)
        grad_bytes = FP32 * sum(PER_NODE * partition_numel(p.numel(), PER_NODE) for p in model.parameters())

        def check(weights, what):
            for name, p in ref_model.named_parameters():
                torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{what} {name}: {m}")

        def full(engine):
            return {n: v.detach().cpu().clone() for n, v in engine.full_state_dict(master=True).items()}

        # engine.step() drives the window: bytes across only at its end; p.grad refused inside it
        cfg = make_config("cpu", "cpu", root, gas=2)
        with offload.initialize(copy.deepcopy(model), cfg) as engine:
            across, losses = [], []
            for i, step in enumerate(data):
                engine.pg.reset_collective_counts()
                losses.append(train_engine(engine, [step], rank=rank))
                across.append(engine.pg.collective_counts("across_nodes")["all_reduce"]["bytes_sent"])
                if i % 2 == 0:
                    with pytest.raises(RuntimeError, match=r"holds only its share of the gradient"):
                        next(engine.module.parameters()).grad
            weights = full(engine)
        assert across == [0, grad_bytes // PER_NODE] * 2, (across, grad_bytes)
        torch.testing.assert_close(torch.cat(losses), ref_losses[:, rank])
        check(weights, "engine.step()")

        # a loop of its own: backward twice, then optimizer.step(), no engine.step()
        for gas in (2, 1):  # the config's window of 2 (never ended by engine.step()), or of 1
            with offload.initialize(copy.deepcopy(model), make_config("cpu", "cpu", root, gas=gas)) as engine:
                for i, per_rank in enumerate(data):
                    x, y = per_rank[rank]
                    (lm_loss(engine(x), y) / 2).backward()
                    if i % 2 == 1:
                        engine.optimizer.step()
                        engine.optimizer.zero_grad()
                check(full(engine), f"own loop, config window {gas}")

        # saved inside the window (after its first micro-step), resumed in a fresh engine
        with offload.initialize(copy.deepcopy(model), cfg) as engine:
            train_engine(engine, data[:1], rank=rank)
            engine.save_checkpoint(os.path.join(root, "ck"), tag="inside")
            train_engine(engine, data[1:], rank=rank)
            uninterrupted = full(engine)
        check(uninterrupted, "saved inside the window")
        with offload.initialize(build("tiny_gpt", seed=9), cfg) as engine:
            engine.load_checkpoint(os.path.join(root, "ck"), tag="inside")
            train_engine(engine, data[1:], rank=rank)
            resumed = full(engine)
        for name, value in uninterrupted.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=lambda m: f"resumed {name}: {m}")
        return {"ok": True, "figures": None}
    except BaseException:  # noqa: BLE001 - reported to the parent test
        return traceback.format_exc()


def _budget_refusal():
    """A host budget the group's share does not fit: refused before anything moves, naming
    the shard group as one way out."""
    try:
        cfg = make_config("cpu", "cpu", None, extra={"memory": {"host_budget": 4096}})
        with pytest.raises(MemoryError, match=r"host tier budget exceeded.*each rank holds 1/2 of the state in "
                                              r"shard groups of 2 \(zero_optimization.shard_group_size\), 1/4 "
                                              r"with 'world'"):
            offload.initialize(build("tiny_gpt"), cfg)
        return {"ok": True, "figures": None}
    except BaseException:  # noqa: BLE001 - reported to the parent test
        return traceback.format_exc()


def _run_window_case(rank, world, case, nvme_path):
    layout, param, optim, gas, clip, frozen = case
    model = build("tiny_gpt")
    for name, p in model.named_parameters():
        p.requires_grad_(frozen is None or not name.startswith(frozen))
    data = batches(2 * gas, world=world, seed=11)
    ref_model, ref_losses = run_reference(model, data, gas=gas, clip=clip, lr=1e-2, weight_decay=0.01, world=world)
    cfg = make_config(param, optim, nvme_path, gas=gas, clip=clip)
    cfg["zero_optimization"].update(reduce_bucket_size=BUCKET, shard_group_size=layout)
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        assert engine.pg.replicas == 2
        losses = train_engine(engine, data, rank=rank)
        if clip:  # the global norm: over the group's partitions once, not once per copy
            assert engine.get_global_grad_norm() > clip
        weights = {n: v.detach().cpu().clone() for n, v in engine.full_state_dict(master=True).items()}
    torch.testing.assert_close(losses, ref_losses[:, rank], msg=lambda m: f"{case} losses: {m}")
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{case} {name}: {m}")
    return {"ok": True, "figures": None}


@pytest.mark.torch_release  # the collectives and groups on every torch release tested
@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_two_nodes_of_two_ranks_hybrid_against_flat(tmp_path, device):
    outcome, procs = run_ranks(_worker, (str(tmp_path), device), world=WORLD, timeout=560)
    failures = {k: v for k, v in outcome.items() if not isinstance(v, dict)}
    every = CASES + WINDOW_CASES
    assert not failures, "\n".join(f"rank {r} case {every[i] if isinstance(i, int) else i}:\n{msg}"
                                    for (r, i), msg in failures.items())
    assert len(outcome) == WORLD * (len(every) + 4), f"workers reported {sorted(outcome)}"
    assert [p.exitcode for p in procs] == [0] * WORLD, f"worker exit codes {[p.exitcode for p in procs]}"
    for i, case in enumerate(CASES):  # every rank carried the same bytes on each link
        figures = [outcome[(r, i)]["figures"] for r in range(WORLD)]
        assert all(f == figures[0] for f in figures), (case, figures)
    # Across the nodes, the hybrid layout's 2 * 4P/2 bytes a rank (its gradient partitions, sent
    # and received) against the flat layout's 4P + P sent and received for the gradients alone,
    # and every gather besides: less than a third (tiny_gpt, fp32: 63,008 against 238,176).
    for (hybrid, flat) in ((0, 1), (2, 3)):
        across_hybrid = sum(k["bytes_sent"] + k["bytes_received"]
                            for k in outcome[(0, hybrid)]["figures"][-1]["other"].values())
        across_flat = sum(k["bytes_sent"] + k["bytes_received"]
                          for k in outcome[(0, flat)]["figures"][-1]["shard"].values())
        assert 3 * across_hybrid < across_flat, (CASES[hybrid], across_hybrid, across_flat)


# ---- nodes not in blocks of one size; a group that does not divide the job ----

def _uneven_worker(rank, world, port, root, results):
    import logging

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OFFLOAD_NODE=["a", "a", "b"][rank])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, data = build("tiny_gpt"), batches(2, world=world, seed=5)
        ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01, world=world)
        warned = []
        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())
        logging.getLogger("offload.transfers.layout").addHandler(handler)
        with offload.initialize(copy.deepcopy(model), make_config("cpu", "cpu", root)) as engine:
            assert (engine.pg.world_size, engine.pg.replicas) == (3, 1)  # the default "node": flat here
            assert engine.pg.links["shard"] == "across_nodes"
            losses = train_engine(engine, data, rank=rank)
            weights = {n: v.detach().cpu().clone() for n, v in engine.full_state_dict(master=True).items()}
        assert any("are not numbered in blocks of one size" in w for w in warned), warned
        torch.testing.assert_close(losses, ref_losses[:, rank])
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
        cfg = make_config("cpu", "cpu", root)
        cfg["zero_optimization"]["shard_group_size"] = 2
        with pytest.raises(ValueError, match=r"shard_group_size 2: the job's 3 ranks do not divide into groups of 2"):
            offload.initialize(build("tiny_gpt"), cfg)
        results.put((rank, "uneven", "ok"))
    except Exception:  # noqa: BLE001 - reported to the parent test
        results.put((rank, "uneven", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_uneven_nodes_train_flat_and_say_why_and_a_group_that_does_not_divide_is_refused(tmp_path):
    outcome, procs = run_ranks(_uneven_worker, (str(tmp_path),), world=3)
    assert outcome == {(r, "uneven"): "ok" for r in range(3)}, "\n".join(map(str, outcome.values()))
    assert [p.exitcode for p in procs] == [0, 0, 0]
