"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``): its
segments and blocks, request by request.

It follows the allocator's rules:
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
Which requests it is asked, in which order, is ``sim.outputs.allocator``'s.
"""

import bisect
import math
from dataclasses import dataclass, field

from sim.core.events import Stream

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
MIB = 1 << 20


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
