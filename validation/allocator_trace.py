"""A GPU's own allocation trace replayed through the caching allocator's model: the check that
tells an error in reserved memory apart, the allocator model's (``sim.outputs.allocator``) or the
simulated sequence's.

On a GPU, ``make validate-gpu`` runs one real step with ``torch.cuda.memory._record_memory_history``
on from before the model is built (``validation.worker``, spec key ``allocator_trace``). The
device's trace lists every action of PyTorch's caching allocator (``torch.cuda.memory._snapshot``,
``TraceEntry``): ``alloc`` (a block of ``size`` bytes at ``addr`` on ``stream``), ``free_requested``
(the tensor dropped), ``free_completed`` (the block reusable: at once, or once the streams that
used it, ``record_stream``, have passed), ``segment_alloc`` and ``segment_free`` (``cudaMalloc``
and ``cudaFree``). Here the allocs and completed frees, in order, with their streams, are replayed
through ``CachingAllocator`` (``replay``, which also replays the fake run's storage log of
``validation.allocator_replay``); the trace's own segments give
what the GPU reserved. Equal: the allocator model is right and an error is in the sequence the
simulator asks for; apart: the allocator model misses a rule.

The trace itself can come home (``save_trace``: the actions, addresses, sizes and streams, gzipped
JSON; ``make validate-gpu-device`` leaves it in ``$OUT``), to be read here without a GPU:
``python -m validation.allocator_trace TRACE.json.gz`` prints the same check, and
``load_trace`` hands the entries to whatever compares them with a fake run's storage log.
"""

import argparse
import gzip
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sim.core.events import Stream
from sim.errors import UserError
from sim.fileio import write_bytes_atomic
from sim.outputs.allocator import CUBLAS_WORKSPACE_THREADS
from sim.outputs.caching_allocator import CachingAllocator

# CUDA streams are numbered by their handle; the replay needs only which are the same
REPLAY_STREAMS = tuple(Stream)
STREAMS = {s.value: s for s in Stream}  # a replay event's stream, by name


def replay(
    events: list[tuple[str, int, int, str]],
    step_start: int,
    *,
    capacity_bytes: int,
    workspace_bytes: int,
    steps: int,
) -> dict[str, int]:
    """Peak allocated and reserved bytes of the log replayed with its step ``steps`` times. What a
    step leaves live that it allocated (an output the loop keeps) is released when the next
    repetition starts: the log does not say when the next step would drop it (a log of
    ``training.keep_outputs`` holds two steps, the second the steady state, for that reason)."""
    allocator = CachingAllocator(capacity_bytes)
    label_of: dict[int, str] = {}
    live = peak_live = 0
    sizes: dict[str, int] = {}
    counter = 0

    def apply(kind: str, key: int, nbytes: int, stream: str) -> None:
        nonlocal live, peak_live, counter
        if kind == "alloc":
            if nbytes == 0:
                return
            counter += 1
            label = f"{key}:{counter}"
            label_of[key] = label
            sizes[label] = nbytes
            allocator.malloc(label, nbytes, STREAMS[stream])
            live += nbytes
            peak_live = max(peak_live, live)
        elif key in label_of:
            label = label_of.pop(key)
            allocator.free(label)
            live -= sizes.pop(label)

    if workspace_bytes:  # the cuBLAS workspaces, one per thread that runs matmuls
        for i, _ in enumerate(CUBLAS_WORKSPACE_THREADS, start=1):
            apply("alloc", -i, workspace_bytes, "compute")
    for event in events[:step_start]:
        apply(*event)
    for _ in range(steps):
        before = set(label_of.values())
        for event in events[step_start:]:
            apply(*event)
        for key, label in list(label_of.items()):  # the step's leftovers, released before the next
            if label not in before:
                apply("free", key, 0, "")
    return {"peak_allocated_bytes": peak_live, "peak_reserved_bytes": allocator.peak_reserved}


def trace_events(entries: Sequence[Mapping[str, Any]]) -> list[tuple[str, int, int, str]]:
    """The trace's allocs and completed frees as replay events ``(kind, address, bytes, stream)``,
    each CUDA stream a stream of its own (named in the order first seen)."""
    names: dict[int, str] = {}
    events: list[tuple[str, int, int, str]] = []
    for entry in entries:
        action = entry["action"]
        if action not in ("alloc", "free_completed"):
            continue
        stream = int(entry.get("stream", 0))
        if stream not in names:
            if len(names) == len(REPLAY_STREAMS):
                raise ValueError(f"the trace uses more than {len(REPLAY_STREAMS)} CUDA streams")
            names[stream] = REPLAY_STREAMS[len(names)].value
        kind = "alloc" if action == "alloc" else "free"
        events.append((kind, int(entry["addr"]), int(entry["size"]) if kind == "alloc" else 0, names[stream]))
    return events


