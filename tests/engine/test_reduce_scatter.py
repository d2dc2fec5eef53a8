"""Two ranks on gloo: gradients leave backward in buckets of reduce_bucket_size
elements, one reduce-scatter each, every rank receiving exactly its partition
(Note [gradient buckets] in offload/transfers/grad_buckets.py).

Counted in the workers by wrapping torch.distributed's functions: per backward,
as many reduce-scatters as the buckets a greedy packing of the gradients in
autograd's arrival order makes, their bytes those of the padded fp32 gradients
(a ring reduce-scatter sends half of what the all_reduce it replaces sent), no
all_reduce larger than a scalar, and training still equal to plain PyTorch."""
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from offload.transfers.collectives import ProcessGroupInfo
from offload.transfers.grad_buckets import GradientBuckets
from offload.partition.shard_context import partition_numel
from tests.support.harness import batches, build, make_config, run_engine, run_reference
from tests.engine.collective_counts import CollectiveCounter, arrival_order, expected_buckets
from tests.engine.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.torch_release]  # spawns two ranks: ~10 s

BUCKET = 2000  # elements: tiny_gpt's 2,376-element weights go alone, the rest share buckets
STEPS = 3


def _count_worker(rank, world, port, nvme_root, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for key, param in (("cpu", "cpu"), ("nvme", "nvme")):
            try:
                model = build("tiny_gpt")
                data = batches(STEPS, world=world, seed=3)
                ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2,
                                                      weight_decay=0.01, world=world)
                cfg = make_config(param, "cpu", os.path.join(nvme_root, key))
                cfg["zero_optimization"]["reduce_bucket_size"] = BUCKET
                with CollectiveCounter() as counter:
                    weights, losses, _ = run_engine(model, data, cfg, rank=rank)
                names = arrival_order(model, *data[0][rank])
                numel = dict((n, p.numel()) for n, p in model.named_parameters())
                padded = [world * partition_numel(numel[n], world) for n in names]
                buckets = expected_buckets(padded, BUCKET)
                scatters = counter.of("reduce_scatter_single", "reduce_scatter_tensor")
                # One reduce-scatter per bucket per backward, of the bucket's padded fp32 gradients.
                assert [n for _, n, _ in scatters] == [sum(b) for b in buckets] * STEPS, \
                    (scatters, buckets)
                assert len(buckets) < len(names)  # small gradients did share buckets
                grad_bytes = sum(padded) * 4
                assert sum(b for _, _, b in scatters) == grad_bytes * STEPS
                # Ring volume sent per rank: (W-1)/W of the input for a reduce-scatter,
                # 2 (W-1)/W for the all_reduce per parameter that it replaces.
                ring_sent = (world - 1) / world * grad_bytes
                assert ring_sent == 0.5 * (2 * (world - 1) / world * grad_bytes)
                assert all(n == 1 for _, n, _ in counter.of("all_reduce")), counter.of("all_reduce")
                torch.testing.assert_close(losses, ref_losses[:, rank])
                for pname, p in ref_model.named_parameters():
                    torch.testing.assert_close(weights[pname], p.detach(), msg=lambda m: f"{pname}: {m}")
                results.put((rank, key, "ok"))
            except Exception:  # noqa: BLE001 - reported to the parent test
                results.put((rank, key, traceback.format_exc()))
        try:  # the bucket's average equals all_reduce + divide + slice, bit for bit
            _check_bitwise(rank, world)
            results.put((rank, "bitwise", "ok"))
        except Exception:  # noqa: BLE001
            results.put((rank, "bitwise", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class _FakeShard:
    def __init__(self, numel, world):
        self.numel = numel
        self.part_numel = partition_numel(numel, world)
        self.padded_numel = self.part_numel * world


def _check_bitwise(rank, world):
    pg = ProcessGroupInfo.current()
    gen = torch.Generator().manual_seed(100 + rank)
    shards = [_FakeShard(n, world) for n in (7, 1, 301, 64, 5000, 3)]
    grads = [torch.randn(s.numel, generator=gen).to(dtype) for s, dtype in
             zip(shards, (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32,
                          torch.float32))]
    got = {}
    buckets = GradientBuckets(pg, 400, lambda shard, part: got.__setitem__(id(shard), part.clone()))
    for s, g in zip(shards, grads):
        buckets.add(s, g)
    buckets.flush()
    for s, g in zip(shards, grads):
        full = torch.zeros(s.padded_numel)
        full[:s.numel] = g
        dist.all_reduce(full)
        full.div_(world)
        torch.testing.assert_close(got[id(s)], full[rank * s.part_numel:(rank + 1) * s.part_numel],
                                   rtol=0, atol=0)


def test_gradients_reduce_scattered_in_buckets(tmp_path):
    outcome, procs = run_ranks(_count_worker, (str(tmp_path),))
    failures = {k: v for k, v in outcome.items() if v != "ok"}
    assert not failures, "\n".join(f"rank {r} {key}:\n{msg}" for (r, key), msg in failures.items())
    assert len(outcome) == 2 * 3, f"workers reported {sorted(outcome)}"
    assert [p.exitcode for p in procs] == [0, 0], f"worker exit codes {[p.exitcode for p in procs]}"
