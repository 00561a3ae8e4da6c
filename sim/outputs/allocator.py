"""Reserved memory: the step's allocations replayed through a model of PyTorch's CUDA caching
allocator (``c10/cuda/CUDACachingAllocator.cpp``), and what the device holds outside it.

The replay asks a model of the allocator (``sim.outputs.caching_allocator``: block rounding,
per-stream small and large pools, best fit, splitting and merging, segment sizes, release before
out-of-memory) for the step's requests.

The step measured is a steady state's (``steady_state_replay``): the second of two, which starts
with the first one's segments and with the buffers it left (a kept output) where it put them.
A buffer whose op's order of requests is known (``MemoryRecord.order``: a segment's forward, its
saved activations and transient together, and its backward) is served in that order: each tensor
requested, freed and, in backward, released from the activations it consumes where the program
does. Else a buffer the schedule knows as several tensors (``MemoryRecord.pieces``) is served
tensor by tensor, in order, and freed together.
With ``expandable_segments`` a pool grows in pages (2 MiB small, 20 MiB large) and gives back
nothing: the reserved bytes of a pool are its live bytes rounded up to whole pages.

Outside the allocator the device holds the CUDA context (``device.context_bytes``) and NCCL's
communicator buffers: per communicator, per channel, a send and a receive connection to each
ring neighbour with the buffers of the three protocols (NCCL's defaults in ``src/init.cc``:
``DEFAULT_BUFFSIZE`` 4 MiB for Simple; ``DEFAULT_LL_BUFFSIZE`` = 8 lines × 512 threads × 8 steps
× 16 B = 512 KiB; ``DEFAULT_LL128_BUFFSIZE`` = 120 elements × 640 threads × 8 steps × 8 B =
4,915,200 B; nccl#391).
"""

import math
from dataclasses import dataclass

from sim.core.events import EventTable, MemoryCategory, MemoryRecord, Stream
from sim.outputs.caching_allocator import (
    LARGE_BUFFER,
    MIB,
    SMALL_BUFFER,
    SMALL_SIZE,
    Block,
    CachingAllocator,
    round_size,
)

# NCCL's per-connection buffers (src/init.cc defaults): Simple 4 MiB, LL 512 KiB, LL128 4,915,200 B
NCCL_BUFFERS_PER_CONNECTION = 4 * MIB + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8


def _page(small: bool) -> int:
    return SMALL_BUFFER if small else LARGE_BUFFER


def tensor_sizes(rec: MemoryRecord) -> tuple[int, ...]:
    """The requests an allocation record makes of the allocator: its pieces, or itself."""
    return tuple(p for p in rec.pieces if p > 0) if rec.pieces else (rec.delta_bytes,)


# the blocks each label's tensors were served as (``serve_record``); None: a tensor released
# before its buffer is freed (``RequestOrder.releases``)
Served = dict[str, list[Block | None]]


def serve_record(allocator: CachingAllocator, rec: MemoryRecord, served: Served, *, suffix: str = "") -> None:
    """One memory record through ``allocator``: an allocation as its tensors (``tensor_sizes``),
    in order, each its own request, or as its order of requests (``MemoryRecord.order``), which
    also places its partner's tensors (the partner's own allocation is then not served again); a
    free as the release of all the tensors its label was served as (``served``: label -> their
    blocks, kept by the caller across records). ``suffix``: added to the labels it is served under."""
    name = rec.label + suffix
    if rec.delta_bytes <= 0:
        release(allocator, served, name)
    elif rec.order is not None:
        _serve_order(allocator, rec, served, suffix)
    elif name not in served:  # else placed by its partner's order
        served[name] = [allocator.take(nbytes, rec.stream) for nbytes in tensor_sizes(rec)]


def _serve_order(allocator: CachingAllocator, rec: MemoryRecord, served: Served, suffix: str) -> None:
    """``rec.order``'s requests, frees and releases in turn; what is still live at its end goes to
    the record's label where kept (or where there is no partner), else to the partner's."""
    order = rec.order
    assert order is not None
    blocks: list[Block | None] = []
    releases = iter(order.releases)
    release_next = next(releases, None)
    for e, event in enumerate((*order.events, None)):
        while release_next is not None and release_next[0] == e:  # a consumed tensor, released
            consumed = served[order.consumed + suffix]
            block, consumed[release_next[1]] = consumed[release_next[1]], None
            assert block is not None, f"{order.consumed}: tensor {release_next[1]} released twice"
            allocator.give_back(block)
            release_next = next(releases, None)
        if event is None:
            break
        if event > 0:
            blocks.append(allocator.take(event, rec.stream))
        else:
            block = blocks[-event]
            assert block is not None, f"{rec.label}: request {-event} freed twice"
            allocator.give_back(block)
            blocks[-event] = None
    own: list[Block | None] = [
        b for b, k in zip(blocks, order.kept, strict=True) if b is not None and (k or not order.partner)
    ]
    served[rec.label + suffix] = own
    if order.partner:
        partner: list[Block | None] = [
            b for b, k in zip(blocks, order.kept, strict=True) if b is not None and not k
        ]
        served[order.partner + suffix] = partner


