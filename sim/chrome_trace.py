"""Chrome trace (Trace Event Format JSON) of an ``EventTable``, for Perfetto and Holistic Trace Analysis.

Layout, following what PyTorch's profiler (Kineto, ``libkineto/src/output_json.cpp``) writes for GPUs:

- ``pid`` = rank, named by a ``process_name`` metadata event ``"GPU <rank>"`` (Kineto names device
  processes ``"GPU <device>"``), with ``process_labels`` ``"rank <rank>"`` and a ``process_sort_index``;
- ``tid`` = CUDA stream id, named ``"stream <id> <stream>"`` (Kineto's ``"stream {} {}"`` format with our
  stream name as the postfix). The compute stream is 7, the id CUPTI reports for the default stream;
  the communication streams get fixed ids (``STREAM_IDS``);
- every op is a complete ``X`` event (``cat`` ``"kernel"``, ``ts``/``dur`` in microseconds) whose
  ``args`` carry Kineto's ``device``/``stream`` and, for collectives, its ``Collective name``
  (``_allgather_base``, ``_reduce_scatter_base``, ``allreduce``: the names c10d records for the calls
  FSDP2 makes), ``Group size`` and ``dtype``, plus the simulator's own ``unit``, ``bytes`` (nccl-tests
  size), ``microbatch`` and ``wait for slowest rank (us)``. Collective kernels are named as NCCL >= 2.19
  names them (``ncclDevKernel_AllGather_RING_LL``, ``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL``); the
  ``_LL`` suffix is the kernel's name whatever protocol it runs, so real traces show it for every size;
- memory is a ``C`` (counter) event named ``"Memory (bytes)"`` per rank, one series per
  ``MemoryCategory``, cumulative bytes after every change;
- the top-level ``distributedInfo`` (``backend``, ``rank``, ``world_size``) lets HTA load one file per
  rank (``write_chrome_trace_per_rank``); a file holding several ranks records the first of them.

Times in the file are microseconds: ``ts = start_s * 1e6`` and ``dur = end_s * 1e6 - ts``, unrounded, so
totals recomputed from the file match ``sim.intervals`` to float precision.
"""

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sim.events import EventTable, MemoryCategory, MemoryRecord, OpKind, OpRecord, Stream
from sim.io import write_text_atomic

US_PER_S = 1e6

STREAM_IDS: dict[Stream, int] = {
    Stream.COMPUTE: 7,
    Stream.ALL_GATHER: 20,
    Stream.REDUCE_SCATTER: 24,
    Stream.ALL_REDUCE: 28,
}

# Collective name c10d's record_param_comms stores for the call FSDP2 (or DDP) makes.
COLLECTIVE_NAMES: dict[OpKind, str] = {
    OpKind.ALL_GATHER: "_allgather_base",
    OpKind.REDUCE_SCATTER: "_reduce_scatter_base",
    OpKind.ALL_REDUCE: "allreduce",
}

# NCCL's short dtype spelling in kernel names, from the simulator's canonical dtype names.
NCCL_DTYPES: dict[str, str] = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "fp8": "f8e4m3"}

MEMORY_COUNTER = "Memory (bytes)"

R = TypeVar("R", OpRecord, MemoryRecord)


def kernel_name(op: OpRecord, reduce_dtype: str = "fp32") -> str:
    """The name Kineto would show for ``op``: NCCL's kernel for a collective, else the op's own name."""
    dtype = NCCL_DTYPES.get(reduce_dtype, reduce_dtype)
    if op.kind is OpKind.ALL_GATHER:
        return "ncclDevKernel_AllGather_RING_LL"
    if op.kind is OpKind.REDUCE_SCATTER:
        return f"ncclDevKernel_ReduceScatter_Sum_{dtype}_RING_LL"
    if op.kind is OpKind.ALL_REDUCE:
        return f"ncclDevKernel_AllReduce_Sum_{dtype}_RING_LL"
    return op.name


