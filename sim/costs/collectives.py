"""Time of one collective, from a hardware profile. Pure functions.

Three models, the first that applies:

1. a curve measured for this collective and group shape (a calibrated profile): interpolated;
2. on NCCL, with the fabric the group sees on the cluster (``sim.hardware.cluster``): NCCL's own
   tuner model (``sim.costs.nccl``; the all-to-all, which NCCL runs as point-to-point sends, from
   the links: ``sim.costs.all_to_all``): channels, algorithm and protocol as NCCL picks them, with
   what a calibration fitted (``profile.nccl_fit``);
3. otherwise (gloo, no cluster) the α–β ring of the profile's links.

nccl-tests (doc/PERFORMANCE.md) defines for a collective of ``size`` bytes on n ranks taking t:
algbw = size / t and busbw = algbw * factor, with factor (n-1)/n for all-gather (size = output)
and reduce-scatter (size = input) and 2(n-1)/n for all-reduce. Inverting gives the ring model
t = latency + size * factor / busbw; busbw is the per-rank link bandwidth a ring achieves.
"""

import math
from dataclasses import dataclass

import numpy as np

from sim.core.topology import GroupShape
from sim.costs.all_to_all import all_to_all_time_s
from sim.costs.nccl import nccl_choice
from sim.hardware.fabric import GroupFabric
from sim.hardware.schema import CollectiveCurve, HardwareProfile, LinkModel

RING = "ring"  # the α–β model is a ring: each rank sends size * bus_factor over its link
MEASURED = "measured"  # a calibrated curve: whatever the backend chose at that size


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """One collective's time and the algorithm the model assumes for it."""

    time_s: float
    algorithm: str
    protocol: str = ""
    channels: int = 0  # NCCL channels the size uses (0: not modelled)
    wire_fraction: float = 0.0  # of the time, the share spent moving bytes (what contends for links)


def bus_factor(collective: str, group_size: int) -> float:
    """nccl-tests' busbw/algbw ratio: the fraction of ``size`` each rank sends over its link."""
    n = group_size
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):  # all-to-all: alltoall.cu
        return (n - 1) / n
    raise ValueError(f"unknown collective {collective!r}")


def wire_bytes_per_rank(collective: str, size_bytes: int, group_size: int) -> float:
    """Bytes each rank sends in a ring implementation (e.g. all-gather: size*(n-1)/n)."""
    return size_bytes * bus_factor(collective, group_size)


def alpha_beta_time_s(collective: str, size_bytes: int, group_size: int, link: LinkModel) -> float:
    return link.latency_s + wire_bytes_per_rank(collective, size_bytes, group_size) / link.bus_bw_Bps


def _curve_time_s(curve: CollectiveCurve, size_bytes: int) -> float:
    """Interpolate the measured mean times in log-size/log-time; the α–β fit outside the range."""
    sizes = curve.sizes_bytes
    if size_bytes in sizes:
        return curve.times_s[sizes.index(size_bytes)]
    if not sizes[0] <= size_bytes <= sizes[-1]:
        return alpha_beta_time_s(curve.collective, size_bytes, curve.group_size, curve.fit)
    log_t = np.interp(math.log(size_bytes), np.log(sizes), np.log(curve.times_s))
    return float(math.exp(log_t))


def collective_cost(
    collective: str,
    size_bytes: int,
    group: GroupShape,
    dtype: str,
    profile: HardwareProfile,
    fabric: GroupFabric | None = None,
) -> CollectiveCost:
    """One collective of nccl-tests ``size_bytes`` over ``group``; 0 s for a group of one.

    Measured curves and calibrated fits are wall-clock times that already contain the host's
    launch cost; NCCL's model and a datasheet link model do not, so ``collective_launch_s`` (the
    host's launch through ProcessGroupNCCL) is added to them.
    """
    if group.size <= 1 or size_bytes <= 0:
        return CollectiveCost(time_s=0.0, algorithm=RING)
    rpn = fabric.ranks_per_node if fabric is not None else None
    curve = profile.curve(collective, group.size, dtype, group.spans_nodes, rpn)
    if curve is not None:
        time_s = _curve_time_s(curve, size_bytes)
        wire_s = wire_bytes_per_rank(collective, size_bytes, group.size) / curve.fit.bus_bw_Bps
        return CollectiveCost(time_s=time_s, algorithm=MEASURED, wire_fraction=min(1.0, wire_s / time_s))
    launch = 0.0 if profile.calibrated else profile.backend.collective_launch_s
    if fabric is not None and profile.backend.name == "nccl" and collective == "all_to_all":
        time_s, latency_s = all_to_all_time_s(size_bytes, fabric)  # point-to-point: no tuner entry
        return CollectiveCost(
            time_s=launch + time_s, algorithm="p2p", wire_fraction=(time_s - latency_s) / (launch + time_s)
        )
    if fabric is not None and profile.backend.name == "nccl":
        choice = nccl_choice(collective, size_bytes, fabric, profile.nccl_fit)
        wire_s = choice.time_s - choice.latency_s
        return CollectiveCost(
            time_s=launch + choice.time_s,
            algorithm=choice.algorithm,
            protocol=choice.protocol,
            channels=choice.channels,
            wire_fraction=wire_s / (launch + choice.time_s),
        )
    link = profile.inter_node if group.spans_nodes else profile.intra_node
    wire_s = wire_bytes_per_rank(collective, size_bytes, group.size) / link.bus_bw_Bps
    time_s = launch + link.latency_s + wire_s
    return CollectiveCost(time_s=time_s, algorithm=RING, wire_fraction=wire_s / time_s)


def collective_time_s(
    collective: str, size_bytes: int, group: GroupShape, dtype: str, profile: HardwareProfile
) -> float:
    """Seconds for one collective of nccl-tests ``size_bytes`` over ``group`` (``collective_cost``)."""
    return collective_cost(collective, size_bytes, group, dtype, profile).time_s
