"""What the engine executes: one rank's ops in host issue order, with memory actions.

The engine knows nothing about FSDP; ``sim.fsdp_schedule`` and ``sim.ddp_schedule`` write
programs. Every rank runs the same program; only its process groups differ.
"""

from dataclasses import dataclass, field

from sim.events import MemoryCategory, OpKind, Stream
from sim.topology import GroupKind


@dataclass(frozen=True, slots=True)
class Alloc:
    label: str
    category: MemoryCategory
    bytes: int


@dataclass(slots=True)
class ProgramOp:
    """One op. It starts when its stream has finished the previous op and its ``deps`` are done;
    a collective also waits until every rank of its group has reached it. ``allocs`` happen when
    it becomes ready (after ``start_frees``: buffers the host drops before issuing it), ``frees``
    when it ends (stream-ordered reuse in the caching allocator), then
    ``end_allocs``: what the op leaves behind (the gradients a backward op produces) once its own
    temporaries are gone."""

    op_id: int
    stream: Stream
    kind: OpKind
    name: str
    unit: str
    microbatch: int
    duration_s: float
    deps: tuple[int, ...] = ()
    allocs: tuple[Alloc, ...] = ()
    frees: tuple[str, ...] = ()
    end_allocs: tuple[Alloc, ...] = ()
    start_frees: tuple[str, ...] = ()
    group: GroupKind | None = None  # set for collectives
    bytes: int = 0  # nccl-tests size of a collective
    # issued asynchronously by the host (DDP's reducer): it overlaps the host's work even on a
    # backend whose blocking collectives serialise everything else (gloo)
    host_async: bool = False


@dataclass
class Program:
    ops: list[ProgramOp] = field(default_factory=list)
    initial: list[Alloc] = field(default_factory=list)  # resident before the step starts

    def emit(
        self,
        stream: Stream,
        kind: OpKind,
        name: str,
        unit: str,
        microbatch: int,
        duration_s: float,
        *,
        deps: tuple[int, ...] = (),
        allocs: tuple[Alloc, ...] = (),
        frees: tuple[str, ...] = (),
        end_allocs: tuple[Alloc, ...] = (),
        start_frees: tuple[str, ...] = (),
        group: GroupKind | None = None,
        bytes: int = 0,
        host_async: bool = False,
    ) -> int:
        op = ProgramOp(
            len(self.ops),
            stream,
            kind,
            name,
            unit,
            microbatch,
            duration_s,
            deps,
            allocs,
            frees,
            end_allocs,
            start_frees,
            group,
            bytes,
            host_async,
        )
        self.ops.append(op)
        return op.op_id

    def add_frees(self, op_id: int, *labels: str) -> None:
        self.ops[op_id].frees += labels
