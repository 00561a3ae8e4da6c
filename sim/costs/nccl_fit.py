"""Calibration meets topology: the ``NcclFit`` that makes NCCL's cost model (``sim.costs.nccl``)
reproduce a profile's measured collectives on the cluster they were measured on.

The fitted quantities are physical ones of the model, not of the measured configurations:
the per-channel bandwidth inside a node and across nodes, the per-step hardware latencies inside
and across nodes, and one fixed latency per collective (the host's launch, which measured times
contain). Each curve's group is placed on the cluster as it ran (ranks per node recorded with the
curve, else full nodes), so curves measured on 1, 2 and 4 nodes fix the factors, and the same
model then gives 128 nodes its extra ring steps, tree hops and algorithm changes.

The fit minimises the squared log-ratio of modelled to measured times over every point (so small
and large messages weigh alike) by a deterministic pattern search (Hooke and Jeeves, 1961) on the
logarithms of the factors, from NCCL's own model (all factors 1, no extra latency).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sim.costs.nccl import nccl_choice
from sim.hardware.cluster_spec import ClusterSpec
from sim.hardware.fabric import GroupFabric
from sim.hardware.network import job_network
from sim.hardware.schema import CollectiveCurve, HardwareProfile, NcclFit

EXTRA_LATENCY_SCALE_S = 10e-6  # the pattern search moves the extra latency in steps of this size
MAX_ROUNDS = 60
MIN_STEP = 1e-3  # in log units (0.1 %)


@dataclass(frozen=True, kw_only=True)
class FitPoint:
    collective: str
    size_bytes: int
    fabric: GroupFabric
    time_s: float


def _ranks_per_node(curve: CollectiveCurve, gpus_per_node: int) -> int:
    """As recorded; else a group that spans nodes fills them when it can (the world on whole
    nodes) and otherwise has one rank per node (an inter-node group); one that does not is one node."""
    if curve.ranks_per_node is not None:
        return curve.ranks_per_node
    n = curve.group_size
    if not curve.spans_nodes:
        return n
    return gpus_per_node if n % gpus_per_node == 0 and n >= 2 * gpus_per_node else 1


def fit_points(profile: HardwareProfile, spec: ClusterSpec) -> list[FitPoint]:
    """Every measured point of a group of two or more, with the fabric its group had."""
    points = []
    for curve in profile.collectives:
        if curve.group_size < 2:
            continue
        rpn = _ranks_per_node(curve, profile.gpus_per_node)
        network = job_network(
            spec, world_size=curve.group_size, ranks_per_node=rpn, arch=profile.device.architecture
        )
        fabric = network.fabric(tuple(range(curve.group_size)))
        points += [
            FitPoint(collective=curve.collective, size_bytes=s, fabric=fabric, time_s=t)
            for s, t in zip(curve.sizes_bytes, curve.times_s, strict=True)
        ]
    return points


def _fit_of(x: Sequence[float]) -> NcclFit:
    return NcclFit(
        intra_bw_factor=math.exp(x[0]),
        inter_bw_factor=math.exp(x[1]),
        intra_latency_factor=math.exp(x[2]),
        inter_latency_factor=math.exp(x[3]),
        extra_latency_s=max(0.0, x[4]) * EXTRA_LATENCY_SCALE_S,
    )


def objective(points: Sequence[FitPoint], fit: NcclFit) -> float:
    """Mean squared log-ratio of the model's times to the measured ones."""
    return sum(
        math.log(nccl_choice(p.collective, p.size_bytes, p.fabric, fit).time_s / p.time_s) ** 2
        for p in points
    ) / len(points)


def _identifiable(points: Sequence[FitPoint]) -> list[bool]:
    """Inside-node factors need a single-node group, across-node ones a group spanning nodes."""
    one, many = any(p.fabric.n_nodes == 1 for p in points), any(p.fabric.n_nodes > 1 for p in points)
    return [one, many, one, many, True]


def fit_nccl(profile: HardwareProfile, spec: ClusterSpec) -> NcclFit:
    """The fit of ``profile``'s measured curves on ``spec``; its ``source`` names what was fitted
    and the residual. Factors the curves cannot fix (no single-node or no multi-node group) stay 1."""
    points = fit_points(profile, spec)
    if not points:
        return NcclFit(source="no measured group of two or more ranks: NCCL's model as it is")
    free = _identifiable(points)
    x, step = [0.0] * 5, [0.5] * 5
    best = objective(points, _fit_of(x))
    start = best
    for _ in range(MAX_ROUNDS):
        improved = False
        for i in (i for i in range(5) if free[i]):
            for direction in (1.0, -1.0):
                trial = list(x)
                trial[i] += direction * step[i]
                value = objective(points, _fit_of(trial))
                if value < best:
                    x, best, improved = trial, value, True
                    break
        if not improved:
            step = [s / 2 for s in step]
            if max(step) < MIN_STEP:
                break
    shapes = sorted({(p.fabric.n_nodes, p.fabric.ranks_per_node) for p in points})
    where = ", ".join(f"{n} node(s) x {r}" for n, r in shapes)
    return replace(
        _fit_of(x),
        source=(
            f"fitted on {len(points)} measured points ({where}) of cluster {spec.name}: RMS log error "
            f"{math.sqrt(start):.3f} with NCCL's model as it is, {math.sqrt(best):.3f} fitted"
        ),
    )


def fit_document(fit: NcclFit) -> dict[str, float | str]:
    """``topology.nccl_fit`` as a profile stores it."""
    return {
        "intra_bw_factor": fit.intra_bw_factor,
        "inter_bw_factor": fit.inter_bw_factor,
        "intra_latency_factor": fit.intra_latency_factor,
        "inter_latency_factor": fit.inter_latency_factor,
        "extra_latency_s": fit.extra_latency_s,
        "source": fit.source,
    }
