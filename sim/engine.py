"""The SimPy engine: K ranks, each with FIFO streams, rendezvous collectives and a memory ledger.

It runs a ``Program`` (one per rank, identical up to process groups) and records every op and
every allocation in an ``EventTable``. It knows ranks, streams, groups and memory, not FSDP.

When every rank would behave identically (no jitter, no slow rank) it simulates rank 0 alone:
each collective then starts as soon as rank 0 reaches it, which is exactly when all ranks do.
"""

from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import simpy

from sim.events import EventTable, MemoryCategory, MemoryRecord, OpKind, OpRecord, Stream
from sim.program import Program, ProgramOp
from sim.topology import Topology

COMPUTE_KINDS = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.RECOMPUTE, OpKind.OPTIMIZER})


@dataclass(frozen=True, kw_only=True)
class Variability:
    """Per-rank differences: seeded compute jitter and one slow rank."""

    seed: int = 0
    compute_jitter: float = 0.0
    slow_rank: int | None = None
    slow_rank_factor: float = 1.0

    @property
    def ranks_identical(self) -> bool:
        return self.compute_jitter == 0 and (self.slow_rank is None or self.slow_rank_factor == 1.0)

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
    """Collectives in flight, keyed by (group, n-th collective on that group)."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.pending: dict[tuple[object, int], tuple[simpy.Event, list[float]]] = {}

    def arrive(self, key: tuple[object, int], n_members: int, duration_s: float) -> simpy.Event:
        done, arrivals = self.pending.setdefault(key, (self.env.event(), []))
        arrivals.append(self.env.now)
        if len(arrivals) == n_members:
            del self.pending[key]
            self.env.process(self._run(done, duration_s))
        return done

    def _run(self, done: simpy.Event, duration_s: float) -> Generator[simpy.Event, object, None]:
        start = self.env.now
        yield self.env.timeout(duration_s)
        done.succeed(start)


class Engine:
    def __init__(self, program: Program, topology: Topology, variability: Variability, *, serial: bool):
        self.program, self.topology, self.serial = program, topology, serial
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
        self.rendezvous = _Rendezvous(self.env)
        self.table = EventTable(world_size=k, simulated_ranks=list(self.ranks))
        self.done = {r: [self.env.event() for _ in program.ops] for r in self.ranks}
        self.live: dict[int, dict[str, tuple[MemoryCategory, int]]] = {r: {} for r in self.ranks}
        self.group_seq: dict[int, dict[object, int]] = {r: {} for r in self.ranks}

    def run(self) -> EventTable:
        for rank in self.ranks:
            for alloc in self.program.initial:
                self._alloc(rank, alloc.label, alloc.category, alloc.bytes)
            for ops in self._queues():
                self.env.process(self._stream(rank, ops))
        self.env.run()
        return self.table

    def _queues(self) -> list[list[ProgramOp]]:
        """Ops per stream in issue order; one queue for everything when the backend is serial."""
        if self.serial:
            return [self.program.ops]
        queues: dict[Stream, list[ProgramOp]] = {}
        for op in self.program.ops:
            queues.setdefault(op.stream, []).append(op)
        return list(queues.values())

    def _stream(self, rank: int, ops: list[ProgramOp]) -> Generator[simpy.Event, object, None]:
        done = self.done[rank]
        for op in ops:
            waiting = [done[d] for d in op.deps if not done[d].processed]
            if waiting:
                yield self.env.all_of(waiting)
            ready = self.env.now
            for alloc in op.allocs:
                self._alloc(rank, alloc.label, alloc.category, alloc.bytes)
            duration = self.duration(rank, op)
            if op.group is not None:
                members = [m for m in self.topology.members(op.group, rank) if m in self.done]
                gid = self.topology.group_id(op.group, rank)
                seq = self.group_seq[rank].get(gid, 0)
                self.group_seq[rank][gid] = seq + 1
                arrived = yield self.rendezvous.arrive((gid, seq), len(members), duration)
                start = float(arrived)  # type: ignore[arg-type]
                group_size = len(self.topology.members(op.group, rank))
            else:
                start = float(ready)
                yield self.env.timeout(duration)
                group_size = 1
            for label in op.frees:
                self._free(rank, label)
            for alloc in op.end_allocs:
                self._alloc(rank, alloc.label, alloc.category, alloc.bytes)
            self.table.ops.append(
                OpRecord(
                    rank, op.op_id, op.stream, op.kind, op.name, op.unit, op.microbatch,
                    ready, start, self.env.now, op.bytes, group_size,
                )
            )  # fmt: skip
            done[op.op_id].succeed()

    def _alloc(self, rank: int, label: str, category: MemoryCategory, nbytes: int) -> None:
        if label in self.live[rank]:
            raise RuntimeError(f"buffer {label!r} allocated twice on rank {rank}")
        self.live[rank][label] = (category, nbytes)
        if nbytes > 0:
            self.table.memory.append(MemoryRecord(rank, self.env.now, category, nbytes, label))

    def _free(self, rank: int, label: str) -> None:
        if label not in self.live[rank]:
            raise RuntimeError(f"buffer {label!r} freed on rank {rank} but not allocated")
        category, nbytes = self.live[rank].pop(label)
        if nbytes > 0:
            self.table.memory.append(MemoryRecord(rank, self.env.now, category, -nbytes, label))


def run_program(
    program: Program, topology: Topology, variability: Variability, *, serial: bool
) -> EventTable:
    """Simulate one step and return its event table."""
    return Engine(program, topology, variability, serial=serial).run()
