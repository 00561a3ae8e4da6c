"""Reserved memory: the step's allocations replayed through a model of PyTorch's CUDA caching
allocator (``c10/cuda/CUDACachingAllocator.cpp``), and what the device holds outside it.

The replay follows the allocator's rules:
- a request is rounded up to a multiple of 512 B (``round_size``, ``kMinBlockSize``);
- requests of at most 1 MiB come from the small pool, larger ones from the large pool, one pair
  of pools per stream (a block freed by one stream is reused by that stream only);
- a request takes the best-fitting free block of its pool (``get_free_block``) and splits it when
  the rest is worth keeping (``should_split``: at least 512 B in the small pool, more than 1 MiB in
  the large one); freed blocks merge with free neighbours of their segment;
- failing that it reserves a new segment (``get_allocation_size``): 2 MiB for a small request,
  20 MiB for a request under 10 MiB, else the request rounded up to 2 MiB;
- reserving past the device's memory first releases every fully free cached segment
  (``release_cached_blocks``), as the allocator does before raising out-of-memory.
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

import bisect
import math
from dataclasses import dataclass, field

from sim.core.events import EventTable, MemoryCategory, MemoryRecord, Stream

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
MIB = 1 << 20
# NCCL's per-connection buffers (src/init.cc defaults): Simple 4 MiB, LL 512 KiB, LL128 4,915,200 B
NCCL_BUFFERS_PER_CONNECTION = 4 * MIB + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, MIN_BLOCK * math.ceil(nbytes / MIN_BLOCK))


def allocation_size(nbytes: int) -> int:
    """The segment reserved for a request that no cached block fits (``get_allocation_size``)."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(nbytes / ROUND_LARGE)


@dataclass(eq=False, slots=True)
class Block:
    """A block of a segment, linked to its neighbours by address (as the allocator's ``Block``)."""

    segment: int
    offset: int
    size: int
    free: bool = True
    prev: "Block | None" = None
    next: "Block | None" = None


@dataclass
class _Pool:
    """One (stream, small|large) pool: free blocks sorted by size for best fit (ties by address:
    segment, then offset), and each free block by its place."""

    free: list[tuple[int, int, int]] = field(default_factory=list)  # (size, segment, offset)
    blocks: dict[tuple[int, int], Block] = field(default_factory=dict)  # (segment, offset) -> block

    def take(self, nbytes: int) -> Block | None:
        i = bisect.bisect_left(self.free, (nbytes, -1, -1))
        if i == len(self.free):
            return None
        _, seg, offset = self.free.pop(i)
        return self.blocks.pop((seg, offset))

    def put(self, block: Block) -> None:
        bisect.insort(self.free, (block.size, block.segment, block.offset))
        self.blocks[(block.segment, block.offset)] = block

    def remove(self, block: Block) -> None:
        key = (block.size, block.segment, block.offset)
        del self.free[bisect.bisect_left(self.free, key)]
        del self.blocks[(block.segment, block.offset)]


