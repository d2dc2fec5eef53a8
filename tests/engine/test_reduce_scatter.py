"""Two ranks on gloo: gradients leave backward in buckets of reduce_bucket_size
elements, one reduce-scatter each, every rank receiving exactly its partition
(Note [gradient buckets] in offload/partition/grad_buckets.py).

Counted in the workers by wrapping torch.distributed's functions: per backward,
as many reduce-scatters as the buckets a greedy packing of the gradients in
autograd's arrival order makes, their bytes those of the padded fp32 gradients
(a ring reduce-scatter sends half of what the all_reduce it replaces sent), no
all_reduce larger than a scalar, and training still equal to plain PyTorch."""
import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from offload.partition.collectives import ProcessGroupInfo
from offload.partition.grad_buckets import GradientBuckets
from offload.partition.shard_context import partition_numel
from tests.engine.harness import batches, build, lm_loss, make_config, run_engine, run_reference
from tests.engine.test_distributed import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.torch_release]  # spawns two ranks: ~10 s

BUCKET = 2000  # elements: tiny_gpt's 2,376-element weights go alone, the rest share buckets
STEPS = 3


class _Counter:
    """Wraps torch.distributed's collectives: (name, input numel, input bytes) per call."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor",
             "broadcast")

    def __init__(self):
        self.calls = []
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            if not hasattr(dist, name):  # reduce_scatter_single: torch 2.13 on
                continue
            real = self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, real))
        return self

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            t = args[1] if name in ("reduce_scatter_single", "reduce_scatter_tensor",
                                    "all_gather_into_tensor") else args[0]
            self.calls.append((name, t.numel(), t.numel() * t.element_size()))
            return real(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)

    def of(self, *names):
        return [c for c in self.calls if c[0] in names]


def _arrival_order(model, x, y):
    """Parameter names in the order autograd finishes their gradients (plain PyTorch)."""
    model = copy.deepcopy(model)
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    lm_loss(model(x), y).backward()
    return order


def _expected_buckets(sizes, cap):
    """Greedy packing in arrival order, as DeepSpeed's: a bucket is sent when the next
    gradient would overflow it or it is full; one larger than `cap` goes alone."""
    buckets, current = [], []
    for n in sizes:
        if current and sum(current) + n > cap:
            buckets.append(current)
            current = []
        current.append(n)
        if sum(current) >= cap:
            buckets.append(current)
            current = []
    return buckets + ([current] if current else [])


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
                with _Counter() as counter:
                    weights, losses, _ = run_engine(model, data, cfg, rank=rank)
                names = _arrival_order(model, *data[0][rank])
                numel = dict((n, p.numel()) for n, p in model.named_parameters())
                padded = [world * partition_numel(numel[n], world) for n in names]
                buckets = _expected_buckets(padded, BUCKET)
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
