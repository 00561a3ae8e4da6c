"""What the engine executes: one rank's ops in host issue order, with memory actions.

The engine knows nothing about FSDP; ``sim.schedule`` writes programs. Every rank runs the same
program; only its process groups differ.
"""

from dataclasses import dataclass, field, replace

from sim.core.events import MemoryCategory, OpKind, RequestOrder, Stream
from sim.core.topology import GroupKind


@dataclass(frozen=True, slots=True, kw_only=True)
class Alloc:
    """One labelled buffer. ``pieces``: the tensors it stands for, in the order the program
    allocates them, where known (they sum to ``bytes``); empty: one tensor. The allocated-memory
    curve sees only ``bytes``; the caching allocator's replay serves each piece as its own
    request, as the real program's tensor-by-tensor allocations are served."""

    label: str
    category: MemoryCategory
    bytes: int
    pieces: tuple[int, ...] = ()
    # used on another stream than the one that allocates it, announced by ``Tensor.record_stream``
    # (FSDP1's unsharded flat parameters and flat gradients): the caching allocator takes the block
    # back only once the recording stream has passed the free (``insert_events``), however early
    # the host drops it; without it a block is reusable, in stream order, once the host drops it
    record_stream: bool = False
    # an initial buffer that stands for what the previous step left live (``training.keep_outputs``'
    # held output): the caching allocator's steady-state replay (``sim.outputs.allocator``) puts in
    # its place the buffers the step before left, wherever that step's requests put them
    carried: bool = False
    # the order of the op's requests, this buffer's tensors and a partner's interleaved as the
    # program makes and frees them (``RequestOrder``), where known; the caching allocator's replay
    # then serves that order in place of ``pieces`` (and of the partner's)
    order: RequestOrder | None = None

    def __post_init__(self) -> None:
        if self.pieces and sum(self.pieces) != self.bytes:
            raise ValueError(f"buffer {self.label!r}: pieces sum to {sum(self.pieces)}, not {self.bytes}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgramOp:
    """One op. It starts when its stream has finished the previous op and its ``deps`` are done;
    a collective also waits until every rank of its group has reached it. ``allocs`` happen when
    it becomes ready (after ``start_frees``: buffers the host drops before issuing it), ``frees``
    when it ends (stream-ordered reuse in the caching allocator), then
    ``end_allocs``: what the op leaves behind (the gradients a backward op produces) once its own
    temporaries are gone, then ``late_frees``: what the host drops once those exist (FSDP2's
    ``reshard()`` after the backward that made the gradients)."""

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
    late_frees: tuple[str, ...] = ()
    group: GroupKind | None = None  # set for collectives
    bytes: int = 0  # nccl-tests size of a collective
    algorithm: str = ""  # a collective's algorithm, as its cost model chose it
    protocol: str = ""  # and its protocol (NCCL: LL, LL128, Simple)
    channels: int = 0  # NCCL channels it uses (0: not modelled)
    # the fraction of a collective's time spent moving bytes over the links its group crosses: what
    # it takes of each of them while it runs at full speed (sim.core.links); 0: no contention
    wire_fraction: float = 0.0
    # issued asynchronously by the host (DDP's reducer): it overlaps the host's work even on a
    # backend whose blocking collectives serialise everything else (gloo)
    host_async: bool = False
    launches: int = 0  # kernels the host launches for it, where the schedule counts them


@dataclass
class Program:
    """A rank's program while a schedule writes it: ops are appended with ``emit``."""

    ops: list[ProgramOp] = field(default_factory=list)
    initial: list[Alloc] = field(default_factory=list)  # resident before the step starts
    # the host's position (its latest op) when a later host action dropped a buffer that frees at
    # an op written earlier (``add_frees``): when the caching allocator hears of that free
    host_drops: dict[str, int] = field(default_factory=dict)
    last_host_op: int = -1  # the latest op on the host stream (-1: none yet)

    def emit(
        self,
        *,
        stream: Stream,
        kind: OpKind,
        name: str,
        unit: str,
        microbatch: int,
        duration_s: float,
        deps: tuple[int, ...] = (),
        allocs: tuple[Alloc, ...] = (),
        frees: tuple[str, ...] = (),
        end_allocs: tuple[Alloc, ...] = (),
        start_frees: tuple[str, ...] = (),
        group: GroupKind | None = None,
        bytes: int = 0,
        algorithm: str = "",
        protocol: str = "",
        channels: int = 0,
        wire_fraction: float = 0.0,
        host_async: bool = False,
        launches: int = 0,
    ) -> int:
        """Append one op; returns its id (its index, which ``deps`` refer to)."""
        op = ProgramOp(
            op_id=len(self.ops),
            stream=stream,
            kind=kind,
            name=name,
            unit=unit,
            microbatch=microbatch,
            duration_s=duration_s,
            deps=deps,
            allocs=allocs,
            frees=frees,
            end_allocs=end_allocs,
            start_frees=start_frees,
            group=group,
            bytes=bytes,
            algorithm=algorithm,
            protocol=protocol,
            channels=channels,
            wire_fraction=wire_fraction,
            host_async=host_async,
            launches=launches,
        )
        self.ops.append(op)
        if stream is Stream.HOST:
            self.last_host_op = op.op_id
        return op.op_id

    def add_frees(self, op_id: int, *labels: str, after_outputs: bool = False) -> None:
        """Free ``labels`` when an op already written ends: what a later host action releases once
        that op's stream has passed it (FSDP2's last reduce-scatter input, dropped in the final
        callback); ``after_outputs``: after its ``end_allocs`` (``late_frees``)."""
        op = self.ops[op_id]
        if after_outputs:
            self.ops[op_id] = replace(op, late_frees=op.late_frees + labels)
        else:
            self.ops[op_id] = replace(op, frees=op.frees + labels)
        for label in labels:
            self.host_drops[label] = self.last_host_op
