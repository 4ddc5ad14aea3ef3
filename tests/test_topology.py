"""Layout math: partition / replication / hierarchical groups, and every invalid layout."""

from __future__ import annotations

import itertools

import pytest

from lightning_mics.topology import (
    MiCSTopology,
    detect_ranks_per_node,
    resolve_partition_size,
    valid_partition_sizes,
)


def _is_partition_of_world(groups, world):
    flat = sorted(itertools.chain.from_iterable(groups))
    return flat == list(range(world))


# (world, ranks_per_node, partition spec, expected partition size)
LAYOUTS = [
    (1, 1, None, 1),
    (4, 4, None, 4),
    (4, 4, 1, 1),
    (4, 4, 2, 2),
    (4, 4, "world", 4),
    (4, 4, -1, 4),
    (4, 4, "node", 4),
    (8, 4, None, 4),
    (8, 4, 2, 2),
    (8, 4, 8, 8),
    (8, 2, 4, 4),
    (8, 2, 8, 8),
    (16, 8, None, 8),
    (16, 8, 16, 16),
    (16, 4, 8, 8),
    (32, 8, 4, 4),
    (64, 8, 16, 16),
    (12, 6, 3, 3),
    (12, 6, 2, 2),
    (24, 6, 12, 12),
]


@pytest.mark.parametrize(("world", "rpn", "spec", "expected"), LAYOUTS)
def test_layouts_cover_world_and_agree(world, rpn, spec, expected):
    topo = MiCSTopology.create(world, rpn, spec)
    assert topo.partition_size == expected
    assert topo.replication_degree * topo.partition_size == world
    assert _is_partition_of_world(topo.partition_groups, world)
    assert _is_partition_of_world(topo.replication_groups, world)
    assert topo.mesh_shape == (world // expected, expected)
    for rank in range(world):
        partition = topo.partition_group_of(rank)
        replicas = topo.replication_group_of(rank)
        assert rank in partition and rank in replicas
        # one rank in common: itself; and the partition is made of contiguous ranks
        assert set(partition) & set(replicas) == {rank}
        assert list(partition) == list(range(partition[0], partition[0] + expected))
        assert topo.shard_index(rank) == partition.index(rank)
        assert all(topo.shard_index(r) == topo.shard_index(rank) for r in replicas)
        # a partition either fits in one node or covers whole nodes
        nodes = {topo.node_of(r) for r in partition}
        if expected <= rpn:
            assert len(nodes) == 1
        else:
            assert len(nodes) == expected // rpn
            assert all(sum(topo.node_of(r) == n for r in partition) == rpn for n in nodes)


def test_concrete_groups_two_nodes_partition_per_node():
    topo = MiCSTopology.create(8, 4, None)
    assert topo.partition_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.replication_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert not topo.spans_nodes
    assert topo.intra_node_groups == () and topo.inter_node_groups == ()


def test_hierarchical_subgroups_when_partition_spans_nodes():
    topo = MiCSTopology.create(16, 2, 4)  # 8 nodes of 2; a partition = 2 nodes
    assert topo.spans_nodes and topo.nodes_per_partition == 2
    assert topo.partition_groups[0] == (0, 1, 2, 3)
    assert topo.intra_node_groups[:2] == ((0, 1), (2, 3))
    # inter-node groups: same local index, different nodes, same partition
    assert topo.inter_node_groups[:4] == ((0, 2), (1, 3), (4, 6), (5, 7))
    for group in topo.inter_node_groups:
        assert len({topo.node_of(r) for r in group}) == len(group) == topo.nodes_per_partition
        assert len({topo.partition_index(r) for r in group}) == 1
        assert len({r % topo.ranks_per_node for r in group}) == 1


def test_zero3_and_replicate_kinds():
    assert MiCSTopology.create(8, 4, "world").replication_degree == 1
    assert MiCSTopology.create(8, 4, "world").kind.startswith("zero3")
    assert MiCSTopology.create(8, 4, 1).kind.startswith("replicate")
    assert MiCSTopology.create(8, 4, None).kind.startswith("mics")


def test_the_layout_line_says_what_the_layout_is_on_this_cluster():
    one_node = MiCSTopology.create(4, 4, None).describe()
    assert one_node.startswith("MiCS layout: one partition = the node (model states sharded inside it; no replicas)")
    assert "replication groups" not in one_node and "zero3" not in one_node
    one_device = MiCSTopology.create(1, 1, None).describe()
    assert one_device.startswith("MiCS layout: one device (nothing to shard, no replicas)")
    assert "partition_size=1" in one_device and "zero3" not in one_device
    group = MiCSTopology.create(2, 2, None).describe(replica_group=(1, 3))
    assert group.startswith("MiCS layout: one partition = the node (model states sharded inside it; no replicas) -- "
                            "replica group 1 of 3 (fault tolerant)")
    two_nodes = MiCSTopology.create(8, 4, None).describe()
    assert "replication groups (hold the same shard; hop 2 syncs them): [0,4] [1,5] [2,6] [3,7]" in two_nodes


def test_describe_names_the_groups():
    text = MiCSTopology.create(8, 4, 4).describe()
    assert "[0,1,2,3] [4,5,6,7]" in text and "[0,4] [1,5] [2,6] [3,7]" in text


def test_valid_partition_sizes():
    assert valid_partition_sizes(16, 4) == [1, 2, 4, 8, 16]
    assert valid_partition_sizes(24, 6) == [1, 2, 3, 6, 12, 24]
    assert valid_partition_sizes(12, 4) == [1, 2, 4, 12]  # 8 would not divide 3 nodes


@pytest.mark.parametrize(
    ("world", "rpn", "spec", "message"),
    [
        (8, 4, 3, "does not divide the world size"),
        (12, 4, 8, "does not divide the world size"),
        (12, 6, 4, "straddles nodes"),
        (24, 4, 6, "multiple of ranks_per_node"),
        (8, 4, 0, "between 1 and the world size"),
        (8, 4, 16, "between 1 and the world size"),
        (8, 4, -2, "between 1 and the world size"),
        (8, 4, "half", "not understood"),
        (8, 4, 2.0, "not understood"),
        (8, 4, True, "not understood"),
    ],
)
def test_invalid_partition_sizes_name_the_valid_choices(world, rpn, spec, message):
    with pytest.raises(ValueError, match=message) as info:
        MiCSTopology.create(world, rpn, spec)
    assert "Valid choices" in str(info.value)
    for size in valid_partition_sizes(world, rpn):
        assert str(size) in str(info.value)


@pytest.mark.parametrize(("world", "rpn"), [(8, 3), (6, 4), (4, 0), (0, 1)])
def test_invalid_world_or_node_size(world, rpn):
    with pytest.raises(ValueError, match="ranks_per_node|world_size"):
        resolve_partition_size(None, world, rpn)


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="straddles"):
        MiCSTopology(world_size=12, ranks_per_node=6, partition_size=4)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="outside the world"):
        MiCSTopology.create(4, 4, 2).shard_index(4)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"LOCAL_WORLD_SIZE": "8"}, 8),
        ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 4),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2),
        ({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "8"}, 4),
    ],
)
def test_detect_ranks_per_node(env, expected):
    assert detect_ranks_per_node(env) == expected


@pytest.mark.parametrize("raw", ["four", "0"])
def test_detect_ranks_per_node_rejects_garbage(raw):
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        detect_ranks_per_node({"LOCAL_WORLD_SIZE": raw})
