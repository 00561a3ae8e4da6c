"""Measured collective points and curves: typed records and their profile JSON form.

A *point* is one message size of one collective on one group; a *curve* is all points of one
(collective, group size, dtype, spans-nodes) with its α–β fit. The JSON form is the
``collectives`` entry read by ``sim.profile.profile_from_dict``.
"""

import statistics
from dataclasses import dataclass
from typing import Any

from calibrate.busbw import algbw_Bps, busbw_Bps


@dataclass(frozen=True, kw_only=True)
class CurveKey:
    """What a curve is measured for; one curve per key in a profile."""

    collective: str
    group_size: int
    dtype: str
    spans_nodes: bool
    ranks_per_node: int | None = None  # the group's ranks on each node it spans, where known


@dataclass(frozen=True, kw_only=True)
class Point:
    """One message size. ``bytes`` is nccl-tests' size; times are seconds over the timed iterations.

    ``wrong`` counts mismatching elements of the checked result, like nccl-tests' ``#wrong``
    (None when the source did not check).
    """

    bytes: int
    time_s: float  # mean: a step sums many calls, so its expected length sums the means
    median_s: float
    min_s: float
    max_s: float
    iters: int
    wrong: int | None

    @property
    def spread(self) -> float:
        """(max - min) / mean: the relative spread of the timed iterations."""
        return (self.max_s - self.min_s) / self.time_s

    def to_dict(self, key: CurveKey) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "time_s": self.time_s,
            "median_s": self.median_s,
            "min_s": self.min_s,
            "max_s": self.max_s,
            "spread": self.spread,
            "iters": self.iters,
            "algbw_Bps": algbw_Bps(self.bytes, self.time_s),
            "busbw_Bps": busbw_Bps(key.collective, key.group_size, self.bytes, self.time_s),
            "wrong": self.wrong,
        }


def point_from_times(size_bytes: int, times_s: list[float], wrong: int | None) -> Point:
    """Summarise the per-iteration times of one size (mean, median, min, max).

    ``time_s`` is the mean, not the median: on a shared host a collective's time has a heavy tail
    (a rank descheduled for a time slice), and a training step pays every call's tail, so the
    expected step is the sum of the means."""
    if not times_s:
        raise ValueError("no timed iterations")
    return Point(
        bytes=size_bytes,
        time_s=statistics.fmean(times_s),
        median_s=statistics.median(times_s),
        min_s=min(times_s),
        max_s=max(times_s),
        iters=len(times_s),
        wrong=wrong,
    )


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """α–β fit of one curve: ``t = latency_s + wire_bytes / bus_bw_Bps`` (see ``calibrate.fit``)."""

    latency_s: float
    bus_bw_Bps: float
    rms_rel_residual: float  # sqrt(mean(((t_fit - t) / t)^2)) over the points
    max_rel_residual: float

    def to_dict(self) -> dict[str, float]:
        return {
            "latency_s": self.latency_s,
            "bus_bw_Bps": self.bus_bw_Bps,
            "rms_rel_residual": self.rms_rel_residual,
            "max_rel_residual": self.max_rel_residual,
        }


@dataclass(frozen=True, kw_only=True)
class Curve:
    key: CurveKey
    points: tuple[Point, ...]  # strictly increasing bytes
    fit: LinkFit
    source: str  # "torch.distributed <backend>" or the nccl-tests file it came from

    def to_dict(self) -> dict[str, Any]:
        return {
            "collective": self.key.collective,
            "group_size": self.key.group_size,
            "dtype": self.key.dtype,
            "spans_nodes": self.key.spans_nodes,
            **({"ranks_per_node": self.key.ranks_per_node} if self.key.ranks_per_node else {}),
            "source": self.source,
            "points": [p.to_dict(self.key) for p in self.points],
            "fit": self.fit.to_dict(),
        }
