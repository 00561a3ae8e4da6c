"""The event table: the single record of a simulated step that every output reads.

Report, plotly timeline and Chrome trace are all computed from an ``EventTable``.
Times are seconds from the start of the step; sizes are bytes.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Protocol, TypeVar


class Stream(StrEnum):
    """Per-rank execution lanes, as CUDA streams in FSDP2 (``_fsdp_param_group.FSDPCommContext``)."""

    COMPUTE = "compute"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"  # expert parallelism's token dispatch and combine
    HOST = "host"  # the CPU thread that issues the kernels (runs ahead of the device)
    H2D = "h2d"  # host-to-device copies over PCIe (offload: parameters and states coming in)
    D2H = "d2h"  # device-to-host copies over PCIe (offload: gradients going out)
    NVME = "nvme"  # NVMe reads and writes (ZeRO-Infinity's swapped partitions)


class OpKind(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"
    COPY = "copy"  # FSDP2 all-gather copy-out / reduce-scatter copy-in on the compute stream
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"  # expert parallelism: tokens to the ranks holding their experts and back
    HOST = "host"  # host work that issues kernels: eager dispatch, FSDP2's hooks
    OFFLOAD = "offload"  # a transfer between device, host and NVMe memory (CPU/NVMe offload)

    @property
    def is_collective(self) -> bool:
        return self in _COLLECTIVE_KINDS


_COLLECTIVE_KINDS = frozenset(
    {OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE, OpKind.ALL_TO_ALL}
)


class MemoryCategory(StrEnum):
    PARAMS = "params"
    GRADS = "grads"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    COMM_BUFFERS = "comm_buffers"
    OTHER = "other"


@dataclass(frozen=True, slots=True, kw_only=True)
class OpRecord:
    """One op executed on one rank.

    ``ready_s`` is when this rank could have started it (its stream was free and its
    dependencies done); for a collective, ``start_s - ready_s`` is the wait for the slowest rank.
    ``bytes`` is the collective's nccl-tests size (0 for compute); ``group_size`` is 1 for compute.
    """

    rank: int
    op_id: int
    stream: Stream
    kind: OpKind
    name: str
    unit: str
    microbatch: int
    ready_s: float
    start_s: float
    end_s: float
    bytes: int = 0
    group_size: int = 1
    algorithm: str = ""
    protocol: str = ""
    channels: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOrder:
    """The order in which the op that allocates a buffer makes and frees its tensors, where known:
    the buffer's own and, made beside them, those of ``partner`` (a segment's saved activations
    and its transient), as the caching allocator is asked for them. ``events``: n > 0 a request of
    n bytes, n <= 0 the free of request number -n (requests numbered from 0 in order). The
    requests still live after the last event are the buffer's own where ``kept`` says so (freed
    with it), else the partner's; with no partner (``""``) all are the buffer's own. A backward's
    order may also release tensors of the activations it consumes (``consumed``, a buffer served
    in order) before they are freed as a whole: ``releases``, (e, p) before event number e (after
    the last where e is their count), that buffer's tensor at position p of those its order kept.
    The allocated-memory curve sees only the buffers' bytes."""

    events: tuple[int, ...]
    kept: tuple[bool, ...]  # per request
    partner: str = ""
    consumed: str = ""
    releases: tuple[tuple[int, int], ...] = ()  # e ascending


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryRecord:
    """One allocation (``delta_bytes`` > 0) or free (< 0) of a labelled buffer on one rank, at the
    device's time (``time_s``: what the kernels hold as they run); an allocation names the stream
    it was made on (the caching allocator keeps a pool per stream)."""

    rank: int
    time_s: float
    category: MemoryCategory
    delta_bytes: int
    label: str
    stream: Stream = Stream.COMPUTE
    pieces: tuple[int, ...] = ()  # an allocation's tensors (``sim.core.program.Alloc.pieces``)
    order: RequestOrder | None = None  # how they are made and freed (``sim.core.program.Alloc.order``)
    # an allocation live before the step starts (``Program.initial``); ``carried``: one standing
    # for what the previous step left live (``sim.core.program.Alloc.carried``)
    resident: bool = False
    carried: bool = False
    # when the caching allocator sees it, in the host's order (``sim.core.host_clock``); None where
    # the host is the device and its time is ``time_s``
    host_s: float | None = None

    def seen_at(self, host_s: float) -> "MemoryRecord":
        """This record as the caching allocator sees it at ``host_s`` (``dataclasses.replace``,
        spelled out: the engine makes one per allocation and free of every simulated step)."""
        return MemoryRecord(
            rank=self.rank,
            time_s=self.time_s,
            category=self.category,
            delta_bytes=self.delta_bytes,
            label=self.label,
            stream=self.stream,
            pieces=self.pieces,
            order=self.order,
            host_s=host_s,
            resident=self.resident,
            carried=self.carried,
        )

    @property
    def allocator_s(self) -> float:
        return self.time_s if self.host_s is None else self.host_s


class _Ranked(Protocol):
    @property
    def rank(self) -> int: ...


R = TypeVar("R", bound=_Ranked)


def group_by_rank(records: Iterable[R]) -> dict[int, list[R]]:
    """Records grouped by their (simulated) rank, each group in table order."""
    groups: dict[int, list[R]] = {}
    for rec in records:
        groups.setdefault(rec.rank, []).append(rec)
    return groups


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSummary:
    """One rank's figures, as ``sim.outputs`` computes them from its records (seconds, bytes)."""

    step_time_s: float
    peak_memory_bytes: int
    compute_s: float
    exposed_comm_s: float
    idle_s: float


@dataclass(frozen=True, kw_only=True)
class EventTable:
    """Everything the engine recorded for one step, in the order it happened.

    When every rank is identical the engine simulates only rank 0 (``simulated_ranks == (0,)``)
    and ``rank_of`` maps every rank of the job to the simulated rank whose records stand for it.
    The vectorised engine keeps the records of a few ranks only and ``rank_summaries`` of all.
    """

    world_size: int
    simulated_ranks: tuple[int, ...]
    ops: tuple[OpRecord, ...] = ()
    memory: tuple[MemoryRecord, ...] = ()
    rank_summaries: Mapping[int, RankSummary] = field(default_factory=dict)

    @cached_property
    def _simulated(self) -> frozenset[int]:
        return frozenset(self.simulated_ranks)

    def rank_of(self, rank: int) -> int:
        return rank if rank in self._simulated else self.simulated_ranks[0]

    @cached_property
    def ops_by_rank(self) -> dict[int, list[OpRecord]]:
        """Each simulated rank's ops, in table order (grouped once)."""
        return group_by_rank(self.ops)

    @cached_property
    def memory_by_rank(self) -> dict[int, list[MemoryRecord]]:
        """Each simulated rank's memory records, in table order (grouped once)."""
        return group_by_rank(self.memory)

    def ops_of(self, rank: int) -> list[OpRecord]:
        """The ops that stand for job rank ``rank``."""
        return self.ops_by_rank.get(self.rank_of(rank), [])

    def memory_of(self, rank: int) -> list[MemoryRecord]:
        """The memory records that stand for job rank ``rank``."""
        return self.memory_by_rank.get(self.rank_of(rank), [])
