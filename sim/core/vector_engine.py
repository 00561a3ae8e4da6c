"""A vectorised evaluation of the rank programs, for many distinct ranks (jitter, a slow rank, a
slow link) whose collectives all run on one group per kind — the world, as in FULL_SHARD,
SHARD_GRAD_OP and DDP. The SimPy engine (``sim.core.engine``) is the reference; this one gives
the same event table, op for op, at a cost that grows with ops × ranks in numpy instead of
Python.

Every rank runs the same program; only its compute durations differ. Ops are taken in issue
order, each as one array over the ranks: an op is ready when its queue's previous op and its
dependencies are done; a collective starts when its last rank is ready (the world's maximum)
and ends at the same time on every rank; a compute op ends when its work is done. What makes
one op's duration depend on others — compute slowed while a collective runs on its rank
(``interference``) and collectives in flight sharing links (``sim.core.links``) — is solved as a
fixed point: each pass times every op with the collectives' intervals of the pass before, until
no collective moves (the first pass has none). Because every collective is the world's, the
intervals are the same on every rank, so the slowdown of compute is one piecewise-linear clock
for all ranks and the sharing is worked out once per collective.

It writes the full records of a few ranks (rank 0, the slowest and fastest to finish, the one
with the largest memory peak) and per-rank figures for every rank (``EventTable.rank_summaries``);
the memory side, one ledger of every allocation timed on each rank, is ``sim.core.vector_memory``.
"""

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from sim.core.events import (
    EventTable,
    OpKind,
    OpRecord,
    RankSummary,
    Stream,
)
from sim.core.host_clock import HostClock
from sim.core.links import Flow, link_classes, max_min_rates
from sim.core.program import Program, ProgramOp
from sim.core.topology import GroupKind, Topology
from sim.core.vector_memory import OpTimes, memory_ledger, memory_records, rank_peaks

COMPUTE_KINDS = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.RECOMPUTE, OpKind.OPTIMIZER})
MAX_PASSES = 200
TOLERANCE_S = 1e-12


def supports(program: Program, topology: Topology) -> bool:
    """Whether every collective's group is the same on every rank (one group per kind)."""
    kinds = {op.group for op in program.ops if op.group is not None}
    return all(len(topology.members(kind, 0)) == topology.world_size for kind in kinds)


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What each op is, as the passes need it."""

    queue: tuple[int, ...]  # the FIFO an op waits its turn in
    n_queues: int
    collective: np.ndarray  # bool per op
    slowed: np.ndarray  # bool: compute-stream work that ``interference`` slows
    duration: np.ndarray  # (ranks, ops): each op's duration at full speed on each rank


def _plan(
    program: Program,
    factors: np.ndarray | None,
    *,
    serial: bool,
    interference: float,
    group_cost: Callable[[ProgramOp, int], tuple[float, float]] | None,
    world_size: int,
) -> tuple[_Plan, dict[int, float]]:
    keys: dict[Stream | None, int] = {}
    queue = tuple(
        keys.setdefault(None if serial and not op.host_async else op.stream, len(keys)) for op in program.ops
    )
    base = np.array([op.duration_s for op in program.ops])
    shares = {op.op_id: op.wire_fraction for op in program.ops if op.group is not None}
    if group_cost is not None:  # one group per kind: rank 0's group is everyone's
        for op in program.ops:
            if op.group is not None:
                base[op.op_id], shares[op.op_id] = group_cost(op, 0)
    duration = np.broadcast_to(base, (world_size, len(base))).copy()
    if factors is not None:
        jittered = np.array([op.kind in COMPUTE_KINDS for op in program.ops])
        duration[:, jittered] *= factors[:, jittered]
    plan = _Plan(
        queue=queue,
        n_queues=len(keys),
        collective=np.array([op.group is not None for op in program.ops]),
        slowed=np.array(
            [
                not serial and interference != 1.0 and op.stream is Stream.COMPUTE and op.group is None
                for op in program.ops
            ]
        ),
        duration=duration,
    )
    return plan, shares


class _Clock:
    """Compute's progress under ``interference`` while any collective runs: progress(t) =
    t - covered(t)·(1 - 1/interference), covered(t) the time up to t some collective ran."""

    def __init__(self, intervals: list[tuple[float, float]], interference: float):
        merged: list[list[float]] = []
        for start, end in sorted(i for i in intervals if i[1] > i[0]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        knots = [0.0] + [x for iv in merged for x in iv]
        covered = [0.0]
        for start, end in merged:
            covered += [covered[-1], covered[-1] + end - start]
        self.knots = np.array(knots)
        self.covered = np.array(covered) if merged else np.array([0.0])
        self.slow = 1.0 - 1.0 / interference
        self.union_s = sum(end - start for start, end in merged)

    def covered_at(self, t: np.ndarray) -> np.ndarray:
        """Time up to ``t`` some collective ran (``np.interp`` holds the last value beyond the knots)."""
        if len(self.knots) == 1:
            return np.zeros_like(t)
        return np.interp(t, self.knots, self.covered)

    def end(self, start: np.ndarray, work: np.ndarray) -> np.ndarray:
        """When ``work`` seconds of full-speed compute begun at ``start`` are done."""
        if self.slow == 0.0 or len(self.knots) == 1:
            return start + work
        progress_knots = self.knots - self.covered * self.slow
        target = start - self.covered_at(start) * self.slow + work
        inside = np.interp(target, progress_knots, self.knots)
        beyond = self.knots[-1] + (target - progress_knots[-1])
        return np.where(target >= progress_knots[-1], beyond, inside)


@dataclass
class _Flows:
    """The collectives as flows: their shares, links and process groups, and the link classes
    of each combination in flight (``sim.core.links.link_classes``), computed once."""

    shares: dict[int, float]
    links: dict[int, tuple[Hashable, ...]]
    keys: dict[int, Hashable]
    classes: dict[tuple[int, ...], list[tuple[int, ...]]]

    def rate(self, op_id: int, active: list[int]) -> float:
        """``op_id``'s max-min rate while ``active`` (other collectives) run beside it."""
        if not active:
            return 1.0
        ids = [op_id, *active]
        flows = [Flow(share=self.shares[o], links=self.links[o], key=self.keys[o]) for o in ids]
        signature = tuple(ids)
        if signature not in self.classes:
            self.classes[signature] = link_classes(flows)
        return max_min_rates(flows, self.classes[signature])[0]


