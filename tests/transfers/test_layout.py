"""The shard group a job's topology gives (Note [hybrid sharding] in
offload/transfers/layout.py), the link class of a group's ranks (Note [link classes])
and a rank's node name (Note [node names] in offload/node.py), without processes:
tests/engine/test_hybrid_sharding.py runs them on four ranks."""
import pytest

from offload.node import node_name
from offload.transfers.layout import group_size, link_of


@pytest.mark.parametrize("nodes, setting, size", [
    (["a", "a", "b", "b"], "node", 2),
    (["a"] * 8 + ["b"] * 8, "node", 8),
    (["a", "a", "a", "a"], "node", 4),     # one node: flat
    (["a", "b", "c", "d"], "node", 1),     # a rank a node: every rank a whole copy
    (["a", "a", "b", "b"], "world", 4),
    (["a", "a", "b", "b"], 1, 1),
    (["a"] * 8 + ["b"] * 8, 4, 4),         # smaller than a node: two groups a node
])
def test_the_group_follows_the_topology_or_the_setting(nodes, setting, size):
    assert group_size(setting, nodes)[0] == size


@pytest.mark.parametrize("nodes", [
    ["a", "a", "a", "b"],         # nodes of unequal size
    ["a", "b", "a", "b"],         # a node's ranks not numbered together
])
def test_nodes_not_in_blocks_of_one_size_fall_back_to_flat_and_say_why(nodes):
    size, why = group_size("node", nodes)
    assert size == len(nodes) and why.startswith("flat: the ranks of nodes ['a', 'b'] are not numbered in blocks")


def test_a_group_that_does_not_divide_the_ranks_is_refused_by_name():
    with pytest.raises(ValueError, match=r"shard_group_size 3: the job's 4 ranks do not divide into groups of 3; "
                                         r"give a divisor of 4"):
        group_size(3, ["a", "a", "b", "b"])


def test_a_group_is_within_a_node_only_where_every_rank_is_on_it():
    nodes = ["a", "a", "b", "b"]
    assert link_of([0, 1], nodes) == "within_node"
    assert link_of([0, 2], nodes) == link_of(range(4), nodes) == "across_nodes"


def test_a_node_is_named_by_offload_node_else_the_host_and_torchruns_node_rank(monkeypatch):
    import socket

    host = socket.gethostname()
    monkeypatch.delenv("OFFLOAD_NODE", raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert node_name() == host
    monkeypatch.setenv("GROUP_RANK", "1")  # a second torchrun launch on this host: another node
    assert node_name() == f"{host}:1"
    monkeypatch.setenv("OFFLOAD_NODE", " rack2-node7 ")
    assert node_name() == "rack2-node7"
    monkeypatch.setenv("OFFLOAD_NODE", "  ")  # blank: not a name
    assert node_name() == f"{host}:1"
