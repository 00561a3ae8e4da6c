"""Ranks, nodes and process groups: who takes part in each collective.

Ranks are laid out node-major (rank r lives on node r // gpus_per_node), as torchrun assigns them.
HYBRID_SHARD shards within consecutive blocks of ``shard_size`` ranks and replicates across them,
like ``init_device_mesh(("replicate", "shard"))``.
"""

from dataclasses import dataclass
from enum import StrEnum
from functools import cache


class GroupKind(StrEnum):
    SHARD = "shard"  # all-gather / reduce-scatter group (the world unless HYBRID_SHARD)
    REPLICATE = "replicate"  # HYBRID_SHARD all-reduce group; NO_SHARD's all-reduce group is the world
    # FSDP2's integer reshard_after_forward: the groups of k ranks backward all-gathers within
    POST_FORWARD = "post_forward"
    # expert parallelism (torchtitan's sparse mesh ("efsdp", "ep"), "ep" innermost): the token
    # all-to-all runs within consecutive blocks of E ranks; the experts' FSDP group is the ranks
    # holding the same experts (every E-th rank)
    EXPERT = "expert"
    EXPERT_SHARD = "expert_shard"


@dataclass(frozen=True, kw_only=True)
class GroupShape:
    """What a collective's cost depends on: how many ranks, and whether the ring leaves a node."""

    size: int
    spans_nodes: bool


@dataclass(frozen=True, kw_only=True)
class Topology:
    world_size: int
    gpus_per_node: int
    shard_size: int  # = world_size for FULL_SHARD / SHARD_GRAD_OP; 1 for NO_SHARD
    post_forward_size: int = 0  # k of an integer reshard_after_forward (0: none)
    expert_size: int = 1  # E of parallel.expert_parallel

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @cache  # noqa: B019 (topologies are few, small and immutable)
    def members(self, kind: GroupKind, rank: int) -> tuple[int, ...]:
        s = self.shard_size
        if kind in (GroupKind.EXPERT, GroupKind.EXPERT_SHARD):
            s = self.expert_size
            kind = GroupKind.SHARD if kind is GroupKind.EXPERT else GroupKind.REPLICATE
        if kind is GroupKind.POST_FORWARD:  # consecutive blocks of k (the shard mesh viewed as (-1, k))
            s = self.post_forward_size or s
        if kind in (GroupKind.SHARD, GroupKind.POST_FORWARD):
            start = rank - rank % s
            return tuple(range(start, start + s))
        return tuple(range(rank % s, self.world_size, s))

    def group_id(self, kind: GroupKind, rank: int) -> tuple[str, int]:
        """A key equal on every member of the group and different across groups of this kind."""
        return kind.value, self.members(kind, rank)[0]

    @cache  # noqa: B019 (as members)
    def links(self, kind: GroupKind, rank: int) -> tuple[tuple[str, int], ...]:
        """The links ``rank``'s group of ``kind`` crosses: every spanned node's network links, or the
        node's own GPU fabric (NVLink or PCIe) for a group inside one node."""
        nodes = sorted({self.node_of(r) for r in self.members(kind, rank)})
        return tuple(("net", n) for n in nodes) if len(nodes) > 1 else (("node", nodes[0]),)

    def shape(self, kind: GroupKind, rank: int = 0) -> GroupShape:
        members = self.members(kind, rank)
        return GroupShape(size=len(members), spans_nodes=len({self.node_of(r) for r in members}) > 1)