def release(allocator: CachingAllocator, served: Served, label: str) -> None:
    """All the blocks ``label`` was served as, given back."""
    for block in served.pop(label):
        if block is not None:
            allocator.give_back(block)


def steady_state_replay(
    allocator: CachingAllocator, records: list[MemoryRecord], served: Served, *, warm_up_steps: int = 1
) -> list[int]:
    """The allocator's reserved bytes when the step it measures starts and after each of that
    step's ``records`` (in the allocator's order): the step after ``warm_up_steps`` others.

    ``torch.cuda.max_memory_reserved()`` over a run is its steady state's: every step after the
    first starts with the segments the step before reserved and its buffers where that step's
    requests put them (a kept output's tensors scattered through the holes of that step, not one
    block). So the step is replayed more than once. The first is a first step: its carried
    buffers (``MemoryRecord.carried``, what a previous step would have left) do not exist. In each
    later one, a resident buffer still live is not allocated again, the carried buffers are what
    the step before left live beyond the residents (released where the carried ones are freed;
    at its start if nothing stands for them), and the step's own buffers are served apart from
    the earlier steps'. One warm-up step is the default: a second changes no peak of the
    published memory rows (``tests/test_allocator.py``) nor of any library scenario whose reserved
    fits its device (measured 2026-12-04; past the device, the segments given back at its limit
    move it). ``served`` may hold buffers placed before (they stay)."""
    before = set(served)
    resident = {rec.label for rec in records if rec.resident}
    carried = {rec.label for rec in records if rec.carried}  # their frees name them by label
    stands_for_left = any(rec.label in carried and rec.delta_bytes < 0 for rec in records)

    left: list[str] = []  # what the step before left live beyond the residents
    for step in range(warm_up_steps + 1):
        first = step == 0  # a first step: nothing carried
        if not first:
            left = [label for label in served if label not in before and label not in resident]
            if not stands_for_left:  # nothing stands for them: the step would otherwise grow without end
                for label in left:
                    release(allocator, served, label)
                left = []
        reserved = [allocator.reserved]
        for rec in records:
            if rec.label in carried:
                if rec.delta_bytes < 0:  # the step before's leftovers go where its carried buffer does
                    for label in left:
                        release(allocator, served, label)
                    left = []
            elif not (rec.resident and rec.delta_bytes > 0 and rec.label in served):
                own = first or rec.label in resident
                serve_record(allocator, rec, served, suffix="" if own else f"@{step}")
            reserved.append(allocator.reserved)
    return reserved


def expandable_steps(records: list[MemoryRecord]) -> list[int]:
    """Reserved bytes after each record with ``expandable_segments``: each pool's live bytes rounded
    up to its pages, never given back."""
    held: dict[str, list[tuple[tuple[Stream, bool], int]]] = {}
    live: dict[tuple[Stream, bool], int] = {}
    reserved: dict[tuple[Stream, bool], int] = {}
    out = []
    for rec in records:
        if rec.delta_bytes > 0:
            changes = [((rec.stream, round_size(n) <= SMALL_SIZE), round_size(n)) for n in tensor_sizes(rec)]
            held[rec.label] = changes
        else:
            changes = [(key, -size) for key, size in held.pop(rec.label)]
        for key, size in changes:
            live[key] = live.get(key, 0) + size
            page = _page(key[1])
            reserved[key] = max(reserved.get(key, 0), page * math.ceil(live[key] / page))
        out.append(sum(reserved.values()))
    return out


@dataclass(frozen=True, kw_only=True)
class ReservedCurve:
    """The caching allocator's reserved bytes on one rank after every allocation and free."""

    times_s: tuple[float, ...]  # the allocator's (the host's) times
    reserved_bytes: tuple[int, ...]
    active_bytes: tuple[int, ...] = ()  # its active bytes at the same points (``active_steps``)

    def peak_bytes(self) -> int:
        return max(self.reserved_bytes, default=0)

    def peak_active_bytes(self) -> int:
        return max(self.active_bytes, default=0)


