"""The caching-allocator replay (sim.outputs.allocator): exact reserved bytes for hand-made request
sequences, following CUDACachingAllocator.cpp's rules, and its place in the report."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.events import Stream
from sim.outputs.allocator import NCCL_BUFFERS_PER_CONNECTION, nccl_buffer_bytes
from sim.outputs.caching_allocator import MIB, CachingAllocator, allocation_size, round_size
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.simulate import simulate

SEVEN_B = str(Path(__file__).resolve().parent.parent / "scenarios" / "llama2-7b-8xh100-zero3.toml")
BIG = 1 << 40
C = Stream.COMPUTE


def test_rounding_and_segment_sizes_are_the_allocators() -> None:
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert allocation_size(100) == 2 * MIB  # small pool: 2 MiB segments
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB  # 1-10 MiB: a 20 MiB block
    assert allocation_size(10 * MIB) == 10 * MIB  # large: rounded to 2 MiB
    assert allocation_size(15 * MIB) == 16 * MIB


def test_small_requests_share_a_2_mib_segment() -> None:
    a = CachingAllocator(BIG)
    for i in range(4):
        a.malloc(f"s{i}", 100_000, C)
    assert a.reserved == 2 * MIB  # 4 x 100,352 B fit in one small segment


def test_a_freed_block_is_reused_and_neighbours_merge() -> None:
    a = CachingAllocator(BIG)
    a.malloc("x", 12 * MIB, C)
    a.malloc("y", 12 * MIB, C)
    assert a.reserved == 24 * MIB
    a.free("x")
    a.malloc("z", 6 * MIB, C)  # best fit: the freed 12 MiB block, split (6 MiB left > 1 MiB)
    assert a.reserved == 24 * MIB
    a.free("z")
    a.malloc("w", 12 * MIB, C)  # the split halves merged back into 12 MiB
    assert a.reserved == 24 * MIB


def test_streams_do_not_share_cached_blocks() -> None:
    a = CachingAllocator(BIG)
    a.malloc("ag", 12 * MIB, Stream.ALL_GATHER)
    a.free("ag")
    a.malloc("c", 12 * MIB, C)  # the all-gather stream's cached block is not the compute stream's
    assert a.reserved == 24 * MIB
    assert a.peak_reserved == 24 * MIB


def test_free_segments_are_released_before_the_device_is_exceeded() -> None:
    a = CachingAllocator(40 * MIB)
    a.malloc("x", 30 * MIB, C)
    a.free("x")
    a.malloc("y", 32 * MIB, C)  # 30 + 32 > 40: the free 30 MiB segment goes back first
    assert a.reserved == 32 * MIB and a.peak_reserved == 32 * MIB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40 * MIB), st.booleans()), min_size=1, max_size=40))
def test_reserved_covers_what_is_live(requests: list[tuple[int, bool]]) -> None:
    """Invariant: reserved never drops below the rounded live bytes, and never goes negative."""
    a = CachingAllocator(BIG)
    live: dict[str, int] = {}
    for i, (size, free_one) in enumerate(requests):
        a.malloc(f"b{i}", size, C)
        live[f"b{i}"] = round_size(size)
        if free_one and live:
            label = next(iter(live))
            a.free(label)
            del live[label]
        assert a.reserved >= sum(live.values()) >= 0
        assert a.peak_reserved >= a.reserved


def test_nccl_buffers_follow_the_protocol_defaults() -> None:
    assert NCCL_BUFFERS_PER_CONNECTION == 4 * MIB + 512 * 1024 + 4_915_200
    assert nccl_buffer_bytes(48) == 48 * 2 * NCCL_BUFFERS_PER_CONNECTION  # e.g. two communicators of 24


@pytest.mark.parametrize("sets", [[], ["cluster.expandable_segments=true"]], ids=["cached", "expandable"])
def test_the_report_judges_fit_on_what_the_device_needs(sets: list[str]) -> None:
    r = build_report(simulate(load_scenario(SEVEN_B, sets)))
    assert r.peak_reserved_bytes >= r.peak_memory_bytes
    assert r.required_bytes == r.peak_reserved_bytes + r.device_overhead_bytes
    assert r.fits is (r.required_bytes <= r.device_memory_bytes)
    assert r.to_json()["memory_headroom_bytes"] == r.device_memory_bytes - r.required_bytes


def test_expandable_segments_reserve_less_than_fixed_segments() -> None:
    cached, expandable = (
        build_report(simulate(load_scenario(SEVEN_B, s))) for s in ([], ["cluster.expandable_segments=true"])
    )
    assert expandable.peak_memory_bytes == cached.peak_memory_bytes
    assert expandable.peak_reserved_bytes < cached.peak_reserved_bytes


def test_reserved_curve_covers_the_allocated_bytes_at_every_record():
    """After every allocation and free the reserved bytes hold at least the live bytes (rounded
    blocks live in reserved segments), its highest point is ``peak_reserved_bytes``, and with
    ``expandable_segments`` it never goes down."""
    from sim.outputs.allocator import peak_reserved_bytes, reserved_curve
    from sim.scenario.loader import load_scenario
    from sim.simulate import simulate

    result = simulate(load_scenario(Path(__file__).resolve().parent.parent / "scenarios" / "tiny.toml"))
    table, capacity = result.events, 80 << 30
    curve = reserved_curve(table, 0, capacity)
    live = 0
    records = list(table.memory_of(0))
    assert len(curve.reserved_bytes) == len(records)
    for rec, reserved in zip(records, curve.reserved_bytes, strict=True):
        live += rec.delta_bytes
        assert reserved >= live >= 0
    assert curve.peak_bytes() == peak_reserved_bytes(table, 0, capacity)
    grown = reserved_curve(table, 0, capacity, expandable=True).reserved_bytes
    assert all(b >= a for a, b in zip(grown, grown[1:], strict=False))


def test_the_two_cublas_workspaces_are_held_from_the_steps_start():
    """The forward's thread and the autograd engine's device thread each hold a cuBLAS workspace
    (one per handle and stream; handles are per thread): Hopper's 32 MiB ones take a segment each,
    and the active and reserved curves start with both, one point per record."""
    from sim.outputs.allocator import CUBLAS_WORKSPACE_THREADS, peak_active_bytes, reserved_curve
    from sim.scenario.loader import load_scenario
    from sim.simulate import simulate

    result = simulate(load_scenario(Path(__file__).resolve().parent.parent / "scenarios" / "tiny.toml"))
    table, capacity, workspace = result.events, 80 << 30, 32 * MIB
    assert len(CUBLAS_WORKSPACE_THREADS) == 2
    bare = reserved_curve(table, 0, capacity)
    curve = reserved_curve(table, 0, capacity, workspace_bytes=workspace)
    records = len(table.memory_of(0))
    assert len(curve.times_s) == len(curve.reserved_bytes) == len(curve.active_bytes) == records + 2
    assert curve.active_bytes[:2] == (workspace, 2 * workspace)
    assert curve.reserved_bytes[0] == workspace  # the first in a segment of its own (>= 10 MiB)
    assert curve.peak_active_bytes() == bare.peak_active_bytes() + 2 * workspace
    assert curve.peak_active_bytes() == peak_active_bytes(table, 0, workspace_bytes=workspace)
    assert curve.peak_bytes() == bare.peak_bytes() + 2 * workspace  # neither fits a hole of the step


def _table(*records: tuple[int, str, tuple[int, ...]]):  # type: ignore[no-untyped-def]
    from sim.core.events import EventTable, MemoryCategory, MemoryRecord

    memory = tuple(
        MemoryRecord(
            rank=0, time_s=float(i), category=MemoryCategory.ACTIVATIONS, delta_bytes=d, label=label, pieces=p
        )
        for i, (d, label, p) in enumerate(records)
    )
    return EventTable(world_size=1, simulated_ranks=(0,), ops=(), memory=memory)


def test_a_buffer_of_several_tensors_is_served_tensor_by_tensor() -> None:
    """A 24 MiB buffer freed leaves a 24 MiB hole; the same bytes as two 12 MiB tensors fill two
    freed 12 MiB blocks of other segments, where one 24 MiB request needs a segment of its own."""
    from sim.outputs.allocator import peak_reserved_bytes

    holes = [
        (12 * MIB, "a", ()),
        (12 * MIB, "b", ()),
        (12 * MIB, "keep", ()),
        (-12 * MIB, "a", ()),
        (-12 * MIB, "b", ()),
    ]
    # each 12 MiB request gets a segment of its own: a and b freed leave two 12 MiB holes
    lumped = _table(*holes, (24 * MIB, "acts", ()))
    pieces = _table(*holes, (24 * MIB, "acts", (12 * MIB, 12 * MIB)))
    assert peak_reserved_bytes(lumped, 0, BIG) == 36 * MIB + 24 * MIB
    assert peak_reserved_bytes(pieces, 0, BIG) == 36 * MIB
    # freed together, the pieces' blocks are free again: a later 12 MiB request reserves nothing
    after = _table(
        *holes, (24 * MIB, "acts", (12 * MIB, 12 * MIB)), (-24 * MIB, "acts", ()), (12 * MIB, "c", ())
    )
    assert peak_reserved_bytes(after, 0, BIG) == 36 * MIB
    # with expandable segments each piece takes its own pool: two 600 KiB tensors fit one 2 MiB
    # page of the small pool, where one 1,200 KiB request is the large pool's (20 MiB pages)
    small = _table((1200 * 1024, "x", (600 * 1024, 600 * 1024)))
    whole = _table((1200 * 1024, "x", ()))
    assert peak_reserved_bytes(small, 0, BIG, expandable=True) == 2 * MIB
    assert peak_reserved_bytes(whole, 0, BIG, expandable=True) == 20 * MIB


def test_pieces_must_sum_to_the_buffer() -> None:
    from sim.core.events import MemoryCategory
    from sim.core.program import Alloc

    Alloc(label="ok", category=MemoryCategory.OTHER, bytes=10, pieces=(4, 6))
    with pytest.raises(ValueError, match="pieces sum to 9"):
        Alloc(label="bad", category=MemoryCategory.OTHER, bytes=10, pieces=(4, 5))


def _step(*records: tuple[int, str], resident: tuple[str, ...] = (), carried: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """A one-rank step's records, in order; ``resident``: labels live when it starts (their
    allocations first), ``carried`` those of them standing for what the step before left."""
    from sim.core.events import EventTable, MemoryCategory, MemoryRecord

    memory = tuple(
        MemoryRecord(
            rank=0,
            time_s=float(i),
            category=MemoryCategory.ACTIVATIONS,
            delta_bytes=d,
            label=label,
            resident=d > 0 and label in resident,
            carried=d > 0 and label in carried,
        )
        for i, (d, label) in enumerate(records)
    )
    return EventTable(world_size=1, simulated_ranks=(0,), ops=(), memory=memory)


# a step that keeps its 64 MiB output ("out") and frees the one the step before kept ("prev")
# between two 1 GiB transients; the parameters (100 MiB) resident throughout
KEPT_OUTPUT_STEP = (
    (100 * MIB, "param"),
    (64 * MIB, "prev"),
    (1024 * MIB, "t1"),
    (-1024 * MIB, "t1"),
    (64 * MIB, "out"),
    (-64 * MIB, "prev"),
    (1024 * MIB, "t2"),
    (-1024 * MIB, "t2"),
)


def test_the_steady_state_finds_the_kept_output_where_the_step_before_left_it() -> None:
    """Replayed once with the held output as one block at the start, the step reserves 100 (the
    parameters) + 64 (prev) + 1,024 (t1, whose freed segment ``out`` then splits) + 1,024 (t2,
    which no longer fits the 960 MiB left) MiB. In the steady state the first step has no prev:
    its ``out`` splits t1's segment and t2 takes a segment of its own (2,148 MiB). The measured
    step's t1 takes t2's segment, its ``out`` the 960 MiB rest of t1's; the first step's ``out``,
    freed where prev is, leaves t2 the segment t1 used: nothing more is reserved."""
    from sim.outputs.allocator import peak_reserved_bytes

    carried = _step(*KEPT_OUTPUT_STEP, resident=("param", "prev"), carried=("prev",))
    assert peak_reserved_bytes(carried, 0, BIG) == 2148 * MIB
    # the same records with prev an ordinary resident: the measured step allocates it again
    # beside the first one's out, which nothing frees and is let go when the measured step starts
    plain = _step(*KEPT_OUTPUT_STEP, resident=("param", "prev"))
    assert peak_reserved_bytes(plain, 0, BIG) == 2212 * MIB


def test_the_steady_state_step_allocates_each_resident_once_and_its_own_buffers_anew() -> None:
    """The measured step starts from the first one's segments: a step that frees everything it
    makes reserves in the second exactly what it reserved in the first, residents not doubled."""
    from sim.outputs.allocator import Served, steady_state_replay
    from sim.outputs.caching_allocator import CachingAllocator

    step = _step(
        (100 * MIB, "param"),
        (30 * MIB, "a"),
        (50 * MIB, "b"),
        (-30 * MIB, "a"),
        (-50 * MIB, "b"),
        resident=("param",),
    )
    allocator = CachingAllocator(BIG)
    served: Served = {}
    reserved = steady_state_replay(allocator, list(step.memory_of(0)), served)
    assert reserved == [180 * MIB] * 6  # the first step's three segments, reused: the start and 5 records
    assert set(served) == {"param"} and len(served["param"]) == 1

    def used(block):  # type: ignore[no-untyped-def]
        while block is not None:
            yield from () if block.free else (block.size,)
            block = block.next

    assert [size for head in allocator.segments.values() for size in used(head)] == [100 * MIB]


class _ReferenceAllocator:
    """The allocator's rules transcribed as plainly as possible (every free block scanned for the
    best fit, each segment a list of [offset, size, free] by address), to check the replay's
    linked blocks and sorted pools against."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.reserved = capacity, 0
        self.segments: dict[int, tuple[tuple[Stream, bool], list[list[int]]]] = {}
        self.where: dict[str, tuple[int, list[int]]] = {}
        self.next_id = 0

    def malloc(self, label: str, nbytes: int, stream: Stream) -> None:
        size = round_size(nbytes)
        small = size <= 1 * MIB
        fits = [
            (b[1], seg, b[0], b)
            for seg, (key, blocks) in self.segments.items()
            if key == (stream, small)
            for b in blocks
            if b[2] and b[1] >= size
        ]
        if fits:
            _, seg, _, block = min(fits, key=lambda f: f[:3])
        else:
            want = allocation_size(size)
            if self.reserved + want > self.capacity:
                for s, (_, blocks) in list(self.segments.items()):
                    if len(blocks) == 1 and blocks[0][2]:
                        self.reserved -= blocks[0][1]
                        del self.segments[s]
            seg, self.next_id = self.next_id, self.next_id + 1
            block = [0, want, 1]
            self.segments[seg] = ((stream, small), [block])
            self.reserved += want
        blocks = self.segments[seg][1]
        rest = block[1] - size
        if rest >= (512 if small else MIB + 1):
            blocks.insert(blocks.index(block) + 1, [block[0] + size, rest, 1])
            block[1] = size
        block[2] = 0
        self.where[label] = (seg, block)

    def free(self, label: str) -> None:
        seg, block = self.where.pop(label)
        blocks = self.segments[seg][1]
        block[2] = 1
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1][2]:
            block[1] += blocks.pop(i + 1)[1]
        if i > 0 and blocks[i - 1][2]:
            blocks[i - 1][1] += blocks.pop(i)[1]


