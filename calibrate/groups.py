"""Which process groups a calibration measures: the world, and the sub-groups FSDP layouts use.

A *family* is a set of disjoint groups of equal size that run the same collective at the same
time (all intra-node groups at once, as every node does in a HYBRID_SHARD step). Ranks are
laid out node-major, as torchrun numbers them: rank = node * ranks_per_node + local_rank.

- ``world``: all ranks.
- ``intra_node`` (nodes > 1): the ranks of one node; HYBRID_SHARD's shard group by default.
- ``inter_node`` (nodes > 1): one rank per node with the same local rank; HYBRID_SHARD's
  replicate group by default.
- ``shard`` / ``replicate`` (``shard_size`` given): contiguous blocks of ``shard_size`` ranks and
  the strided groups across them, as ``init_device_mesh(..., (world // shard_size, shard_size))``
  builds for HSDP.

Families of one rank are dropped (nothing moves); a family whose (size, spans-nodes) an earlier
family already covers is dropped too, since it would give the same curve key.
"""

from dataclasses import dataclass

from sim.errors import UserError


@dataclass(frozen=True, kw_only=True)
class GroupFamily:
    kind: str
    groups: tuple[tuple[int, ...], ...]
    spans_nodes: bool

    ranks_per_node: int  # of a group, on each node it spans

    @property
    def size(self) -> int:
        return len(self.groups[0])

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups if rank in g)


def _spans(ranks: tuple[int, ...], ranks_per_node: int) -> bool:
    return len({r // ranks_per_node for r in ranks}) > 1


def _family(kind: str, groups: list[tuple[int, ...]], ranks_per_node: int) -> GroupFamily:
    first = groups[0]
    return GroupFamily(
        kind=kind,
        groups=tuple(groups),
        spans_nodes=any(_spans(g, ranks_per_node) for g in groups),
        ranks_per_node=len(first) // len({r // ranks_per_node for r in first}),
    )


def plan_group_families(
    world_size: int, ranks_per_node: int, shard_size: int | None = None
) -> list[GroupFamily]:
    """The families to measure, world first; raises UserError for an impossible layout."""
    if world_size < 2:
        raise UserError("calibrate comm needs at least 2 ranks (run under torchrun or pass --nproc N)")
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise UserError(f"world size {world_size} is not a multiple of the ranks per node ({ranks_per_node})")
    nodes = world_size // ranks_per_node
    rpn = ranks_per_node
    families = [_family("world", [tuple(range(world_size))], rpn)]
    if nodes > 1:
        families.append(
            _family("intra_node", [tuple(range(n * rpn, (n + 1) * rpn)) for n in range(nodes)], rpn)
        )
        families.append(_family("inter_node", [tuple(range(lr, world_size, rpn)) for lr in range(rpn)], rpn))
    if shard_size is not None:
        if shard_size < 1 or world_size % shard_size:
            raise UserError(f"--shard-size {shard_size} must divide the world size {world_size}")
        blocks = [tuple(range(b, b + shard_size)) for b in range(0, world_size, shard_size)]
        families.append(_family("shard", blocks, rpn))
        families.append(
            _family("replicate", [tuple(range(i, world_size, shard_size)) for i in range(shard_size)], rpn)
        )
    kept: list[GroupFamily] = []
    for fam in families:
        if fam.size > 1 and all((k.size, k.spans_nodes) != (fam.size, fam.spans_nodes) for k in kept):
            kept.append(fam)
    return kept
