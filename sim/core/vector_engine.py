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
with the largest memory peak) and per-rank figures for every rank (``EventTable.rank_summaries``).
"""

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from sim.core.events import (
    EventTable,
    MemoryCategory,
    MemoryRecord,
    OpKind,
    OpRecord,
    RankSummary,
    RequestOrder,
    Stream,
)
from sim.core.host_clock import HostClock
from sim.core.links import Flow, link_classes, max_min_rates
from sim.core.program import Alloc, Program, ProgramOp
from sim.core.topology import GroupKind, Topology

COMPUTE_KINDS = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.RECOMPUTE, OpKind.OPTIMIZER})
MAX_PASSES = 200
TOLERANCE_S = 1e-12
CHUNK_RANKS = 1024  # ranks whose memory ledgers are sorted at once


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


@dataclass(frozen=True, kw_only=True)
class _Ledger:
    """Every memory change of the program, in the order one rank makes them at equal times (a
    finishing op's frees before what it lets start allocates): when, by how much, of what."""

    op_ids: np.ndarray  # the op whose ready (phase 1) or end (phase 0) moment it happens at
    at_end: np.ndarray  # bool
    delta: np.ndarray  # bytes
    category: tuple[MemoryCategory, ...]
    label: tuple[str, ...]
    stream: tuple[Stream, ...]
    pieces: tuple[tuple[int, ...], ...]  # an allocation's tensors (``Alloc.pieces``)
    orders: tuple[RequestOrder | None, ...]  # and their order (``Alloc.order``)
    initial: tuple[Alloc, ...]


def _ledger(program: Program) -> _Ledger:
    sizes: dict[str, tuple[MemoryCategory, int]] = {a.label: (a.category, a.bytes) for a in program.initial}
    rows: list[tuple[int, bool, int, MemoryCategory, str, Stream, tuple[int, ...], RequestOrder | None]] = []
    for op in program.ops:
        for label in op.start_frees:
            category, nbytes = sizes[label]
            rows.append((op.op_id, False, -nbytes, category, label, op.stream, (), None))
        for a in op.allocs:
            sizes[a.label] = (a.category, a.bytes)
            rows.append((op.op_id, False, a.bytes, a.category, a.label, op.stream, a.pieces, a.order))
        for label in op.frees:
            category, nbytes = sizes[label]
            rows.append((op.op_id, True, -nbytes, category, label, op.stream, (), None))
        for a in op.end_allocs:
            sizes[a.label] = (a.category, a.bytes)
            rows.append((op.op_id, True, a.bytes, a.category, a.label, op.stream, a.pieces, a.order))
    rows = [r for r in rows if r[2] != 0]
    return _Ledger(
        op_ids=np.array([r[0] for r in rows], dtype=np.int64),
        at_end=np.array([r[1] for r in rows], dtype=bool),
        delta=np.array([r[2] for r in rows], dtype=np.int64),
        category=tuple(r[3] for r in rows),
        label=tuple(r[4] for r in rows),
        stream=tuple(r[5] for r in rows),
        pieces=tuple(r[6] for r in rows),
        orders=tuple(r[7] for r in rows),
        initial=tuple(a for a in program.initial if a.bytes > 0),
    )


def _ledger_times(ledger: _Ledger, solved: _Pass, ranks: np.ndarray) -> np.ndarray:
    """(ranks, entries): when each entry happens on each rank."""
    at_end = solved.end[ledger.op_ids][:, ranks]
    at_ready = solved.ready[ledger.op_ids][:, ranks]
    return np.where(ledger.at_end[:, None], at_end, at_ready).T


def _order(times: np.ndarray, ledger: _Ledger) -> np.ndarray:
    """Per rank, the entries in time order; at equal times ends before readies, then issue order."""
    phase = np.where(ledger.at_end, 0, 1)
    keys = np.lexsort((np.arange(len(phase)), ledger.op_ids, phase, times), axis=-1)
    return keys


def _peaks(ledger: _Ledger, solved: _Pass, n_ranks: int) -> np.ndarray:
    """Each rank's largest live total (the initial allocations included)."""
    base = sum(a.bytes for a in ledger.initial)
    peaks = np.empty(n_ranks, dtype=np.int64)
    for lo in range(0, n_ranks, CHUNK_RANKS):
        ranks = np.arange(lo, min(n_ranks, lo + CHUNK_RANKS))
        times = _ledger_times(ledger, solved, ranks)
        order = (
            np.stack([_order(row, ledger) for row in times])
            if len(ledger.delta)
            else np.zeros((len(ranks), 0), int)
        )
        live = base + np.cumsum(ledger.delta[order], axis=1) if order.size else np.full((len(ranks), 1), base)
        peaks[ranks] = np.maximum(live.max(axis=1), base)
    return peaks


def _memory_records(ledger: _Ledger, solved: _Pass, rank: int, clock: HostClock | None) -> list[MemoryRecord]:
    """``rank``'s memory records in device-time order, each with the time the caching allocator
    sees it (``clock``; None where the host is the device)."""
    end_of = solved.end[:, rank].__getitem__
    records = [
        MemoryRecord(
            rank=rank,
            time_s=0.0,
            category=a.category,
            delta_bytes=a.bytes,
            label=a.label,
            stream=Stream.COMPUTE,
            pieces=a.pieces,
            host_s=None if clock is None else 0.0,
            resident=True,
            carried=a.carried,
        )
        for a in ledger.initial
    ]
    times = _ledger_times(ledger, solved, np.array([rank]))[0]
    for k in _order(times, ledger):
        device_s, delta = float(times[k]), int(ledger.delta[k])
        host_s = (
            None
            if clock is None
            else clock.allocator_s(
                op_id=int(ledger.op_ids[k]),
                label=ledger.label[k],
                delta_bytes=delta,
                device_s=device_s,
                end_of=lambda op: float(end_of(op)),
            )
        )
        records.append(
            MemoryRecord(
                rank=rank,
                time_s=device_s,
                category=ledger.category[k],
                delta_bytes=delta,
                label=ledger.label[k],
                stream=ledger.stream[k],
                pieces=ledger.pieces[k],
                order=ledger.orders[k],
                host_s=host_s,
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
    ledger = _ledger(program)
    peaks = _peaks(ledger, solved, k)
    last = solved.end.max(axis=0)
    ranks = materialize or tuple(sorted({0, int(last.argmax()), int(last.argmin()), int(peaks.argmax())}))
    ops = [rec for r in ranks for rec in _op_records(program, topology, solved, r)]
    clock = None if serial else HostClock.of(program)
    memory = [rec for r in ranks for rec in _memory_records(ledger, solved, r, clock)]
    return EventTable(
        world_size=k,
        simulated_ranks=ranks,
        ops=tuple(ops),
        memory=tuple(memory),
        rank_summaries=_summaries(program, solved, peaks),
    )
