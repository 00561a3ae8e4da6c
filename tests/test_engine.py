"""The engine on hand-written programs: exact times for streams, rendezvous and interference."""

from dataclasses import replace

import pytest

from sim.core.engine import Variability, run_program
from sim.core.events import MemoryCategory, OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind, Topology

TWO_RANKS = Topology(world_size=2, gpus_per_node=2, shard_size=2)


def _program() -> Program:
    p = Program()
    p.emit(
        stream=Stream.COMPUTE,
        kind=OpKind.FORWARD,
        name="f",
        unit="u",
        microbatch=0,
        duration_s=10.0,
        allocs=(Alloc(label="act", category=MemoryCategory.ACTIVATIONS, bytes=8),),
    )
    p.emit(
        stream=Stream.ALL_GATHER,
        kind=OpKind.ALL_GATHER,
        name="ag",
        unit="u",
        microbatch=0,
        duration_s=4.0,
        group=GroupKind.SHARD,
        bytes=100,
    )
    p.emit(
        stream=Stream.COMPUTE,
        kind=OpKind.BACKWARD,
        name="b",
        unit="u",
        microbatch=0,
        duration_s=1.0,
        deps=(1,),
        frees=("act",),
    )
    return p


def _times(table, rank=0):
    return {o.name: (o.start_s, o.end_s) for o in table.ops_of(rank)}


def test_streams_overlap_and_deps_wait():
    t = _times(run_program(_program(), TWO_RANKS, Variability(), serial=False))
    assert t == {"f": (0.0, 10.0), "ag": (0.0, 4.0), "b": (10.0, 11.0)}


def test_serial_backend_runs_in_issue_order():
    t = _times(run_program(_program(), TWO_RANKS, Variability(), serial=True))
    assert t == {"f": (0.0, 10.0), "ag": (10.0, 14.0), "b": (14.0, 15.0)}


def test_compute_slows_down_only_while_a_collective_runs():
    # 4 s at half speed do 2 s of work; the other 8 s run at full speed: 12 s
    t = _times(run_program(_program(), TWO_RANKS, Variability(), serial=False, interference=2.0))
    assert t["f"] == (0.0, pytest.approx(12.0))
    assert t["ag"] == (0.0, 4.0)
    # a serial backend never overlaps, so the factor cannot apply
    serial = _times(run_program(_program(), TWO_RANKS, Variability(), serial=True, interference=2.0))
    assert serial["f"] == (0.0, 10.0)


def test_collective_waits_for_the_slowest_rank():
    slow = Variability(slow_rank=1, slow_rank_factor=2.0)
    p = Program()
    p.emit(stream=Stream.COMPUTE, kind=OpKind.FORWARD, name="f", unit="u", microbatch=0, duration_s=3.0)
    p.emit(
        stream=Stream.ALL_GATHER,
        kind=OpKind.ALL_GATHER,
        name="ag",
        unit="u",
        microbatch=0,
        duration_s=1.0,
        deps=(0,),
        group=GroupKind.SHARD,
        bytes=1,
    )
    table = run_program(p, TWO_RANKS, slow, serial=False)
    for rank in (0, 1):
        ag = next(o for o in table.ops_of(rank) if o.name == "ag")
        assert (ag.start_s, ag.end_s) == (6.0, 7.0)  # rank 1 arrives at 6
    assert next(o for o in table.ops_of(0) if o.name == "ag").ready_s == 3.0
    assert next(o for o in table.ops_of(1) if o.name == "ag").ready_s == 6.0


def test_ledger_records_allocs_at_start_and_frees_at_end():
    table = run_program(_program(), TWO_RANKS, Variability(), serial=False)
    assert [(m.time_s, m.delta_bytes, m.label) for m in table.memory_of(0)] == [
        (0.0, 8, "act"),
        (11.0, -8, "act"),
    ]