SIZES = st.one_of(
    st.integers(1, 1 * MIB), st.integers(1 * MIB + 1, 12 * MIB), st.integers(12 * MIB, 90 * MIB)
)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(SIZES, st.booleans(), st.integers(0, 3), st.sampled_from([C, Stream.ALL_GATHER])),
        max_size=60,
    )
)
def test_the_replay_serves_every_request_where_the_plain_rules_do(
    requests: list[tuple[int, bool, int, Stream]],
) -> None:
    """Against ``_ReferenceAllocator``, request by request: the same block (segment and offset)
    for every allocation and the same reserved bytes, segments given back under a 200 MiB device
    included."""
    fast, plain = CachingAllocator(200 * MIB), _ReferenceAllocator(200 * MIB)
    live: list[str] = []
    for i, (size, free_some, which, stream) in enumerate(requests):
        label = f"b{i}"
        fast.malloc(label, size, stream)
        plain.malloc(label, size, stream)
        live.append(label)
        seg, block = plain.where[label]
        assert (fast.live[label].segment, fast.live[label].offset) == (seg, block[0])
        if free_some and live:
            gone = live.pop(which % len(live))
            fast.free(gone)
            plain.free(gone)
        assert fast.reserved == plain.reserved


def _replayed(result, warm_up_steps: int):  # type: ignore[no-untyped-def]
    from sim.outputs.allocator import allocator_order, steady_state_replay
    from sim.outputs.caching_allocator import CachingAllocator

    device = result.profile.device
    allocator = CachingAllocator(device.memory_bytes - device.context_bytes)
    records = allocator_order(list(result.events.memory_of(0)))
    return max(steady_state_replay(allocator, records, {}, warm_up_steps=warm_up_steps)), allocator