def _shared_end(
    op_id: int, start: float, work_s: float, flows: _Flows, intervals: dict[int, tuple[float, float]]
) -> float:
    """When a collective begun at ``start`` with ``work_s`` full-speed seconds ends, its rate set
    at every moment by max-min sharing with the collectives in flight (their latest intervals)."""
    share = flows.shares[op_id]
    if share <= 0 or work_s <= 0:
        return start + work_s
    others = [
        (o, s, e) for o, (s, e) in intervals.items() if o != op_id and e > start and flows.shares[o] > 0
    ]
    t, left = start, work_s
    edges = sorted({x for _, s, e in others for x in (s, e) if x > start})
    for edge in [*edges, float("inf")]:
        rate = flows.rate(op_id, [o for o, s, e in others if s <= t < e])
        if t + left / rate <= edge:
            return t + left / rate
        left -= (edge - t) * rate
        t = edge
    return t


@dataclass
class _Pass:
    ready: np.ndarray  # (ops, ranks)
    end: np.ndarray  # (ops, ranks)
    collectives: dict[int, tuple[float, float]]  # op_id -> (start, end), the same on every rank


def _one_pass(
    program: Program,
    plan: _Plan,
    interference: float,
    flows: _Flows,
    previous: dict[int, tuple[float, float]],
) -> _Pass:
    """Every op once, in issue order; each collective's interval replaces its last one as soon
    as it is known, for the collectives and compute that come after it (Gauss-Seidel)."""
    n_ranks = plan.duration.shape[0]
    ready = np.empty((len(program.ops), n_ranks))
    end = np.empty_like(ready)
    queue_end = np.zeros((plan.n_queues, n_ranks))
    latest = dict(previous)
    collectives: dict[int, tuple[float, float]] = {}
    clock: _Clock | None = None
    for op in program.ops:
        i, q = op.op_id, plan.queue[op.op_id]
        r = queue_end[q].copy()
        for d in op.deps:
            np.maximum(r, end[d], out=r)
        ready[i] = r
        if plan.collective[i]:
            start = float(r.max())
            finish = _shared_end(i, start, float(plan.duration[0, i]), flows, latest)
            latest[i] = collectives[i] = (start, finish)
            clock = None
            end[i] = finish
        elif plan.slowed[i]:
            clock = clock or _Clock(list(latest.values()), interference)
            end[i] = clock.end(r, plan.duration[:, i])
        else:
            end[i] = r + plan.duration[:, i]
        queue_end[q] = end[i]
    return _Pass(ready=ready, end=end, collectives=collectives)


