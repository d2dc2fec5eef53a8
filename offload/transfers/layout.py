"""The layout of the shards over the job's ranks: flat, or hybrid within groups.

Note [hybrid sharding]
In the flat layout every parameter, its gradient, its fp32 master and its
optimizer state are partitioned over every rank of the job, so each gather
of a parameter (twice a step for an offloaded one: forward and backward)
crosses every link the job spans, the slow one between nodes included.

The hybrid layout partitions them over a shard group instead: G ranks, by
default the ranks of one node (Note [node names] in offload/node.py). The
job is R = W / G groups, numbered by job rank in blocks (group g is job
ranks g*G .. g*G + G - 1, as torchrun numbers the ranks of a node), and
each group holds a whole copy of the partitions, planned and offloaded on
its ranks as the flat layout plans one rank (a rank's share is 1/G):
  - gathers run within the group: none crosses a node;
  - a gradient is reduce-scattered within the group (its sum over the
    group's ranks, partition by partition) and divided by W; at the
    accumulation window's last backward the window's sums are all_reduced
    across the groups between the ranks holding the same partition (the
    replica group: job ranks i, G + i, 2G + i ...; Note [gradients across
    groups once a window] in grad_buckets.py): every rank then holds the
    mean over the job of its partition, the same values in every group,
    and every group's Adam takes the same step on the same partition, so
    the copies stay equal without ever being sent;
  - across groups only that all_reduce runs: 4 * P / G bytes sent an
    optimizer step per rank for P padded trained elements, whatever the
    window's length (Note [collective bytes]).
This is MiCS's layout, and FSDP's HSDP; DeepSpeed's hpZ instead keeps the
master and the optimizer state partitioned over every rank and a second
copy of the parameters within each node, refreshed across nodes after each
update. Here the optimizer state takes G/W of a rank's bytes more than
hpZ's would (`offload estimate --group-size` states them) and sends no
parameter across nodes at all.

What each rank agrees on with every other (the node's share, checkpoint
outcomes) runs over the whole job (ProcessGroupInfo.job_group); a
checkpoint's partitions are written by group 0 (Note [checkpoint layout]),
and a run resumes at any other layout as at another world size (Note
[resuming at another world size]).

`zero_optimization.shard_group_size`: "node" (the default), "world" (flat)
or a number of ranks dividing the job's; DeepSpeed's `mics_shard_size` and
`zero_hpz_partition_size` name it too. "node" is flat where the nodes are
not numbered in blocks of one size (said once at initialize).
"""
from __future__ import annotations

import logging

import torch.distributed as dist

from offload.node import node_name
from offload.transfers.collectives import ProcessGroupInfo, _GroupHandle

log = logging.getLogger(__name__)


def group_size(setting, nodes: list[str]) -> tuple[int, str]:
    """(G, why) for `shard_group_size` over the job whose rank r runs on nodes[r]."""
    world = len(nodes)
    if setting == "world":
        return world, "flat: zero_optimization.shard_group_size is 'world'"
    if setting != "node":
        if world % setting:
            raise ValueError(f"zero_optimization.shard_group_size {setting}: the job's {world} ranks do not divide "
                             f"into groups of {setting}; give a divisor of {world}, 'node' or 'world'")
        return setting, f"groups of {setting} ranks, as configured"
    blocks: list[list] = []  # [node, ranks] in job rank order
    for name in nodes:
        if blocks and blocks[-1][0] == name:
            blocks[-1][1] += 1
        else:
            blocks.append([name, 1])
    names = [name for name, _ in blocks]
    if len(set(names)) != len(names) or len({n for _, n in blocks}) != 1:
        return world, (f"flat: the ranks of nodes {sorted(set(nodes))} are not numbered in blocks of one size "
                       "(set zero_optimization.shard_group_size, or launch each node's ranks together)")
    return blocks[0][1], f"the ranks of one node ({blocks[0][1]})"


def link_of(ranks, nodes: list[str]) -> str:
    """Note [link classes]."""
    return "within_node" if len({nodes[r] for r in ranks}) == 1 else "across_nodes"


def make_layout(setting) -> ProcessGroupInfo:
    """The shard and replica groups of this job (a collective: every rank calls it, in the
    same order). One process: the single-process info."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ProcessGroupInfo()
    world, me = dist.get_world_size(), dist.get_rank()
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node_name())
    size, why = group_size(setting, nodes)
    if size == world:
        if why.startswith("flat: the ranks"):
            log.warning("shard layout %s", why)
        link = link_of(range(world), nodes)
        return ProcessGroupInfo(me, world, 0, 1, _GroupHandle(dist.group.WORLD, links=(link, link)))
    replicas = world // size
    replica, rank = divmod(me, size)
    made, shard_group, replica_group = [], None, None
    # Every rank makes every group, in one order: new_group is a collective over the job.
    for g in range(replicas):
        group = dist.new_group(list(range(g * size, (g + 1) * size)))
        if g == replica:
            shard_group = group
            made.append(group)
    for i in range(size):
        group = dist.new_group([g * size + i for g in range(replicas)])
        if i == rank:
            replica_group = group
            made.append(group)
    links = (link_of(range(replica * size, (replica + 1) * size), nodes),
             link_of([g * size + rank for g in range(replicas)], nodes))
    if me == 0:
        log.info("hybrid shard layout: %d groups of %d ranks (%s); gathers %s, gradients across groups %s",
                 replicas, size, why, links[0], links[1])
    handle = _GroupHandle(shard_group, replica_group, dist.group.WORLD, links=links, made=made)
    return ProcessGroupInfo(rank, size, replica, replicas, handle)
