"""The memory side of the vectorised engine (``sim.core.vector_engine``): every allocation and
free of the program as one ledger, timed on each rank by its ops' ready and end times, from
which each rank's peak (all ranks, in chunks) and the full memory records of a few ranks are
read. The ordering at equal times is the SimPy engine's (``sim.core.engine``): a finishing op's
frees before what it lets start allocates, then issue order.
"""

from dataclasses import dataclass

import numpy as np

from sim.core.events import MemoryCategory, MemoryRecord, RequestOrder, Stream
from sim.core.host_clock import HostClock
from sim.core.program import Alloc, Program

CHUNK_RANKS = 1024  # ranks whose memory ledgers are sorted at once


@dataclass(frozen=True, kw_only=True)
class OpTimes:
    """When each op of the program is ready and ends, per rank."""

    ready: np.ndarray  # (ops, ranks), seconds
    end: np.ndarray  # (ops, ranks), seconds


@dataclass(frozen=True, kw_only=True)
class MemoryLedger:
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


def memory_ledger(program: Program) -> MemoryLedger:
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
        for label in op.late_frees:
            category, nbytes = sizes[label]
            rows.append((op.op_id, True, -nbytes, category, label, op.stream, (), None))
    rows = [r for r in rows if r[2] != 0]
    return MemoryLedger(
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


def _ledger_times(ledger: MemoryLedger, times: OpTimes, ranks: np.ndarray) -> np.ndarray:
    """(ranks, entries): when each entry happens on each rank."""
    at_end = times.end[ledger.op_ids][:, ranks]
    at_ready = times.ready[ledger.op_ids][:, ranks]
    return np.where(ledger.at_end[:, None], at_end, at_ready).T


def _order(times: np.ndarray, ledger: MemoryLedger) -> np.ndarray:
    """Per rank, the entries in time order; at equal times ends before readies, then issue order."""
    phase = np.where(ledger.at_end, 0, 1)
    keys = np.lexsort((np.arange(len(phase)), ledger.op_ids, phase, times), axis=-1)
    return keys


def rank_peaks(ledger: MemoryLedger, times: OpTimes, n_ranks: int) -> np.ndarray:
    """Each rank's largest live total (the initial allocations included)."""
    base = sum(a.bytes for a in ledger.initial)
    peaks = np.empty(n_ranks, dtype=np.int64)
    for lo in range(0, n_ranks, CHUNK_RANKS):
        ranks = np.arange(lo, min(n_ranks, lo + CHUNK_RANKS))
        at = _ledger_times(ledger, times, ranks)
        order = (
            np.stack([_order(row, ledger) for row in at])
            if len(ledger.delta)
            else np.zeros((len(ranks), 0), int)
        )
        live = base + np.cumsum(ledger.delta[order], axis=1) if order.size else np.full((len(ranks), 1), base)
        peaks[ranks] = np.maximum(live.max(axis=1), base)
    return peaks


def memory_records(
    ledger: MemoryLedger, times: OpTimes, rank: int, clock: HostClock | None
) -> list[MemoryRecord]:
    """``rank``'s memory records in device-time order, each with the time the caching allocator
    sees it (``clock``; None where the host is the device)."""
    end_of = times.end[:, rank].__getitem__
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
    at = _ledger_times(ledger, times, np.array([rank]))[0]
    for k in _order(at, ledger):
        device_s, delta = float(at[k]), int(ledger.delta[k])
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
