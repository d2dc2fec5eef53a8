"""What the collective tests count: each torch.distributed call, the order plain PyTorch
finishes gradients in, the buckets DeepSpeed's greedy packing would make, and the gathers
a step takes."""
import copy

import torch
import torch.distributed as dist

from offload.partition import manager as manager_module
from offload.partition.shard import Shard
from offload.partition.shard_context import Residency
from tests.support.harness import lm_loss


class CollectiveCounter:
    """Wraps torch.distributed's collectives: (name, input numel, input bytes) per call."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce", "all_gather_single",
             "all_gather_into_tensor", "broadcast")

    def __init__(self):
        self.calls = []
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            if not hasattr(dist, name):  # reduce_scatter_single, all_gather_single: torch 2.13 on
                continue
            real = self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, real))
        return self

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            t = args[1] if name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
                                    "all_gather_into_tensor") else args[0]
            self.calls.append((name, t.numel(), t.numel() * t.element_size()))
            return real(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)

    def of(self, *names):
        return [c for c in self.calls if c[0] in names]


def arrival_order(model, x, y):
    """Parameter names in the order autograd finishes their gradients (plain PyTorch)."""
    model = copy.deepcopy(model)
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    lm_loss(model(x), y).backward()
    return order


def expected_buckets(sizes, cap):
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


class Gathers:
    """Wraps Shard.gather: (name, padded numel, itemsize) of each gather that materialises
    the parameter (it was not already gathered); and the manager's
    start_all_gather_ahead: the packed all-gathers started ahead of use and the
    parameters in them (Note [all-gathers ahead])."""

    def __init__(self):
        self.taken = []
        self.packs = self.ahead = 0

    def __enter__(self):
        self._real, self._real_ahead = real, real_ahead = Shard.gather, manager_module.start_all_gather_ahead

        def gather(shard):
            if shard.residency is not Residency.GATHERED:
                self.taken.append((shard.name, shard.padded_numel, shard.dtype.itemsize))
            return real(shard)

        def start_all_gather_ahead(shards):
            self.packs += 1
            self.ahead += len(shards)
            return real_ahead(shards)
        Shard.gather, manager_module.start_all_gather_ahead = gather, start_all_gather_ahead
        return self

    def __exit__(self, *exc):
        Shard.gather, manager_module.start_all_gather_ahead = self._real, self._real_ahead


def saved_for_backward(model, x, y) -> set[str]:
    """Names of the parameters whose value autograd saves for backward (plain PyTorch)."""
    model = copy.deepcopy(model)
    by_storage = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
    saved = set()

    def pack(t):
        name = by_storage.get(t.untyped_storage().data_ptr())
        if name is not None:
            saved.add(name)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x), y)
    loss.backward()
    return saved


def expected_gathers(names: list[str], saved: set[str]) -> list[str]:
    """tiny_gpt's gathers in one step before any is kept across the turn (docstring)."""
    return names + ["wte.weight"] + sorted(saved)