def _solve(program: Program, plan: _Plan, flows: _Flows, interference: float) -> _Pass:
    previous: dict[int, tuple[float, float]] = {}
    for _ in range(MAX_PASSES):
        current = _one_pass(program, plan, interference, flows, previous)
        moved = max(
            (
                abs(a - b)
                for o, iv in current.collectives.items()
                for a, b in zip(iv, previous.get(o, (-1, -1)), strict=True)
            ),
            default=0.0,
        )
        previous = current.collectives
        if moved <= TOLERANCE_S:
            return current
    raise RuntimeError(f"the vectorised engine did not settle in {MAX_PASSES} passes; use the SimPy engine")


def _op_records(program: Program, topology: Topology, solved: _Pass, rank: int) -> list[OpRecord]:
    records = []
    for op in program.ops:
        i = op.op_id
        start = solved.collectives[i][0] if i in solved.collectives else float(solved.ready[i, rank])
        records.append(
            OpRecord(
                rank=rank,
                op_id=i,
                stream=op.stream,
                kind=op.kind,
                name=op.name,
                unit=op.unit,
                microbatch=op.microbatch,
                ready_s=float(solved.ready[i, rank]),
                start_s=start,
                end_s=float(solved.end[i, rank]),
                bytes=op.bytes,
                group_size=len(topology.members(op.group, rank)) if op.group is not None else 1,
                algorithm=op.algorithm,
                protocol=op.protocol,
                channels=op.channels,
            )
        )
    return records


def _summaries(program: Program, solved: _Pass, peaks: np.ndarray) -> dict[int, RankSummary]:
    """Each rank's step time, peak, and the breakdown ``sim.outputs.intervals`` defines: the
    compute stream's ops run one after another, so its union is their sum; the collectives are
    the world's, so what of them the compute stream covers is read off one clock."""
    step = float(solved.end.max())
    clock = _Clock(list(solved.collectives.values()), 2.0)
    compute_ops = [op.op_id for op in program.ops if op.stream is Stream.COMPUTE]
    starts, ends = solved.ready[compute_ops], solved.end[compute_ops]
    compute = (ends - starts).sum(axis=0)
    covered = (clock.covered_at(ends) - clock.covered_at(starts)).sum(axis=0)
    exposed = clock.union_s - covered
    last = solved.end.max(axis=0)
    return {
        r: RankSummary(
            step_time_s=float(last[r]),
            peak_memory_bytes=int(peaks[r]),
            compute_s=float(compute[r]),
            exposed_comm_s=float(exposed[r]),
            idle_s=max(0.0, step - float(compute[r]) - float(exposed[r])),
        )
        for r in range(len(last))
    }


def run_vectorized(
    program: Program,
    topology: Topology,
    factors: np.ndarray | None,
    *,
    serial: bool,
    interference: float,
    group_links: Callable[[GroupKind, int], tuple[Hashable, ...]],
    group_cost: Callable[[ProgramOp, int], tuple[float, float]] | None = None,
    materialize: tuple[int, ...] | None = None,
) -> EventTable:
    """The step of every rank (``factors``: each op's duration factor per rank, or None), with the
    full records of ``materialize`` (default: rank 0, the slowest and the fastest rank to finish,
    the rank of the largest memory peak) and every rank's figures."""
    k = topology.world_size
    plan, shares = _plan(
        program,
        factors,
        serial=serial,
        interference=1.0 if serial else interference,
        group_cost=group_cost,
        world_size=k,
    )
    flows = _Flows(
        shares=shares,
        links={op.op_id: group_links(op.group, 0) for op in program.ops if op.group is not None},
        keys={op.op_id: topology.group_id(op.group, 0) for op in program.ops if op.group is not None},
        classes={},
    )
    solved = _solve(program, plan, flows, 1.0 if serial else interference)
    ledger = memory_ledger(program)
    times = OpTimes(ready=solved.ready, end=solved.end)
    peaks = rank_peaks(ledger, times, k)
    last = solved.end.max(axis=0)
    ranks = materialize or tuple(sorted({0, int(last.argmax()), int(last.argmin()), int(peaks.argmax())}))
    ops = [rec for r in ranks for rec in _op_records(program, topology, solved, r)]
    clock = None if serial else HostClock.of(program)
    memory = [rec for r in ranks for rec in memory_records(ledger, times, r, clock)]
    return EventTable(
        world_size=k,
        simulated_ranks=ranks,
        ops=tuple(ops),
        memory=tuple(memory),
        rank_summaries=_summaries(program, solved, peaks),
    )
