"""A real run's step as an event table, so a timeline can stack it under the prediction.

On a backend whose collectives block the host (gloo on a CPU) the host's clock sees the whole
step: each collective is timed around the ``torch.distributed`` call FSDP2/DDP make, and the rest
of each phase (forward, backward, optimizer) is compute and FSDP's own work. On a GPU the host
runs ahead of the device, so this timeline would show launch times: it is recorded on CPU only.
"""

from sim.core.events import EventTable, OpKind, OpRecord, Stream
from sim.outputs.intervals import difference

STREAMS = {
    "all_gather": Stream.ALL_GATHER,
    "reduce_scatter": Stream.REDUCE_SCATTER,
    "all_reduce": Stream.ALL_REDUCE,
}


def timeline_table(
    phases: list[tuple[str, float, float]], collectives: list[tuple[str, float, float, int]], world_size: int
) -> EventTable:
    """Rank 0's measured step: collectives on their streams, the rest of each phase as compute."""
    origin = min(start for _, start, _ in phases)
    ops: list[OpRecord] = []
    spans = [(s - origin, e - origin) for _, s, e, _ in collectives]
    for i, (kind, start, end, nbytes) in enumerate(collectives):
        ops.append(
            OpRecord(
                rank=0,
                op_id=i,
                stream=STREAMS[kind],
                kind=OpKind(kind),
                name=f"{kind} (measured)",
                unit="",
                microbatch=0,
                ready_s=start - origin,
                start_s=start - origin,
                end_s=end - origin,
                bytes=nbytes,
                group_size=world_size,
            )
        )
    for name, start, end in phases:
        for a, b in difference([(start - origin, end - origin)], spans):
            ops.append(
                OpRecord(
                    rank=0,
                    op_id=len(ops),
                    stream=Stream.COMPUTE,
                    kind=OpKind(name),
                    name=f"{name} (measured)",
                    unit="",
                    microbatch=0,
                    ready_s=a,
                    start_s=a,
                    end_s=b,
                )
            )
    return EventTable(world_size=world_size, simulated_ranks=(0,), ops=tuple(ops))
