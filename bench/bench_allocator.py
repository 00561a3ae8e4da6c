"""Benchmark: the caching-allocator replay behind peak reserved memory, on the published
kept-output row (llama-cookbook PR #41's Llama-2-7B LoRA step with its output kept, 4 x A100-40GB).

Prints the requests served, the replay's time for the steady-state step (a first step, then the
measured one: ``sim.outputs.allocator.steady_state_replay``) and the requests per second. Run:
``.venv/bin/python -m bench allocator``.
"""

import time

from sim.outputs.allocator import allocator_order, reserved_curve, tensor_sizes
from sim.scenario.loader import scenario_from_dict
from sim.simulate import simulate
from validation.published_memory import MEMORY_RUNS

GIB = 1 << 30


def main() -> int:
    run = MEMORY_RUNS[1]
    result = simulate(scenario_from_dict(run.tables, run.name, []))
    device = result.profile.device
    records = allocator_order(list(result.events.memory_of(0)))
    requests = sum(len(tensor_sizes(r)) for r in records if r.delta_bytes > 0)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        curve = reserved_curve(
            result.events,
            0,
            device.memory_bytes - device.context_bytes,
            workspace_bytes=device.cublas_workspace_bytes,
        )
        best = min(best, time.perf_counter() - t0)
    print(
        f"{len(records):,} memory records, {requests:,} allocator requests a step: the steady-state replay "
        f"(two steps) in {best * 1e3:.0f} ms, {2 * requests / best:,.0f} requests/s; "
        f"peak reserved {curve.peak_bytes() / GIB:.2f} GiB"
    )
    return 0


if __name__ == "__main__":
    main()
