"""When the caching allocator hears of each allocation and free: in the host's order.

The engine times every op on the device's streams, and its memory records carry the device's
time (what the kernels hold as they run). The CUDA caching allocator serves requests when the
host makes them, and the host runs ahead of the device (``Stream.HOST``): it allocates a buffer
when it issues the op that makes it, and drops one when it issues the op that last uses it (or,
for a free a later host action declares, ``Program.host_drops``, at that action), however far
behind the device is. Reuse of a dropped block is safe in stream order: the allocator hands it
out again only to work issued later on its stream. A block used on another stream
(``Alloc.record_stream``: FSDP1's unsharded flat parameters and flat gradients, DeepSpeed
ZeRO-3's parameters gathered one by one and, with ``overlap_comm``, the gradients its bucket copy
reads) comes back only once that stream has passed the free, as the events
``insert_events`` records make it wait: at the later of the host's drop and the device's time.
So the allocator's active bytes can exceed what the device's kernels hold at any one time: the
blocks the host has dropped and the recording stream has not yet reached (llama-recipes' 70B
FSDP1 run: 17 GiB, ``validation.published_memory``).

On a host that is the device (gloo on CPUs: ``serial``) the host issues each op as it runs it,
and the allocator's times are the device's.
"""

from collections.abc import Callable
from dataclasses import dataclass

from sim.core.events import Stream
from sim.core.program import Program

EndOf = Callable[[int], float]  # an op's end on the device, by op id, on one rank


@dataclass(frozen=True, kw_only=True)
class HostClock:
    """Per op, the host op the host had last run when it issued it; and the program's
    ``record_stream`` buffers and host-declared frees."""

    issued_after: tuple[int, ...]  # -1: issued before any host op, at the start of the step
    deferred: frozenset[str]  # labels of record_stream buffers
    host_drops: dict[str, int]

    @staticmethod
    def of(program: Program) -> "HostClock":
        issued_after, last = [], -1
        for op in program.ops:
            issued_after.append(last)
            if op.stream is Stream.HOST:
                last = op.op_id
        deferred = {a.label for a in program.initial if a.record_stream}
        for op in program.ops:
            deferred |= {a.label for a in (*op.allocs, *op.end_allocs) if a.record_stream}
        return HostClock(
            issued_after=tuple(issued_after),
            deferred=frozenset(deferred),
            host_drops=dict(program.host_drops),
        )

    def issue_s(self, op_id: int, end_of: EndOf) -> float:
        """When the host issued op ``op_id``: as the host op before it ended (0 before any)."""
        host = self.issued_after[op_id]
        return end_of(host) if host >= 0 else 0.0

    def allocator_s(
        self, *, op_id: int, label: str, delta_bytes: int, device_s: float, end_of: EndOf
    ) -> float:
        """When the caching allocator sees one memory record of op ``op_id`` (-1: resident before
        the step) that the device sees at ``device_s``."""
        if op_id < 0:
            return 0.0
        if delta_bytes > 0:
            return self.issue_s(op_id, end_of)
        if label in self.host_drops:
            host = self.host_drops[label]
            dropped = end_of(host) if host >= 0 else 0.0
        else:
            dropped = self.issue_s(op_id, end_of)
        return max(dropped, device_s) if label in self.deferred else dropped
