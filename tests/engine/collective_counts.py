"""What the collective tests count: each torch.distributed call, the order plain PyTorch
finishes gradients in, and the buckets DeepSpeed's greedy packing would make."""
import copy

import torch.distributed as dist

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
