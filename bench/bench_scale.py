"""Scale with per-rank variability: one step of Llama-3-70B (80 layers, full checkpointing,
8,192 tokens per rank, FULL_SHARD) with 5 % compute jitter, and with one NIC at half its rate,
from 64 to 16,384 ranks, on both engines: SimPy (the reference, every rank's records) and the
vectorised one (``sim.core.vector_engine``). Each pair is checked to give the same step time.

Target (network issue): 16,384 ranks with per-rank variability in at most 60 s on one core.
"""

import math
import resource
import time

from sim.outputs.report import build_report
from sim.scenario.loader import scenario_from_dict
from sim.simulate import simulate

TARGET_S = 60.0
SIMPY_UP_TO = 1024  # beyond, the reference takes minutes


def _scenario(ranks: int, engine: str, slow_nic: bool):  # type: ignore[no-untyped-def]
    variability: dict[str, object] = {"compute_jitter": 0.05, "seed": 0, "engine": engine}
    if slow_nic:
        variability.update(slow_nic_node=min(7, ranks // 8 - 1), slow_nic=3, slow_nic_factor=0.5)
    return scenario_from_dict(
        {
            "model": {"preset": "llama3-70b"},
            "training": {"micro_batch": 1, "seq_len": 8192},
            "parallel": {"world_size": ranks, "strategy": "FULL_SHARD"},
            "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "checkpointing": {"mode": "full"},
            "simulation": variability,
        },
        "bench-scale",
    )


def _run(ranks: int, engine: str, slow_nic: bool) -> tuple[float, float]:
    scenario = _scenario(ranks, engine, slow_nic)
    start = time.perf_counter()
    report = build_report(simulate(scenario))
    return time.perf_counter() - start, report.step_time_s


def main() -> None:
    print(
        f"{'ranks':>6} {'variability':<14} {'simpy s':>9} {'vector s':>9} {'step (simpy)':>13} {'step (vector)':>14}"
    )
    largest = 0.0
    for slow_nic in (False, True):
        label = "jitter+slow NIC" if slow_nic else "jitter 5 %"
        for ranks in (64, 256, 1024, 4096, 16384):
            vector_s, vector_step = _run(ranks, "vector", slow_nic)
            if ranks <= SIMPY_UP_TO:
                simpy_s, simpy_step = _run(ranks, "simpy", slow_nic)
                assert math.isclose(simpy_step, vector_step, rel_tol=1e-9), (simpy_step, vector_step)
                reference = f"{simpy_s:>9.2f}"
                reference_step = f"{simpy_step * 1e3:>11.1f}ms"
            else:
                reference, reference_step = f"{'-':>9}", f"{'-':>13}"
            print(
                f"{ranks:>6} {label:<14} {reference} {vector_s:>9.2f} {reference_step} {vector_step * 1e3:>12.1f}ms"
            )
            if ranks == 16384:
                largest = max(largest, vector_s)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"16,384 ranks with per-rank variability: {largest:.1f} s (target <= {TARGET_S:.0f} s, "
        f"ratio {largest / TARGET_S:.2f}); peak memory of this process {peak_mb:,.0f} MB"
    )


if __name__ == "__main__":
    main()
