"""The SimPy engine: K ranks, each with FIFO streams, rendezvous collectives and a memory ledger.

It runs a ``Program`` (one per rank, identical up to process groups) and records every op and
every allocation in an ``EventTable``. It knows ranks, streams, groups and memory, not FSDP.

When every rank would behave identically (no jitter, no slow rank) it simulates rank 0 alone:
each collective then starts as soon as rank 0 reaches it, which is exactly when all ranks do.
"""

from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass

import numpy as np
import simpy

from sim.core import vector_engine
from sim.core.events import EventTable, MemoryCategory, MemoryRecord, OpKind, OpRecord, Stream
from sim.core.host_clock import HostClock
from sim.core.links import Flow, SharedLinks
from sim.core.program import Alloc, Program, ProgramOp
from sim.core.topology import GroupKind, Topology

COMPUTE_KINDS = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.RECOMPUTE, OpKind.OPTIMIZER})
GroupLinks = Callable[[GroupKind, int], tuple[Hashable, ...]]
# (duration, wire fraction) of a collective on ``rank``'s group where groups of a kind differ
GroupCost = Callable[[ProgramOp, int], tuple[float, float]]


@dataclass(frozen=True, kw_only=True)
class Variability:
    """Per-rank differences: seeded compute jitter and one slow rank."""

    seed: int = 0
    compute_jitter: float = 0.0
    slow_rank: int | None = None
    slow_rank_factor: float = 1.0
    links_identical: bool = True  # False: groups of one kind cross links of different speeds

    @property
    def ranks_identical(self) -> bool:
        same_compute = self.compute_jitter == 0 and (self.slow_rank is None or self.slow_rank_factor == 1.0)
        return same_compute and self.links_identical

    def compute_multipliers(self, world_size: int, n_ops: int) -> np.ndarray:
        """Factor on each op's duration per rank; one generator per run, drawn in rank order."""
        factors = np.ones((world_size, n_ops))
        if self.compute_jitter > 0:
            rng = np.random.default_rng(self.seed)
            factors *= np.clip(rng.normal(1.0, self.compute_jitter, size=(world_size, n_ops)), 0.05, None)
        if self.slow_rank is not None:
            factors[self.slow_rank] *= self.slow_rank_factor
        return factors


class _Rendezvous:
    """Collectives in flight, keyed by (group, n-th collective on that group).

    ``on_change(ranks, +1 | -1)`` is told when a collective starts and ends on its ranks.
    """

    def __init__(self, env: simpy.Environment, on_change: Callable[[list[int], int], None]):
        self.env, self.on_change = env, on_change
        self.pending: dict[tuple[object, int], tuple[simpy.Event, list[int]]] = {}
        self.links = SharedLinks(env)

    def arrive(
        self, key: tuple[object, int], rank: int, n_members: int, duration_s: float, flow: Flow
    ) -> simpy.Event:
        """Rank ``rank`` reached the collective ``key``; it runs once all ``n_members`` have, as
        ``flow`` on the links its group crosses."""
        done, arrived = self.pending.setdefault(key, (self.env.event(), []))
        arrived.append(rank)
        if len(arrived) == n_members:
            del self.pending[key]
            self.env.process(self._run(done, arrived, duration_s, flow))
        return done

    def _run(
        self, done: simpy.Event, ranks: list[int], duration_s: float, flow: Flow
    ) -> Generator[simpy.Event, object, None]:
        start = self.env.now
        self.on_change(ranks, +1)
        if flow.share > 0:
            yield from self.links.transfer(duration_s, flow.share, flow.links, flow.key)
        else:
            yield self.env.timeout(duration_s)
        self.on_change(ranks, -1)
        done.succeed(start)