def _peak_after(result, warm_up_steps: int) -> int:  # type: ignore[no-untyped-def]
    return _replayed(result, warm_up_steps)[0]


@pytest.mark.parametrize("row", [0, 1])
def test_one_warm_up_step_reaches_the_steady_state(row: int) -> None:
    """The published memory rows (llama-cookbook PR #41, Llama-2-7B LoRA on A100-40GB): a second
    warm-up step changes no reserved byte; with the output kept through backward the first step,
    which holds no earlier output, reserves three 2 GiB segments less than the steady state (its
    kept tensors scattered by then), as the real sequence's second step adds three (the PR's code
    logged by ``validation.allocator_replay``, measured 2026-12-04); without it the same."""
    from sim.scenario.loader import scenario_from_dict
    from validation.published_memory import MEMORY_RUNS

    run = MEMORY_RUNS[row]
    result = simulate(scenario_from_dict(run.tables, run.name, []))
    first, steady, later = (_peak_after(result, n) for n in (0, 1, 2))
    assert later == steady
    assert steady - first == (3 * (2 << 30) if row == 1 else 0)


@pytest.mark.parametrize(("row", "segments_2gib", "segments_1gib"), [(0, 5, 2), (1, 9, 2)])
def test_the_simulated_sequence_reserves_the_real_sequences_large_segments(
    row: int, segments_2gib: int, segments_1gib: int
) -> None:
    """Served in its ops' own order (forward and backward), the simulated step of each published
    LoRA row reserves the large segments the real sequence does: the PR's code (transformers 4.31,
    PEFT 0.4, FSDP1) logged and replayed through the same allocator model
    (``python -m validation.allocator_replay --memory-row N --site DIR``) took five 2 GiB and two
    1 GiB segments in the first row, nine and two with the output kept, and none larger (counted
    2026-12-04; served a segment at a time, as the tensors alive at its peak, the simulated step
    took one of 2.12 GiB more in the first row, and six of 2 GiB in the second)."""
    from sim.scenario.loader import scenario_from_dict
    from validation.published_memory import MEMORY_RUNS

    run = MEMORY_RUNS[row]
    result = simulate(scenario_from_dict(run.tables, run.name, []))
    _, allocator = _replayed(result, 1)
    sizes = []
    for head in allocator.segments.values():
        size, block = 0, head
        while block is not None:
            size, block = size + block.size, block.next
        sizes.append(size)
    large = sorted(n for n in sizes if n >= 1 << 30)
    assert large == [1 << 30] * segments_1gib + [2 << 30] * segments_2gib
