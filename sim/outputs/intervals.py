"""Interval arithmetic for the step-time breakdown (pure, no I/O, no plotting).

The report, the plotly timeline and the Chrome-trace tests all use these definitions, so
their totals agree. Per rank, with every time in seconds:

- ``compute``      = measure of the union of the intervals of compute-stream ops;
- ``exposed_comm`` = measure of (union of collective-op intervals) minus (union of
  compute-stream op intervals): time a collective ran while the compute stream was empty;
- ``idle``         = ``step_time_s - compute - exposed_comm``, never below zero (the first two
  are measures of disjoint sets within the step, so only rounding could take it below),

where ``step_time_s`` is the latest ``end_s`` over all ops of all ranks (see ``step_time``).
"""

from collections.abc import Iterable
from dataclasses import dataclass

from sim.core.events import EventTable, OpRecord, Stream

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points as ``intervals``.

    Empty or reversed intervals (``end <= start``) cover nothing and are dropped; intervals that
    touch (``end == next start``) are joined.
    """
    merged: list[Interval] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def union_length(intervals: Iterable[Interval]) -> float:
    """Measure (total length) of the union of ``intervals``."""
    return sum(end - start for start, end in merge(intervals))


def difference(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the points of ``union(a)`` that are not in ``union(b)``."""
    cut = merge(b)
    out: list[Interval] = []
    j = 0
    for start, end in merge(a):
        while j < len(cut) and cut[j][1] <= start:
            j += 1
        cursor = start
        k = j
        while k < len(cut) and cut[k][0] < end:
            if cut[k][0] > cursor:
                out.append((cursor, cut[k][0]))
            cursor = max(cursor, cut[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def subtract_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Measure of ``union(a) \\ union(b)``."""
    return sum(end - start for start, end in difference(a, b))


def step_time(table: EventTable) -> float:
    """Step time in seconds: the latest ``end_s`` over all ops of all ranks (0.0 for no ops)."""
    return max((o.end_s for o in table.ops), default=0.0)


def compute_intervals(ops: Iterable[OpRecord]) -> list[Interval]:
    """Intervals of the ops that ran on the compute stream (compute kernels and copies)."""
    return [(o.start_s, o.end_s) for o in ops if o.stream == Stream.COMPUTE]


def collective_intervals(ops: Iterable[OpRecord]) -> list[Interval]:
    """Intervals of the collective ops (all-gather, reduce-scatter, all-reduce)."""
    return [(o.start_s, o.end_s) for o in ops if o.kind.is_collective]


def exposed_comm_intervals(ops: Iterable[OpRecord]) -> list[Interval]:
    """Spans where a collective ran and the compute stream had nothing running."""
    ops = list(ops)
    return difference(collective_intervals(ops), compute_intervals(ops))


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """Where one rank's step time goes, in seconds."""

    compute_s: float
    exposed_comm_s: float
    idle_s: float

    def to_json(self) -> dict[str, float]:
        return {"compute": self.compute_s, "exposed_comm": self.exposed_comm_s, "idle": self.idle_s}


def rank_breakdown(table: EventTable, rank: int, step_time_s: float) -> Breakdown:
    """Step-time breakdown of one rank: compute, exposed communication and idle.

    ``rank`` may be any rank of the job; it is mapped onto its simulated rank with ``rank_of``.
    """
    ops = table.ops_of(rank)
    compute = compute_intervals(ops)
    compute_s = union_length(compute)
    exposed_s = subtract_length(collective_intervals(ops), compute)
    return Breakdown(
        compute_s=compute_s, exposed_comm_s=exposed_s, idle_s=max(0.0, step_time_s - compute_s - exposed_s)
    )