class Engine:
    def __init__(
        self,
        program: Program,
        topology: Topology,
        variability: Variability,
        *,
        serial: bool,
        interference: float = 1.0,
        group_links: GroupLinks | None = None,
        group_cost: GroupCost | None = None,
    ):
        """``interference``: how much slower compute runs while a collective runs on the same rank
        (NCCL kernels take SMs; gloo threads take cores), from the profile's calibration.
        ``group_links``: the links a rank's group of a kind crosses (default: the topology's
        per-node links). ``group_cost``: a collective's duration and wire fraction on a given rank's
        group, where groups of a kind cross links of different speeds (default: the program's)."""
        self.program, self.topology, self.serial = program, topology, serial
        self.group_links: GroupLinks = group_links or topology.links
        self.group_cost = group_cost
        self.interference = 1.0 if serial else interference
        k = topology.world_size
        self.ranks = [0] if variability.ranks_identical else list(range(k))
        compute = np.array([op.kind in COMPUTE_KINDS for op in program.ops])
        factors = (
            variability.compute_multipliers(k, len(program.ops)) if not variability.ranks_identical else None
        )
        self.duration: Callable[[int, ProgramOp], float] = (
            (lambda r, op: op.duration_s * (factors[r, op.op_id] if compute[op.op_id] else 1.0))
            if factors is not None
            else (lambda r, op: op.duration_s)
        )
        self.env = simpy.Environment()
        self.rendezvous = _Rendezvous(self.env, self._comm_changed)
        self.active_comm = dict.fromkeys(self.ranks, 0)
        self.computing: dict[int, simpy.Process] = {}  # rank -> process inside a compute op
        self.ops: list[OpRecord] = []
        self.memory: list[MemoryRecord] = []
        self.memory_op: list[int] = []  # the op that made each memory record (-1: resident)
        self.done = {r: [self.env.event() for _ in program.ops] for r in self.ranks}
        self.live: dict[int, dict[str, tuple[MemoryCategory, int]]] = {r: {} for r in self.ranks}
        self.group_seq: dict[int, dict[object, int]] = {r: {} for r in self.ranks}
        self.groups: dict[tuple[GroupKind, int], tuple[tuple[str, int], int, int]] = {}

    def run(self) -> EventTable:
        for rank in self.ranks:
            for alloc in self.program.initial:
                self._alloc(rank, alloc, Stream.COMPUTE, -1)
            for ops in self._queues():
                self.env.process(self._stream(rank, ops))
        self.env.run()
        return EventTable(
            world_size=self.topology.world_size,
            simulated_ranks=tuple(self.ranks),
            ops=tuple(self.ops),
            memory=tuple(self._memory_in_host_time()),
        )

    def _memory_in_host_time(self) -> list[MemoryRecord]:
        """The memory records with the time the caching allocator sees each (``host_s``); where the
        host is the device (``serial``) that is the device's time, left as it is."""
        if self.serial:
            return self.memory
        clock = HostClock.of(self.program)
        ends = {r: [0.0] * len(self.program.ops) for r in self.ranks}
        for op in self.ops:
            ends[op.rank][op.op_id] = op.end_s
        return [
            rec.seen_at(
                clock.allocator_s(
                    op_id=op_id,
                    label=rec.label,
                    delta_bytes=rec.delta_bytes,
                    device_s=rec.time_s,
                    end_of=ends[rec.rank].__getitem__,
                )
            )
            for rec, op_id in zip(self.memory, self.memory_op, strict=True)
        ]

    def _queues(self) -> list[list[ProgramOp]]:
        """Ops per stream in issue order. On a serial backend everything the host waits for shares
        one queue; only ops the host issues asynchronously keep their own streams."""
        queues: dict[Stream | None, list[ProgramOp]] = {}
        for op in self.program.ops:
            queues.setdefault(None if self.serial and not op.host_async else op.stream, []).append(op)
        return list(queues.values())

    def _stream(self, rank: int, ops: list[ProgramOp]) -> Generator[simpy.Event, object, None]:
        done = self.done[rank]
        for op in ops:
            waiting = [done[d] for d in op.deps if not done[d].processed]
            if len(waiting) == 1:
                yield waiting[0]
            elif waiting:
                yield self.env.all_of(waiting)
            ready = self.env.now
            for label in op.start_frees:
                self._free(rank, label, op.op_id)
            for alloc in op.allocs:
                self._alloc(rank, alloc, op.stream, op.op_id)
            duration = self.duration(rank, op)
            if op.group is not None:
                gid, simulated_members, group_size = self._group(op.group, rank)
                seq = self.group_seq[rank].get(gid, 0)
                self.group_seq[rank][gid] = seq + 1
                share = op.wire_fraction
                if self.group_cost is not None:
                    duration, share = self.group_cost(op, rank)
                flow = Flow(share=share, links=self.group_links(op.group, rank), key=gid)
                arrived = yield self.rendezvous.arrive((gid, seq), rank, simulated_members, duration, flow)
                start = float(arrived)  # type: ignore[arg-type]
            else:
                start = float(ready)
                if self.interference != 1.0 and op.stream is Stream.COMPUTE:
                    yield from self._slowed_compute(rank, duration)
                else:
                    yield self.env.timeout(duration)
                group_size = 1
            for label in op.frees:
                self._free(rank, label, op.op_id)
            for alloc in op.end_allocs:
                self._alloc(rank, alloc, op.stream, op.op_id)
            for label in op.late_frees:
                self._free(rank, label, op.op_id)
            self.ops.append(
                OpRecord(
                    rank=rank,
                    op_id=op.op_id,
                    stream=op.stream,
                    kind=op.kind,
                    name=op.name,
                    unit=op.unit,
                    microbatch=op.microbatch,
                    ready_s=ready,
                    start_s=start,
                    end_s=self.env.now,
                    bytes=op.bytes,
                    group_size=group_size,
                    algorithm=op.algorithm,
                    protocol=op.protocol,
                    channels=op.channels,
                )
            )
            done[op.op_id].succeed()

    def _group(self, kind: GroupKind, rank: int) -> tuple[tuple[str, int], int, int]:
        """(group id, members that are simulated, group size) of ``rank``'s group of ``kind``."""
        key = (kind, rank)
        if key not in self.groups:
            members = self.topology.members(kind, rank)
            simulated = sum(1 for m in members if m in self.done)
            self.groups[key] = (self.topology.group_id(kind, rank), simulated, len(members))
        return self.groups[key]

    def _slowed_compute(self, rank: int, work_s: float) -> Generator[simpy.Event, object, None]:
        """Run ``work_s`` seconds of isolated compute, slower while a collective runs on this rank."""
        process = self.env.active_process
        assert process is not None
        while work_s > 1e-15:
            rate = 1.0 / self.interference if self.active_comm[rank] else 1.0
            started = self.env.now
            self.computing[rank] = process
            try:
                yield self.env.timeout(work_s / rate)
                work_s = 0.0
            except simpy.Interrupt:
                work_s -= (self.env.now - started) * rate
            finally:
                self.computing.pop(rank, None)

    def _comm_changed(self, ranks: list[int], delta: int) -> None:
        for rank in ranks:
            self.active_comm[rank] += delta
            process = self.computing.get(rank)
            if process is not None and process.is_alive:
                process.interrupt()  # its rate changes: it recomputes its remaining time

    def _alloc(self, rank: int, alloc: Alloc, stream: Stream, op_id: int) -> None:
        label, category, nbytes = alloc.label, alloc.category, alloc.bytes
        if label in self.live[rank]:
            raise RuntimeError(f"buffer {label!r} allocated twice on rank {rank}")
        self.live[rank][label] = (category, nbytes)
        if nbytes > 0:
            self.memory_op.append(op_id)
            self.memory.append(
                MemoryRecord(
                    rank=rank,
                    time_s=self.env.now,
                    category=category,
                    delta_bytes=nbytes,
                    label=label,
                    stream=stream,
                    pieces=alloc.pieces,
                    order=alloc.order,
                    resident=op_id == -1,
                    carried=alloc.carried,
                )
            )

    def _free(self, rank: int, label: str, op_id: int) -> None:
        if label not in self.live[rank]:
            raise RuntimeError(f"buffer {label!r} freed on rank {rank} but not allocated")
        category, nbytes = self.live[rank].pop(label)
        if nbytes > 0:
            self.memory_op.append(op_id)
            self.memory.append(
                MemoryRecord(
                    rank=rank, time_s=self.env.now, category=category, delta_bytes=-nbytes, label=label
                )
            )


def run_program(
    program: Program,
    topology: Topology,
    variability: Variability,
    *,
    serial: bool,
    interference: float = 1.0,
    group_links: GroupLinks | None = None,
    group_cost: GroupCost | None = None,
    vectorised: bool = False,
) -> EventTable:
    """Simulate one step and return its event table. ``vectorised``: where ranks differ and every
    collective is the world's, evaluate all ranks at once (``sim.core.vector_engine``)."""
    if vectorised and not variability.ranks_identical and vector_engine.supports(program, topology):
        k = topology.world_size
        return vector_engine.run_vectorized(
            program,
            topology,
            variability.compute_multipliers(k, len(program.ops)),
            serial=serial,
            interference=interference,
            group_links=group_links or topology.links,
            group_cost=group_cost,
        )
    return Engine(
        program,
        topology,
        variability,
        serial=serial,
        interference=interference,
        group_links=group_links,
        group_cost=group_cost,
    ).run()
