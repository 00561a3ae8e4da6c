"""A GPU's saved allocation trace against the simulated step's requests, size by size: the
diagnostic for the case ``validation.allocator_trace`` leaves, the allocator model reserving what
the GPU did on the GPU's own sequence but not on the simulated one (then a request the simulator
does not make, or makes at another size, is the error).

    python -m validation.trace_compare lora-row-trace.json.gz [--min-mib 64]

The simulated step is ``validation.gpu.LORA_ROW`` on the built-in profile of the trace's device.
For each request size of at least ``--min-mib`` it prints how many blocks of that size the GPU
allocated over the whole trace (the model built, then every step the worker ran) and how many one
simulated step asks for, and their ratio: a size whose ratio is not the run's number of steps
(``validation.gpu``'s ``steps`` + ``warmup`` plus the worker's extra steps) is one to look at, and
a size one side never asks for is the likeliest culprit.
"""

import argparse
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sim.core.events import MemoryRecord, Stream
from sim.errors import UserError
from sim.outputs.allocator import Served, allocator_order, serve_record
from sim.outputs.caching_allocator import MIB, Block, CachingAllocator, round_size
from sim.scenario.loader import load_scenario
from sim.simulate import simulate
from validation.allocator_trace import load_trace
from validation.gpu import BASE, LORA_ROW, builtin_for

MIN_MIB = 64  # the sizes that make segments of their own (the eager scores are 1 and 2 GiB)


class _RecordingAllocator(CachingAllocator):
    """The allocator model, noting the size of every request it is asked for."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=1 << 62)  # no device limit: nothing is released to fit
        self.requests: list[int] = []

    def take(self, nbytes: int, stream: Stream) -> Block:
        self.requests.append(nbytes)
        return super().take(nbytes, stream)


def simulated_requests(records: Iterable[MemoryRecord]) -> list[int]:
    """The request sizes one simulated step makes of the caching allocator, in the order it makes
    them: its allocations served as the reserved-memory replay serves them
    (``sim.outputs.allocator.serve_record``: an ordered buffer's requests, its partner's tensors
    among them, else each buffer's tensors); its frees ask for nothing and are left out."""
    allocator = _RecordingAllocator()
    served: Served = {}
    for rec in records:
        if rec.delta_bytes > 0:
            serve_record(allocator, rec, served)
    return allocator.requests


def gpu_requests(entries: Sequence[Mapping[str, Any]]) -> list[int]:
    """The block sizes the GPU's allocator handed out (its ``alloc`` entries), in order."""
    return [int(e["size"]) for e in entries if e["action"] == "alloc" and int(e.get("size", 0)) > 0]


def size_table(gpu: Sequence[int], simulated: Sequence[int], min_bytes: int) -> list[tuple[int, int, int]]:
    """(size, GPU blocks, simulated requests) for every rounded size of at least ``min_bytes``
    either side asks for, largest first."""
    ours = Counter(round_size(n) for n in simulated if n >= min_bytes)
    theirs = Counter(round_size(n) for n in gpu if n >= min_bytes)
    return [(size, theirs[size], ours[size]) for size in sorted(set(ours) | set(theirs), reverse=True)]


def markdown(rows: Sequence[tuple[int, int, int]]) -> str:
    lines = [
        "| size (MiB) | GPU blocks, whole trace | simulated requests, one step | ratio |",
        "|---|---|---|---|",
    ]
    for size, theirs, ours in rows:
        ratio = f"{theirs / ours:.2f}" if ours else "—"
        lines.append(f"| {size / MIB:,.2f} | {theirs:,} | {ours:,} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m validation.trace_compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("trace", help="a trace saved by validation.allocator_trace.save_trace")
    parser.add_argument("--min-mib", type=float, default=MIN_MIB, help="smallest request size shown")
    args = parser.parse_args(argv)
    try:
        entries, _, device = load_trace(args.trace)
        scenario = load_scenario(BASE, [*LORA_ROW[1], f'cluster.profile="{builtin_for(device)}"'])
    except UserError as e:
        print(f"trace_compare: error: {e}", file=sys.stderr)
        return 2
    records = allocator_order(list(simulate(scenario).events.memory_of(0)))
    rows = size_table(gpu_requests(entries), simulated_requests(records), int(args.min_mib * MIB))
    print(f"{device}: {LORA_ROW[0]}\n\n{markdown(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
