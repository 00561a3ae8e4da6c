"""Expert parallelism as one rank sees it: the experts it holds, the work they do, and where the
tokens are exchanged (torchtitan's ``ExpertParallel``, ``torchtitan/distributed/expert_parallel.py``).

With ``E`` ranks in an expert-parallel group, each rank holds ``experts / E`` of every MoE layer's
stacked expert weights (``Shard(0)`` of dim 0 over the "ep" mesh dimension). Tokens are routed as
without EP; an all-to-all sends each (token, chosen expert) row to the rank that holds the expert
(dispatch) and another brings the results back (combine), and autograd runs the two again in
backward. Routing is taken as balanced (every expert receives the average): a rank's expert
matmuls then run ``E``× the rows of each of its ``experts / E`` experts — the same FLOPs as
without EP, in fewer, larger matmuls — and each all-to-all moves ``tokens · top_k`` rows of
``hidden`` elements per rank, (E−1)/E of them to other ranks. Load imbalance is not modelled.

FSDP2 then shards each rank's local experts over the ``world / E`` ranks that hold the same ones
(torchtitan's "efsdp" dimension), along dim 0, or along dim 1 when ``world`` exceeds the experts
(``apply_fsdp``: ``Shard(1)`` when efsdp · ep > num_experts, to avoid padding).
"""

from collections.abc import Sequence
from dataclasses import replace
from math import ceil, prod

from sim.workload.layer_op import LayerKind, LayerOp
from sim.workload.params import ParamSpec
from sim.workload.units import Segment, WrapUnit

Gemm = tuple[int, int, int, int]


def expert_modules(ops: Sequence[LayerOp]) -> frozenset[str]:
    """The modules that run grouped expert matmuls (their weights are the stacked experts)."""
    return frozenset(op.module for op in ops if op.kind is LayerKind.EXPERTS)


def in_experts(op: LayerOp, modules: frozenset[str]) -> bool:
    """``op`` runs inside an experts module (its matmuls, or the activation between them)."""
    return any(op.module == m or op.module.startswith(m + ".") for m in modules)


def local_spec(p: ParamSpec, e: int) -> ParamSpec:
    """A stacked expert weight as one rank of ``e`` holds it: ``experts / e`` of dim 0."""
    return replace(p, shape=(p.shape[0] // e, *p.shape[1:]))


def _local_gemms(gemms: tuple[Gemm, ...], rows: int, e: int) -> tuple[Gemm, ...]:
    """Each of the rank's ``count / e`` experts receives its rows from every rank of the group:
    the dimension of ``rows`` tokens (M of the forward and input-gradient matmuls, K of the
    weight gradient's) grows ``e``-fold."""
    out = []
    for g in gemms:
        dims = list(g[:3])
        at = dims.index(rows) if rows in dims else 0
        dims[at] *= e
        out.append((dims[0], dims[1], dims[2], max(1, g[3] // e)))
    return tuple(out)


def local_ops(ops: Sequence[LayerOp], e: int) -> tuple[LayerOp, ...]:
    """The forward ops as one rank of an expert-parallel group of ``e`` runs them."""
    out = []
    for op in ops:
        if op.kind is not LayerKind.EXPERTS:
            out.append(op)
            continue
        rows = op.grouped_gemms[0][0] if op.grouped_gemms else 0
        backward = op.backward_gemms
        out.append(
            replace(
                op,
                params=tuple(local_spec(p, e) for p in op.params),
                grouped_gemms=_local_gemms(op.grouped_gemms, rows, e),
                backward_gemms=_local_gemms(backward, rows, e) if backward is not None else None,
            )
        )
    return tuple(out)


def local_units(units: Sequence[WrapUnit], experts: frozenset[str], e: int) -> tuple[WrapUnit, ...]:
    """The wrap units with each stacked expert weight replaced by this rank's ``1/e`` of it."""
    return tuple(
        replace(u, params=tuple(local_spec(p, e) if p.name in experts else p for p in u.params))
        for u in units
    )


def split_at_experts(segments: Sequence[Segment], modules: frozenset[str]) -> tuple[Segment, ...]:
    """Segments cut where a run of expert ops starts and ends: the all-to-alls go between."""
    out: list[Segment] = []
    for seg in segments:
        run: list[LayerOp] = []
        for op in seg.ops:
            if run and in_experts(op, modules) != in_experts(run[0], modules):
                out.append(Segment(unit=seg.unit, ops=tuple(run)))
                run = []
            run.append(op)
        out.append(Segment(unit=seg.unit, ops=tuple(run)))
    return tuple(out)


def is_expert_segment(seg: Segment, modules: frozenset[str]) -> bool:
    return bool(modules) and in_experts(seg.ops[0], modules)


def expert_padded_numel(p: ParamSpec, shard_size: int, world_size: int, experts: int) -> int:
    """A local expert weight's elements after FSDP2's padding over its ``shard_size`` ranks: dim 0,
    or dim 1 when ``world_size`` exceeds ``experts`` (torchtitan's ``Shard(1)``)."""
    dim = 1 if world_size > experts and len(p.shape) > 1 else 0
    rows = ceil(p.shape[dim] / shard_size) * shard_size
    return rows * prod(p.shape) // p.shape[dim]


def expert_parallel_view(
    ops: Sequence[LayerOp], units: Sequence[WrapUnit], e: int
) -> tuple[tuple[LayerOp, ...], tuple[WrapUnit, ...], frozenset[str], frozenset[str]]:
    """(ops, units, expert modules, expert weight names) as one rank of a group of ``e`` sees them."""
    modules = expert_modules(ops)
    names = frozenset(p.name for op in ops if op.kind is LayerKind.EXPERTS for p in op.params)
    return local_ops(ops, e), local_units(units, names, e), modules, names
