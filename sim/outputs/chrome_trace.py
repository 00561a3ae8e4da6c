"""Chrome trace (Trace Event Format JSON) of an ``EventTable``, for Perfetto and Holistic Trace Analysis.

Layout, following what PyTorch's profiler (Kineto, ``libkineto/src/output_json.cpp``) writes:

- ``pid`` = rank, named by a ``process_name`` metadata event ``"GPU <rank>"`` on NCCL (Kineto names
  device processes ``"GPU <device>"``) or ``"CPU rank <rank>"`` on gloo, with ``process_labels``
  ``"rank <rank>"`` and a ``process_sort_index``;
- ``tid`` = stream id, named ``"stream <id> <stream>"`` (Kineto's ``"stream {} {}"`` format with our
  stream name as the postfix). The compute stream is 7, the id CUPTI reports for the default stream;
  the communication streams get fixed ids (``STREAM_IDS``);
- every op is a complete ``X`` event (``ts``/``dur`` in microseconds) whose ``args`` carry Kineto's
  ``device``/``stream`` and, for collectives, its ``Collective name`` (``_allgather_base``,
  ``_reduce_scatter_base``, ``allreduce``: the names c10d records for the calls FSDP2 makes),
  ``Group size``, ``dtype`` and ``algorithm``, plus the simulator's own ``unit``, ``bytes`` (nccl-tests
  size), ``microbatch`` and ``wait for slowest rank (us)``;
- a collective is named as the backend names it (``kernel_name``). NCCL >= 2.19 builds one kernel per
  collective, reduction and dtype, labelled ``TREE`` for the tree algorithm and ``RING`` for every
  other (NVLS, PAT and CollNet included), always with the ``_LL`` suffix: the algorithm and protocol
  are dispatched inside it at run time (NVIDIA/nccl ``src/device/generate.py`` ``best_kernel``; the
  maintainers in NVIDIA/nccl#2196). So a 500 MB ring all-gather is ``ncclDevKernel_AllGather_RING_LL``
  and a tree all-reduce ``ncclDevKernel_AllReduce_Sum_f32_TREE_LL``. On gloo a collective is the host's
  record-function range ``gloo:all_gather`` or ``gloo:all_reduce`` (``ProcessGroupGloo.cpp``; its
  reduce-scatter runs as an all-reduce and carries that name), category ``user_annotation``;
- memory is a ``C`` (counter) event named ``"Memory (bytes)"`` per rank, one series per
  ``MemoryCategory``: the rank's memory curve (``sim.outputs.memory_curve``), one event per change;
- the top-level ``distributedInfo`` (``backend``, ``rank``, ``world_size``) lets HTA load one file per
  rank (``write_chrome_trace_per_rank``); a file holding several ranks records the first of them.

Times in the file are microseconds: ``ts = start_s * 1e6`` and ``dur = end_s * 1e6 - ts``, unrounded, so
totals recomputed from the file match ``sim.outputs.intervals`` to float precision.
"""

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.core.events import EventTable, OpKind, OpRecord, Stream
from sim.fileio import write_text_atomic
from sim.outputs.memory_curve import MemoryCurve, memory_curves

US_PER_S = 1e6

STREAM_IDS: dict[Stream, int] = {
    Stream.COMPUTE: 7,
    Stream.ALL_GATHER: 20,
    Stream.REDUCE_SCATTER: 24,
    Stream.ALL_REDUCE: 28,
    Stream.ALL_TO_ALL: 44,  # expert parallelism's token exchange
    Stream.HOST: 1,  # the issuing CPU thread
    Stream.H2D: 32,  # offload's copy streams (DeepSpeed's and FSDP1's side streams)
    Stream.D2H: 36,
    Stream.NVME: 40,
}

# Collective name c10d's record_param_comms stores for the call FSDP2 (or DDP) makes.
COLLECTIVE_NAMES: dict[OpKind, str] = {
    OpKind.ALL_GATHER: "_allgather_base",
    OpKind.REDUCE_SCATTER: "_reduce_scatter_base",
    OpKind.ALL_REDUCE: "allreduce",
    OpKind.ALL_TO_ALL: "all_to_allv",  # all_to_all_single with split sizes (torchtitan's dispatch)
}

# NCCL's short dtype spelling in kernel names, from the simulator's canonical dtype names.
NCCL_DTYPES: dict[str, str] = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "fp8": "f8e4m3"}
NCCL_KERNELS: dict[OpKind, str] = {
    OpKind.ALL_GATHER: "AllGather",
    OpKind.REDUCE_SCATTER: "ReduceScatter",
    OpKind.ALL_REDUCE: "AllReduce",
    OpKind.ALL_TO_ALL: "SendRecv",  # NCCL runs an all-to-all as grouped point-to-point sends
}
GLOO_NAMES: dict[OpKind, str] = {
    OpKind.ALL_GATHER: "gloo:all_gather",
    OpKind.REDUCE_SCATTER: "gloo:all_reduce",  # ProcessGroupGloo reduce-scatters with an all-reduce
    OpKind.ALL_REDUCE: "gloo:all_reduce",
    OpKind.ALL_TO_ALL: "gloo:all_to_all",
}