class CachingAllocator:
    """A replay of the caching allocator's segments and blocks; sizes in bytes."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.pools: dict[tuple[Stream, bool], _Pool] = {}
        self.segments: dict[int, Block] = {}  # segment id -> its first block
        self.segment_pool: dict[int, tuple[Stream, bool]] = {}
        self.live: dict[str, Block] = {}
        self.reserved = 0
        self.peak_reserved = 0
        self._next_segment = 0

    def _pool(self, key: tuple[Stream, bool]) -> _Pool:
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = _Pool()
        return pool

    def malloc(self, label: str, nbytes: int, stream: Stream) -> None:
        self.live[label] = self.take(nbytes, stream)

    def take(self, nbytes: int, stream: Stream) -> Block:
        """The block one request of ``nbytes`` on ``stream`` is served (``free`` or ``give_back`` it)."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        key = (stream, small)
        pool = self._pool(key)
        block = pool.take(size)
        if block is None:
            block = self._new_segment(key, allocation_size(size))
        rest = block.size - size
        if rest >= (MIN_BLOCK if small else SMALL_SIZE + 1):
            tail = Block(
                segment=block.segment, offset=block.offset + size, size=rest, prev=block, next=block.next
            )
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            pool.put(tail)
        block.free = False
        return block

    def _new_segment(self, key: tuple[Stream, bool], size: int) -> Block:
        if self.reserved + size > self.capacity:
            self.release_free_segments()
        seg = self._next_segment
        self._next_segment += 1
        block = self.segments[seg] = Block(segment=seg, offset=0, size=size)
        self.segment_pool[seg] = key
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def release_free_segments(self) -> None:
        """Give back every fully free cached segment (``release_cached_blocks``, ``empty_cache()``)."""
        for seg, head in list(self.segments.items()):
            if head.free and head.next is None:
                self._pool(self.segment_pool.pop(seg)).remove(head)
                self.reserved -= head.size
                del self.segments[seg]

    def free(self, label: str) -> None:
        self.give_back(self.live.pop(label))

    def give_back(self, block: Block) -> None:
        """A block ``take`` served, freed: merged with its free neighbours, back in its pool."""
        pool = self._pool(self.segment_pool[block.segment])
        block.free = True
        if block.next is not None and block.next.free:  # merge with the free neighbour after it
            pool.remove(block.next)
            _absorb(block, block.next)
        if block.prev is not None and block.prev.free:  # and into the free neighbour before it
            pool.remove(block.prev)
            block = _absorb(block.prev, block)
        pool.put(block)


def _absorb(left: Block, right: Block) -> Block:
    """``right`` merged into ``left``, its neighbour before it in their segment."""
    left.size += right.size
    left.next = right.next
    if right.next is not None:
        right.next.prev = left
    return left


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


def active_steps(records: list[MemoryRecord], workspace_bytes: int = 0) -> list[int]:
    """The caching allocator's active bytes after each of ``records`` (in the allocator's order,
    ``allocator_order``; ``torch.cuda.memory_stats()``'s ``active_bytes`` less the 512 B rounding):
    its live blocks, those freed while another stream still uses them (``record_stream``) held until
    it passes, and the cuBLAS workspace."""
    live, out = workspace_bytes, []
    for rec in records:
        live += rec.delta_bytes
        out.append(live)
    return out


def peak_active_bytes(table: EventTable, rank: int, *, workspace_bytes: int = 0) -> int:
    """The caching allocator's peak active bytes on ``rank`` (``active_bytes.all.peak``)."""
    steps = active_steps(allocator_order(table.memory_of(rank)), workspace_bytes)
    return max(steps, default=workspace_bytes)


def workspace_records(rank: int, workspace_bytes: int) -> list[MemoryRecord]:
    """The cuBLAS workspace as the allocation the replays serve first (none for 0 bytes)."""
    if not workspace_bytes:
        return []
    return [
        MemoryRecord(
            rank=rank,
            time_s=0.0,
            category=MemoryCategory.OTHER,
            delta_bytes=workspace_bytes,
            label="cublas_workspace",
        )
    ]


def reserved_curve(
    table: EventTable, rank: int, capacity_bytes: int, *, expandable: bool = False, workspace_bytes: int = 0
) -> ReservedCurve:
    """The caching allocator replayed over ``rank``'s allocations in the order it sees them, the
    cuBLAS workspace first (it is allocated through the allocator, once per stream that runs
    matmuls: the compute stream), in the steady state (``steady_state_replay``: the step after a
    first one)."""
    workspace = workspace_records(rank, workspace_bytes)
    step = allocator_order(list(table.memory_of(rank)))
    records = [*workspace, *step]
    times = tuple(r.allocator_s for r in records)
    active = tuple(active_steps(records))  # the workspace record is the first of them
    if expandable:
        return ReservedCurve(
            times_s=times, reserved_bytes=tuple(expandable_steps(records)), active_bytes=active
        )
    allocator = CachingAllocator(capacity_bytes)
    served: Served = {}
    for rec in workspace:
        serve_record(allocator, rec, served)
    reserved = steady_state_replay(allocator, step, served)
    if not workspace:  # the workspace's point is the measured step's start
        reserved = reserved[1:]
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