def allocator_order(records: list[MemoryRecord]) -> list[MemoryRecord]:
    """Memory records in the order the caching allocator sees them (``MemoryRecord.allocator_s``,
    ``sim.core.host_clock``); at one time, in the device's order."""
    return sorted(records, key=lambda rec: rec.allocator_s)


def active_steps(records: list[MemoryRecord]) -> list[int]:
    """The caching allocator's active bytes after each of ``records`` (in the allocator's order,
    ``allocator_order``; ``torch.cuda.memory_stats()``'s ``active_bytes`` less the 512 B rounding):
    its live blocks, those freed while another stream still uses them (``record_stream``) held until
    it passes."""
    live, out = 0, []
    for rec in records:
        live += rec.delta_bytes
        out.append(live)
    return out


def peak_active_bytes(table: EventTable, rank: int, *, workspace_bytes: int = 0) -> int:
    """The caching allocator's peak active bytes on ``rank`` (``active_bytes.all.peak``), with the
    cuBLAS workspaces of ``workspace_bytes`` each (``workspace_records``)."""
    records = [*workspace_records(rank, workspace_bytes), *allocator_order(table.memory_of(rank))]
    return max(active_steps(records), default=0)


# The cuBLAS workspaces a training step holds. ATen gives each (cuBLAS handle, stream) that runs a
# cuBLAS kernel a workspace from the caching allocator, never freed (pytorch/pytorch@26a39059
# aten/src/ATen/cuda/CublasHandlePool.cpp, setWorkspaceForHandle), and a handle is per thread (a
# thread-local PoolWindow of the handle pool): the calling thread runs the forward's matmuls, the
# autograd engine's device thread the backward's ("the backward pass runs on device-specific
# worker threads", torch.autograd.grad_mode.set_multithreading_enabled), both on the compute
# stream: two workspaces.
CUBLAS_WORKSPACE_THREADS = ("forward", "backward")


def workspace_records(rank: int, workspace_bytes: int) -> list[MemoryRecord]:
    """The cuBLAS workspaces (``CUBLAS_WORKSPACE_THREADS``) as the allocations the replays serve
    first (none for 0 bytes): they outlive every step, so a steady-state step starts with both."""
    if not workspace_bytes:
        return []
    return [
        MemoryRecord(
            rank=rank,
            time_s=0.0,
            category=MemoryCategory.OTHER,
            delta_bytes=workspace_bytes,
            label=f"cublas_workspace:{thread}",
        )
        for thread in CUBLAS_WORKSPACE_THREADS
    ]


def reserved_curve(
    table: EventTable, rank: int, capacity_bytes: int, *, expandable: bool = False, workspace_bytes: int = 0
) -> ReservedCurve:
    """The caching allocator replayed over ``rank``'s allocations in the order it sees them, the
    cuBLAS workspaces first (``workspace_records``), in the steady state (``steady_state_replay``:
    the step after a first one)."""
    workspace = workspace_records(rank, workspace_bytes)
    step = allocator_order(list(table.memory_of(rank)))
    records = [*workspace, *step]
    times = tuple(r.allocator_s for r in records)
    active = tuple(active_steps(records))  # the workspace records are the first of them
    if expandable:
        return ReservedCurve(
            times_s=times, reserved_bytes=tuple(expandable_steps(records)), active_bytes=active
        )
    allocator = CachingAllocator(capacity_bytes)
    served: Served = {}
    before_step: list[int] = []  # after each workspace but the last: its point is the step's start
    for rec in workspace:
        serve_record(allocator, rec, served)
        before_step.append(allocator.reserved)
    reserved = steady_state_replay(allocator, step, served)  # the step's start, then each record
    reserved = [*before_step[:-1], *reserved] if workspace else reserved[1:]
    return ReservedCurve(times_s=times, reserved_bytes=tuple(reserved), active_bytes=active)


def peak_reserved_bytes(
    table: EventTable, rank: int, capacity_bytes: int, *, expandable: bool = False, workspace_bytes: int = 0
) -> int:
    """The caching allocator's peak reserved bytes on ``rank`` (``reserved_curve``'s highest)."""
    curve = reserved_curve(
        table, rank, capacity_bytes, expandable=expandable, workspace_bytes=workspace_bytes
    )
    return curve.peak_bytes()


def nccl_buffer_bytes(channels: int, ring_peers: int = 2) -> int:
    """NCCL's buffers of communicators running ``channels`` channels in all (``sim.costs.nccl``'s
    ``runtime_channels`` each): per channel a connection to each ring neighbour, each with the
    three protocols' buffers."""
    return channels * ring_peers * NCCL_BUFFERS_PER_CONNECTION
