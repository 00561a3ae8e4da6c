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
"""

from collections.abc import Mapping, Sequence
from typing import Any

from sim.core.events import Stream
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

    if workspace_bytes:
        apply("alloc", -1, workspace_bytes, "compute")
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
