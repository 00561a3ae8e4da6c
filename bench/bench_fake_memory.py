"""Real FSDP2 peak memory of one rank at scale (fake process group + FakeTensorMode) against the simulator.

For each configuration: the child's wall time and peak RSS, the measured peak (FSDPMemTracker)
and the simulated one, and the signed % error per category ((simulated - measured) / measured).
The simulator runs with the scenario's profile, its ``backend.attention_kernel`` set to the kernel
that ran (CPU flash here) and no collective temporaries (the fake group allocates none).
Issue target: a 1.3B-parameter model at world size 8 in ~12 s and ~330 MB of RAM.
"""

import time
from pathlib import Path
from typing import Any

from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from validation.fake_memory_child import measure_fake_memory_subprocess
from validation.memory_only import compare_memory

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = str(ROOT / "scenarios" / "llama2-7b-8xh100-zero3.toml")  # Llama-2-7B, mb 2 x 4096, bf16/fp32
GiB = 1 << 30
TIMEOUT_S = 600.0
BF16 = ['precision.param_dtype="bf16"', 'precision.reduce_dtype="fp32"']
FP32 = ['precision.param_dtype="fp32"', 'precision.reduce_dtype="fp32"']
CKPT = ['checkpointing.mode="full"']
NO_RESHARD = ["parallel.reshard_after_forward=false"]
L70 = ['model.preset="llama3-70b"', "parallel.world_size=64", "training.micro_batch=1"]
CONFIGS: list[tuple[str, list[str]]] = [
    ("llama2-7b K=8 fp32", FP32),
    ("llama2-7b K=8 bf16", BF16),
    ("llama2-7b K=8 bf16 ckpt", BF16 + CKPT),
    ("llama2-7b K=8 bf16 no-reshard", BF16 + NO_RESHARD),
    ("llama3-70b K=64 bf16", L70 + BF16),
    ("llama3-70b K=64 fp32", L70 + FP32),
    ("llama3-70b K=64 bf16 ckpt", L70 + BF16 + CKPT),
    ("llama3-70b K=64 bf16 no-reshard", L70 + BF16 + NO_RESHARD),
]


def compare(scenario: Scenario, measured: dict[str, Any]) -> dict[str, Any]:
    """Simulated peak and categories beside the measured ones, with signed % errors."""
    rows = compare_memory(scenario, measured).rows
    return {
        ("total" if r.metric == "peak memory" else r.metric.strip()): {
            "simulated": r.predicted,
            "measured": r.measured,
            "error_pct": None if r.error is None else 100.0 * r.error,
        }
        for r in rows
    }


def _print(name: str, measured: dict[str, Any], rows: dict[str, Any]) -> None:
    where = measured["peak_at"]
    print(
        f"{name}: child {measured['process_wall_s']:.1f} s (measure {measured['wall_s']:.1f} s), "
        f"RSS {measured['max_rss_bytes'] / 2**20:.0f} MiB, kernel {measured['kernels']['attention_kernel']}, "
        f"measured peak in {where.get('phase')} at {where.get('op')}"
    )
    print(f"  {'category':<13} {'measured GiB':>13} {'simulated GiB':>14} {'error %':>8}")
    for cat, r in rows.items():
        err = f"{r['error_pct']:+8.1f}" if r["error_pct"] is not None else "     n/a"
        print(f"  {cat:<13} {r['measured'] / GiB:>13.3f} {r['simulated'] / GiB:>14.3f} {err}")


def run(configs: list[tuple[str, list[str]]] = CONFIGS) -> list[dict[str, Any]]:
    results = []
    for name, overrides in configs:
        start = time.perf_counter()
        measured = measure_fake_memory_subprocess(SCENARIO, overrides, TIMEOUT_S)
        rows = compare(load_scenario(SCENARIO, overrides), measured)
        _print(name, measured, rows)
        results.append({"name": name, "overrides": overrides, "measured": measured, "compare": rows})
        print(f"  ({time.perf_counter() - start:.1f} s with the simulation)", flush=True)
    return results


def main() -> None:
    run()


if __name__ == "__main__":
    main()