def metadata_events(rank: int, streams: Iterable[Stream]) -> list[dict[str, Any]]:
    """``M`` events naming one rank's process and its stream threads."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"GPU {rank}"}},
        {"name": "process_labels", "ph": "M", "pid": rank, "tid": 0, "args": {"labels": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for stream in streams:
        tid = STREAM_IDS[stream]
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": rank,
                "tid": tid,
                "args": {"name": f"stream {tid} {stream}"},
            }
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
        )
    return events


def op_event(rank: int, op: OpRecord, reduce_dtype: str = "fp32") -> dict[str, Any]:
    """One complete (``X``) event for ``op`` shown on process ``rank``."""
    ts = op.start_s * US_PER_S
    args: dict[str, Any] = {
        "device": rank,
        "stream": STREAM_IDS[op.stream],
        "kind": str(op.kind),
        "op": op.name,
        "op_id": op.op_id,
        "unit": op.unit,
        "microbatch": op.microbatch,
    }
    if op.kind.is_collective:
        args["Collective name"] = COLLECTIVE_NAMES[op.kind]
        args["Group size"] = op.group_size
        if op.kind is not OpKind.ALL_GATHER:
            args["dtype"] = reduce_dtype
        args["bytes"] = op.bytes
        args["wait for slowest rank (us)"] = (op.start_s - op.ready_s) * US_PER_S
    return {
        "ph": "X",
        "cat": "kernel",
        "name": kernel_name(op, reduce_dtype),
        "pid": rank,
        "tid": STREAM_IDS[op.stream],
        "ts": ts,
        "dur": op.end_s * US_PER_S - ts,
        "args": args,
    }


def memory_events(rank: int, records: Sequence[MemoryRecord]) -> Iterator[dict[str, Any]]:
    """Counter (``C``) events: bytes held per category after the changes at each distinct time."""
    totals = {c: 0 for c in MemoryCategory}
    ordered = sorted(records, key=lambda m: m.time_s)
    for i, rec in enumerate(ordered):
        totals[rec.category] += rec.delta_bytes
        if i + 1 < len(ordered) and ordered[i + 1].time_s == rec.time_s:
            continue
        yield {
            "ph": "C",
            "name": MEMORY_COUNTER,
            "pid": rank,
            "tid": 0,
            "ts": rec.time_s * US_PER_S,
            "args": {str(c): v for c, v in totals.items()},
        }


def by_rank(records: Iterable[R]) -> dict[int, list[R]]:
    """Records grouped by their (simulated) rank, in table order."""
    groups: dict[int, list[R]] = {}
    for rec in records:
        groups.setdefault(rec.rank, []).append(rec)
    return groups


def rank_events(
    rank: int, ops: Sequence[OpRecord], memory: Sequence[MemoryRecord], reduce_dtype: str = "fp32"
) -> list[dict[str, Any]]:
    """All events of one job rank, from the ops and memory records that stand for it."""
    present = {o.stream for o in ops}
    events = metadata_events(rank, [s for s in Stream if s in present])
    events.extend(op_event(rank, o, reduce_dtype) for o in sorted(ops, key=lambda o: (o.start_s, o.op_id)))
    events.extend(memory_events(rank, memory))
    return events


def trace_document(
    table: EventTable,
    ranks: Sequence[int],
    reduce_dtype: str = "fp32",
    groups: tuple[dict[int, list[OpRecord]], dict[int, list[MemoryRecord]]] | None = None,
) -> dict[str, Any]:
    """The whole trace as a JSON-ready dict for the job ranks ``ranks``.

    ``groups`` is ``(by_rank(table.ops), by_rank(table.memory))`` when the caller already has it.
    """
    ops, memory = groups if groups is not None else (by_rank(table.ops), by_rank(table.memory))
    events: list[dict[str, Any]] = []
    for rank in ranks:
        sim_rank = table.rank_of(rank)
        events.extend(rank_events(rank, ops.get(sim_rank, []), memory.get(sim_rank, []), reduce_dtype))
    return {
        "schemaVersion": 1,
        "distributedInfo": {
            "backend": "nccl",
            "rank": ranks[0] if ranks else 0,
            "world_size": table.world_size,
        },
        "displayTimeUnit": "ms",
        "traceEvents": events,
    }


def checked_ranks(table: EventTable, ranks: Sequence[int] | None) -> list[int]:
    """``ranks`` (default: the simulated ranks) after checking each is a rank of the job."""
    chosen = list(table.simulated_ranks if ranks is None else ranks)
    for r in chosen:
        if not 0 <= r < table.world_size:
            raise ValueError(f"rank {r} is outside the job (world_size {table.world_size})")
    return chosen


def dump(document: dict[str, Any]) -> str:
    """Compact JSON text of a trace document."""
    return json.dumps(document, separators=(",", ":"))


def write_chrome_trace(
    table: EventTable,
    path: str | Path,
    *,
    ranks: Sequence[int] | None = None,
    reduce_dtype: str = "fp32",
) -> None:
    """Write ``table`` as one Chrome trace at ``path`` (atomically).

    ``ranks`` are job ranks to include (default: the simulated ranks); a rank that was not simulated
    shows the records of the rank that stands for it. ``reduce_dtype`` names the reduction kernels.
    """
    write_text_atomic(path, dump(trace_document(table, checked_ranks(table, ranks), reduce_dtype)))


def write_chrome_trace_per_rank(
    table: EventTable,
    directory: str | Path,
    *,
    ranks: Sequence[int] | None = None,
    reduce_dtype: str = "fp32",
) -> list[Path]:
    """Write one trace per rank, ``rank<r>.trace.json`` in ``directory``, the layout HTA's ``TraceAnalysis`` reads.

    Each file's ``distributedInfo.rank`` is its rank. ``ranks`` defaults to the simulated ranks.
    Returns the paths written.
    """
    groups = (by_rank(table.ops), by_rank(table.memory))
    paths = []
    for r in checked_ranks(table, ranks):
        path = Path(directory) / f"rank{r}.trace.json"
        write_text_atomic(path, dump(trace_document(table, [r], reduce_dtype, groups)))
        paths.append(path)
    return paths