def test_an_allocation_names_the_stream_of_the_op_that_makes_it():
    """The caching allocator serves each stream from its own pools: the reserved-memory replay
    needs every allocation's stream (the all-gather's output is not the compute stream's)."""
    p = _program()
    p.ops[1] = replace(p.ops[1], allocs=(Alloc(label="out", category=MemoryCategory.COMM_BUFFERS, bytes=4),))
    for serial in (False, True):
        table = run_program(p, TWO_RANKS, Variability(), serial=serial)
        allocs = {m.label: m.stream for m in table.memory_of(0) if m.delta_bytes > 0}
        assert allocs == {"act": Stream.COMPUTE, "out": Stream.ALL_GATHER}


def test_freeing_an_unknown_buffer_is_a_bug_not_a_silent_no_op():
    p = Program()
    p.emit(
        stream=Stream.COMPUTE,
        kind=OpKind.FORWARD,
        name="f",
        unit="u",
        microbatch=0,
        duration_s=1.0,
        frees=("never-allocated",),
    )
    with pytest.raises(RuntimeError, match="never-allocated"):
        run_program(p, TWO_RANKS, Variability(), serial=False)


def test_an_op_the_host_issues_asynchronously_overlaps_even_on_a_serial_backend():
    """DDP's reducer launches its bucket all-reduces without blocking the host: on gloo they run
    beside the backward pass, unlike FSDP2's blocking collectives."""
    p = Program()
    p.emit(stream=Stream.COMPUTE, kind=OpKind.BACKWARD, name="b", unit="u", microbatch=0, duration_s=10.0)
    p.emit(
        stream=Stream.ALL_REDUCE,
        kind=OpKind.ALL_REDUCE,
        name="ar",
        unit="u",
        microbatch=0,
        duration_s=4.0,
        group=GroupKind.SHARD,
        bytes=1,
        host_async=True,
    )
    p.emit(
        stream=Stream.COMPUTE, kind=OpKind.COPY, name="c", unit="u", microbatch=0, duration_s=1.0, deps=(1,)
    )
    t = _times(run_program(p, TWO_RANKS, Variability(), serial=True))
    assert t == {"b": (0.0, 10.0), "ar": (0.0, 4.0), "c": (10.0, 11.0)}


def test_start_frees_release_before_the_op_allocates():
    """FSDP2 drops the previous reduce-scatter input before allocating the next one: both never
    count at once."""
    p = Program()
    p.emit(
        stream=Stream.COMPUTE,
        kind=OpKind.COPY,
        name="a",
        unit="u",
        microbatch=0,
        duration_s=1.0,
        allocs=(Alloc(label="old", category=MemoryCategory.COMM_BUFFERS, bytes=100),),
    )
    p.emit(
        stream=Stream.COMPUTE,
        kind=OpKind.COPY,
        name="b",
        unit="u",
        microbatch=0,
        duration_s=1.0,
        start_frees=("old",),
        allocs=(Alloc(label="new", category=MemoryCategory.COMM_BUFFERS, bytes=100),),
    )
    table = run_program(p, TWO_RANKS, Variability(), serial=False)
    live = peak = 0
    for m in table.memory_of(0):
        live += m.delta_bytes
        peak = max(peak, live)
    assert peak == 100
    assert [(m.time_s, m.delta_bytes, m.label) for m in table.memory_of(0)] == [
        (0.0, 100, "old"),
        (1.0, -100, "old"),
        (1.0, 100, "new"),
    ]


def test_schedule_never_holds_two_reduce_scatter_inputs_of_consecutive_units():
    from simtest import make_scenario

    from sim.simulate import simulate

    r = simulate(make_scenario(model={"preset": "tiny", "n_layers": 4}, parallel={"world_size": 2}))
    live = best = 0
    for m in r.events.memory_of(0):
        if m.label.startswith("reduce_scatter_input"):
            live += 1 if m.delta_bytes > 0 else -1
            best = max(best, live)
    assert best == 1
