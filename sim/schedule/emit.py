"""How a schedule puts ops into its program: host work and the host's position, the compute
stream's ops behind the launch queue, collectives in their communicator's issue order, offload
copies. ``sim.schedule.base.ScheduleBuilder`` builds the training step on it; what a schedule
emits, and in which order, is the schedule's.
"""

from collections import deque

from sim.core.events import MemoryCategory, OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind
from sim.schedule.step import StepConfig
from sim.workload.units import ROOT

# Kernels one stream's launch queue holds: launching into a stream stays asynchronous (4-5 us a
# launch) for about the first 1000 pending kernels, after which each launch waits for a kernel to
# finish; each stream has its own queue (measured, stackoverflow.com/questions/53970187 and NVIDIA
# developer forums t/68937, "CUDA stream are blocked when launch lots of kernels (>1000)"). It
# bounds how far the host runs ahead of the compute stream where nothing else stops it.
LAUNCH_QUEUE_DEPTH = 1000


class OpEmitter:
    def __init__(self, cfg: StepConfig, program: Program):
        self.cfg = cfg
        self.program = program
        self.compute_waits: list[int] = []  # ops the next compute-stream op waits for
        self.host_cursor: int | None = None  # the host's last op: nothing it issues starts before
        self.last_collective: dict[GroupKind, int] = {}  # one communicator per group: issue order
        self.compute_tail = -1  # the compute stream's last op
        # the compute ops whose kernels may still sit in the launch queue, oldest first, and their
        # kernels in all
        self.launched: deque[tuple[int, int]] = deque()
        self.launches_pending = 0
        self._counter = 0

    def label(self, what: str, unit: str, mb: int) -> str:
        """A buffer label unique within the program."""
        self._counter += 1
        return f"{what}:{unit}:mb{mb}:{self._counter}"

    def host(self, name: str, unit: str, mb: int, duration_s: float, *, deps: tuple[int, ...] = ()) -> None:
        """Host work (eager dispatch, FSDP2's hooks) on the host stream, which runs ahead of the
        device: what the host issues after it cannot start before it ends (nor it before ``deps``)."""
        if duration_s > 0:
            self.host_cursor = self.program.emit(
                stream=Stream.HOST,
                kind=OpKind.HOST,
                name=name,
                unit=unit,
                microbatch=mb,
                duration_s=duration_s,
                deps=deps,
            )

    def _launch_slot(self, launches: int) -> tuple[int, ...]:
        """The compute op the host must see finish before it can launch ``launches`` more kernels
        into the compute stream's queue (``LAUNCH_QUEUE_DEPTH``), if any."""
        wait: tuple[int, ...] = ()
        while self.launched and self.launches_pending + launches > LAUNCH_QUEUE_DEPTH:
            op, count = self.launched.popleft()
            self.launches_pending -= count
            wait = (op,)
        return wait

    def host_wait(self, name: str, op: int, mb: int) -> None:
        """The host blocks until ``op`` has run (``event.synchronize()``, a blocking copy): nothing it
        issues afterwards starts before."""
        self.host_cursor = self.program.emit(
            stream=Stream.HOST,
            kind=OpKind.HOST,
            name=name,
            unit=ROOT,
            microbatch=mb,
            duration_s=0.0,
            deps=self.issued((op,)),
        )

    def issued(self, deps: tuple[int, ...]) -> tuple[int, ...]:
        """``deps`` and the host's position: an op cannot start before the host has issued it."""
        return deps if self.host_cursor is None else (*deps, self.host_cursor)

    def compute(
        self,
        kind: OpKind,
        name: str,
        unit: str,
        mb: int,
        duration_s: float,
        *,
        deps: tuple[int, ...] = (),
        allocs: tuple[Alloc, ...] = (),
        frees: tuple[str, ...] = (),
        end_allocs: tuple[Alloc, ...] = (),
        start_frees: tuple[str, ...] = (),
        host_s: float = 0.0,
        launches: int = 0,
    ) -> int:
        """An op on the compute stream, after ``host_s`` of host dispatch launching ``launches``
        kernels (where the launch queue is full, the dispatch first waits for room); it also waits
        for whatever the host last waited on."""
        queued = host_s > 0 and launches > 0  # a host that is the device has no launch queue
        self.host(f"dispatch {name}", unit, mb, host_s, deps=self._launch_slot(launches) if queued else ())
        deps = self.issued(deps + tuple(self.compute_waits))
        self.compute_waits = []
        self.compute_tail = self.program.emit(
            stream=Stream.COMPUTE,
            kind=kind,
            name=name,
            unit=unit,
            microbatch=mb,
            duration_s=duration_s,
            deps=deps,
            allocs=allocs,
            frees=frees,
            end_allocs=end_allocs,
            start_frees=start_frees,
            launches=launches,
        )
        if queued:
            self.launched.append((self.compute_tail, launches))
            self.launches_pending += launches
        return self.compute_tail

    def collective(
        self,
        kind: OpKind,
        stream: Stream,
        unit: str,
        nbytes: int,
        group: GroupKind,
        dtype: str,
        *,
        mb: int,
        deps: tuple[int, ...],
        allocs: tuple[Alloc, ...] = (),
        frees: tuple[str, ...] = (),
        end_allocs: tuple[Alloc, ...] = (),
        extra_s: float = 0.0,
        name: str | None = None,
    ) -> int:
        """A collective on ``stream``, after the previous collective of its group; on a backend that
        stages collectives (gloo), with a temporary as large as its input or output. ``extra_s``:
        work on the same stream just before it (a cast, a copy-in), part of the op's time."""
        deps = self.issued(deps)
        if group in self.last_collective:
            deps = (*deps, self.last_collective[group])
        if self.cfg.collective_temp_buffers:
            temp = self.label(f"{kind.value}_temp", unit, mb)
            allocs = (*allocs, Alloc(label=temp, category=MemoryCategory.COMM_BUFFERS, bytes=nbytes))
            frees = (*frees, temp)
        cost = self.cfg.collective(kind.value, nbytes, group, dtype)
        op = self.program.emit(
            stream=stream,
            kind=kind,
            name=name or f"{kind.value} {unit}",
            unit=unit,
            microbatch=mb,
            duration_s=cost.time_s + extra_s,
            deps=deps,
            allocs=allocs,
            frees=frees,
            end_allocs=end_allocs,
            group=group,
            bytes=nbytes,
            algorithm=cost.algorithm,
            protocol=cost.protocol,
            channels=cost.channels,
            wire_fraction=cost.wire_fraction,
        )
        self.last_collective[group] = op
        return op

    def transfer(
        self,
        stream: Stream,
        name: str,
        unit: str,
        mb: int,
        nbytes: int,
        duration_s: float,
        *,
        deps: tuple[int, ...] = (),
        allocs: tuple[Alloc, ...] = (),
        frees: tuple[str, ...] = (),
    ) -> int:
        """An offload copy (PCIe or NVMe) of ``nbytes`` on its own stream."""
        return self.program.emit(
            stream=stream,
            kind=OpKind.OFFLOAD,
            name=name,
            unit=unit,
            microbatch=mb,
            duration_s=duration_s,
            deps=self.issued(deps),
            allocs=allocs,
            frees=frees,
            bytes=nbytes,
        )

    def host_optimizer(self, name: str, mb: int, duration_s: float, deps: tuple[int, ...]) -> int:
        """The optimizer stepping on the host CPU (offload): the host is busy, issuing nothing."""
        self.host_cursor = self.program.emit(
            stream=Stream.HOST,
            kind=OpKind.OPTIMIZER,
            name=name,
            unit=ROOT,
            microbatch=mb,
            duration_s=duration_s,
            deps=self.issued(deps),
        )
        return self.host_cursor