MEMORY_COUNTER = "Memory (bytes)"


@dataclass(frozen=True, kw_only=True)
class TraceNames:
    """What names a trace: the profile's backend and the dtype of the reductions."""

    backend: str = "nccl"
    reduce_dtype: str = "fp32"


def kernel_name(op: OpRecord, names: TraceNames) -> str:
    """The name a profiler shows for ``op``: the backend's for a collective, else the op's own."""
    if not op.kind.is_collective:
        return op.name
    if names.backend == "gloo":
        return GLOO_NAMES[op.kind]
    coll = NCCL_KERNELS[op.kind]
    if op.kind is OpKind.ALL_TO_ALL:  # one kernel for every point-to-point send and receive
        return f"ncclDevKernel_{coll}"
    if op.kind is OpKind.ALL_GATHER:
        return f"ncclDevKernel_{coll}_RING_LL"
    algo = "TREE" if op.algorithm == "tree" else "RING"
    dtype = NCCL_DTYPES.get(names.reduce_dtype, names.reduce_dtype)
    return f"ncclDevKernel_{coll}_Sum_{dtype}_{algo}_LL"


def metadata_events(rank: int, streams: Iterable[Stream], names: TraceNames) -> list[dict[str, Any]]:
    """``M`` events naming one rank's process and its stream threads."""
    process = f"GPU {rank}" if names.backend == "nccl" else f"CPU rank {rank}"
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": process}},
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


def op_event(rank: int, op: OpRecord, names: TraceNames) -> dict[str, Any]:
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
            args["dtype"] = names.reduce_dtype
        args["algorithm"] = op.algorithm
        if op.protocol:
            args["protocol"] = op.protocol
        if op.channels:
            args["channels"] = op.channels
        args["bytes"] = op.bytes
        args["wait for slowest rank (us)"] = (op.start_s - op.ready_s) * US_PER_S
    gloo_collective = op.kind.is_collective and names.backend == "gloo"
    category = "user_annotation" if gloo_collective else "cpu_op" if op.stream is Stream.HOST else "kernel"
    return {
        "ph": "X",
        "cat": category,
        "name": kernel_name(op, names),
        "pid": rank,
        "tid": STREAM_IDS[op.stream],
        "ts": ts,
        "dur": op.end_s * US_PER_S - ts,
        "args": args,
    }


def memory_events(rank: int, curve: MemoryCurve) -> Iterator[dict[str, Any]]:
    """Counter (``C``) events: bytes held per category after each change of the memory curve."""
    for i, time_s in enumerate(curve.times_s):
        yield {
            "ph": "C",
            "name": MEMORY_COUNTER,
            "pid": rank,
            "tid": 0,
            "ts": float(time_s) * US_PER_S,
            "args": {str(c): int(v[i]) for c, v in curve.by_category.items()},
        }


def rank_events(table: EventTable, rank: int, names: TraceNames, curve: MemoryCurve) -> list[dict[str, Any]]:
    """All events of one job rank, from the ops and the memory curve that stand for it."""
    ops = table.ops_of(rank)
    present = {o.stream for o in ops}
    events = metadata_events(rank, [s for s in Stream if s in present], names)
    events.extend(op_event(rank, o, names) for o in sorted(ops, key=lambda o: (o.start_s, o.op_id)))
    events.extend(memory_events(rank, curve))
    return events


def trace_document(
    table: EventTable,
    ranks: Sequence[int],
    names: TraceNames,
    curves: dict[int, MemoryCurve] | None = None,
) -> dict[str, Any]:
    """The whole trace as a JSON-ready dict for the job ranks ``ranks``; ``curves`` are the
    simulated ranks' memory curves when the caller already has them."""
    curves = curves if curves is not None else memory_curves(table)
    events: list[dict[str, Any]] = []
    for rank in ranks:
        events.extend(rank_events(table, rank, names, curves[table.rank_of(rank)]))
    return {
        "schemaVersion": 1,
        "distributedInfo": {
            "backend": names.backend,
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
    names: TraceNames = TraceNames(),
) -> None:
    """Write ``table`` as one Chrome trace at ``path`` (atomically).

    ``ranks`` are job ranks to include (default: the simulated ranks); a rank that was not simulated
    shows the records of the rank that stands for it. ``names`` gives the backend and the reduction dtype.
    """
    write_text_atomic(path, dump(trace_document(table, checked_ranks(table, ranks), names)))


def write_chrome_trace_per_rank(
    table: EventTable,
    directory: str | Path,
    *,
    ranks: Sequence[int] | None = None,
    names: TraceNames = TraceNames(),
) -> list[Path]:
    """Write one trace per rank, ``rank<r>.trace.json`` in ``directory``, the layout HTA's ``TraceAnalysis`` reads.

    Each file's ``distributedInfo.rank`` is its rank. ``ranks`` defaults to the simulated ranks.
    Returns the paths written.
    """
    paths = []
    curves = memory_curves(table)
    for r in checked_ranks(table, ranks):
        path = Path(directory) / f"rank{r}.trace.json"
        write_text_atomic(path, dump(trace_document(table, [r], names, curves)))
        paths.append(path)
    return paths
