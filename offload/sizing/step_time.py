"""A step's time, predicted per layout from its bytes and the machine's rates.

Note [step-time model]
Per rank and optimizer step (a window of A micro-steps), for N parameters (T of them trained) of c * N bytes as
gathered (c the itemsize; a quantized base's packed bytes instead), W
ranks on n nodes of L = W / n ranks, shard groups of G ranks and R = W / G
groups (Note [hybrid sharding] in offload/transfers/layout.py), and K
gathers of each parameter a micro-step (2 when offloaded: forward, and
backward again), each term in seconds:
  compute      A * (4N + 2T) * tokens / flops: forward 2N, backward 2N for
               the activations' gradients and 2T for the trained weights'
  shard links  a ring over the group carries (G-1)/G of each tensor over each
               of its links: A * (G-1)/G * (K * c * N + 4 * T) bytes
               (gathers, then the fp32 gradients' reduce-scatter); at the
               within-node rate where the group is within a node, else at
               the node's link across nodes (the ring's slowest edge)
  replica      hybrid only, once a window (Note [gradients across groups
               once a window] in transfers/grad_buckets.py): each rank
               all_reduces its fp32 gradient partitions with its R - 1
               replicas, a ring on other nodes:
               2 (R-1)/R * 4T/G bytes a rank, the node's L ranks at once on
               its link (2 (R-1)/R * 4T where G = L)
  bus          a separate device (a GPU), each micro-step: each gather brings
               the rank's partition up (K * c * N / G where the homes are
               off the device) and the fp32 gradient partitions go down
               (4T/G where the optimizer state is on the host or NVMe)
  disk         NVMe homes read K * c * N / G a rank each micro-step, NVMe
               optimizer state is read and written once (2 * 12 * T / G:
               fp32 master, exp_avg, exp_avg_sq), the node's L ranks on one
               disk
  host Adam    T / G parameters a rank at its measured rate, once (state
               off the device)
The step is the largest term where transfers overlap compute (a device with
copy streams: the prefetch scheduler's gathers ahead, updates in backward)
and the sum where they do not (the cpu layer, where one core does all of it
in turn); the bound named is the largest term either way. The rates are
given (`offload estimate --step-time`), measured where the prediction is
checked (benchmarks/hybrid_sharding.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Rates:
    """What the machine does per second (bytes, FLOPs, parameters)."""

    within_node: float  # bytes a rank's link to the others of its node carries, each way
    across_nodes: float  # bytes a node's link to the other nodes carries, each way
    flops: float  # a rank's compute
    adam: float  # parameters a rank's host Adam updates
    bus: float | None = None  # host <-> device, a rank's (None: no separate device)
    disk: float | None = None  # a node's NVMe, shared by its ranks
    overlap: bool = True  # transfers hidden under compute (a device with copy streams)

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name == "overlap" or (value is None and name in ("bus", "disk")):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"step-time rate {name}: {value!r} is not a positive number")


@dataclass(frozen=True)
class Work:
    """One step of one rank's share of the job."""

    params: int
    trainable: int
    param_bytes: int  # every parameter as gathered: c * N, or a quantized base's packed bytes
    tokens: int  # a rank's tokens a step (micro batch x sequence x accumulation)
    world: int
    nodes: int
    group: int  # the shard group (world: flat)
    accumulation: int = 1  # micro-steps a window (A): the prediction is the window's
    params_offloaded: bool = True  # homes off the device: gathered each use, K = 2
    params_on_nvme: bool = False
    state_on_nvme: bool = False

    def __post_init__(self):
        if self.accumulation < 1:
            raise ValueError(f"step-time work: accumulation {self.accumulation} is not a number of micro-steps")
        if self.world % self.nodes or self.world % self.group:
            raise ValueError(f"step-time work: {self.world} ranks must divide into {self.nodes} nodes and "
                             f"groups of {self.group}")


@dataclass(frozen=True)
class Prediction:
    terms: dict[str, float]  # seconds
    step: float
    bound: str
    bytes: dict[str, int]  # per rank a step: within a node, across nodes (Note [link classes])

    def to_dict(self) -> dict:
        return asdict(self)


def predict(work: Work, rates: Rates) -> Prediction:
    """Note [step-time model]."""
    n, t, cn = work.params, work.trainable, work.param_bytes
    per_node, g = work.world // work.nodes, work.group
    replicas = work.world // g
    gathers, a = (2 if work.params_offloaded else 0), work.accumulation
    shard_bytes = a * (g - 1) / g * (gathers * cn + 4 * t)
    group_within = g <= per_node and per_node % g == 0
    terms = {"compute": a * (4 * n + 2 * t) * work.tokens / rates.flops}
    within = across = 0.0
    if group_within:
        within = shard_bytes
        terms["within node"] = shard_bytes / rates.within_node
    else:
        across = shard_bytes
        terms["across nodes"] = shard_bytes / rates.across_nodes
    if replicas > 1:
        replica_rank = 2 * (replicas - 1) / replicas * 4 * t / g  # a rank's ring traffic
        nodes_apart = len({(r * g) // per_node for r in range(replicas)}) > 1
        if nodes_apart:
            across += replica_rank
            terms["across nodes"] = terms.get("across nodes", 0.0) + replica_rank * per_node / rates.across_nodes
        else:
            within += replica_rank
            terms["within node"] = terms.get("within node", 0.0) + replica_rank / rates.within_node
    if rates.bus is not None:
        terms["bus"] = a * (gathers * cn / g + 4 * t / g) / rates.bus
    disk = (a * gathers * cn / g if work.params_on_nvme else 0) + (24 * t / g if work.state_on_nvme else 0)
    if disk:
        if rates.disk is None:
            raise ValueError("step-time: NVMe homes or state need the disk's rate")
        terms["disk"] = disk * per_node / rates.disk
    terms["host Adam"] = t / g / rates.adam
    bound = max(terms, key=terms.get)
    step = terms[bound] if rates.overlap else sum(terms.values())
    return Prediction(terms, step, bound, {"within_node": int(within), "across_nodes": int(across)})


def compare_layouts(work: Work, rates: Rates) -> dict[str, Prediction]:
    """flat (one group of every rank) and hybrid (a node's ranks a group) for the same work."""
    per_node = work.world // work.nodes
    return {"flat": predict(_with_group(work, work.world), rates),
            "hybrid": predict(_with_group(work, per_node), rates)}


def _with_group(work: Work, group: int) -> Work:
    from dataclasses import replace

    return replace(work, group=group)


def format_predictions(predictions: dict[str, Prediction]) -> str:
    lines = [f"{'layout':<8}{'step':>10}  bound         terms (s)"]
    for layout, p in predictions.items():
        terms = ", ".join(f"{k} {v:.3g}" for k, v in p.terms.items())
        lines.append(f"{layout:<8}{p.step:>9.3g}s  {p.bound:<13} {terms}")
    return "\n".join(lines)