def trace_peaks(entries: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """What the GPU itself reserved (its segments: ``segment_alloc`` less ``segment_free``) and
    held in blocks (an ``alloc`` until its ``free_completed``: the active bytes), at their peaks."""
    reserved = active = peak_reserved = peak_active = 0
    sizes: dict[int, int] = {}
    for entry in entries:
        action, size = entry["action"], int(entry.get("size", 0))
        if action == "segment_alloc":
            reserved += size
        elif action == "segment_free":
            reserved -= size
        elif action == "alloc":
            sizes[int(entry["addr"])] = size
            active += size
        elif action == "free_completed":
            active -= sizes.pop(int(entry["addr"]), 0)
        peak_reserved, peak_active = max(peak_reserved, reserved), max(peak_active, active)
    return {"reserved_bytes": peak_reserved, "active_bytes": peak_active}


def check_trace(entries: Sequence[Mapping[str, Any]], capacity_bytes: int) -> dict[str, int]:
    """The GPU's peaks against the allocator model's, fed the GPU's own sequence."""
    gpu = trace_peaks(entries)
    events = trace_events(entries)
    replayed = replay(events, len(events), capacity_bytes=capacity_bytes, workspace_bytes=0, steps=0)
    return {
        "entries": len(entries),
        "streams": len({stream for *_, stream in events}),
        "gpu_reserved_bytes": gpu["reserved_bytes"],
        "replayed_reserved_bytes": replayed["peak_reserved_bytes"],
        "gpu_active_bytes": gpu["active_bytes"],
        "replayed_active_bytes": replayed["peak_allocated_bytes"],
    }


# what a saved trace keeps of each entry (``TraceEntry``; the stack frames are not recorded)
TRACE_FIELDS = ("action", "addr", "size", "stream")


def save_trace(
    path: str | Path, entries: Sequence[Mapping[str, Any]], *, capacity_bytes: int, device: str
) -> None:
    """The trace's entries, each as its ``TRACE_FIELDS``, with the device's memory and name, as
    gzipped JSON written atomically."""
    rows = [
        [e["action"], int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0))] for e in entries
    ]
    doc = {"device": device, "capacity_bytes": capacity_bytes, "fields": list(TRACE_FIELDS), "entries": rows}
    write_bytes_atomic(path, gzip.compress(json.dumps(doc, separators=(",", ":")).encode()))


def load_trace(path: str | Path) -> tuple[list[dict[str, Any]], int, str]:
    """A saved trace's entries (as ``torch.cuda.memory._snapshot`` gives them, those fields only),
    the device's memory and its name; a file that is not one is a ``UserError`` naming it."""
    try:
        doc = json.loads(gzip.decompress(Path(path).read_bytes()))
        fields = doc["fields"]
        entries = [dict(zip(fields, row, strict=True)) for row in doc["entries"]]
        return entries, int(doc["capacity_bytes"]), str(doc["device"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{path}: not a saved allocator trace (validation.allocator_trace.save_trace): {e}"
        ) from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m validation.allocator_trace",
        description="A GPU's saved allocation trace through the allocator model: both peaks.",
    )
    parser.add_argument("trace", help="a trace saved by save_trace (TRACE.json.gz)")
    args = parser.parse_args(argv)
    try:
        entries, capacity, device = load_trace(args.trace)
    except UserError as e:
        print(f"allocator_trace: error: {e}", file=sys.stderr)
        return 2
    check = check_trace(entries, capacity)
    gib = 2**30
    print(
        f"{device}: {check['entries']:,} entries, {check['streams']} streams; reserved: the GPU "
        f"{check['gpu_reserved_bytes'] / gib:.3f} GiB, the model fed its sequence "
        f"{check['replayed_reserved_bytes'] / gib:.3f} GiB; active: "
        f"{check['gpu_active_bytes'] / gib:.3f} against {check['replayed_active_bytes'] / gib:.3f} GiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
