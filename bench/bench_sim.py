"""Simulation speed: wall time and engine ops/s for one step at K ranks and L layers.

Target (core issue): one step of an 80-layer model on 1,024 ranks in under 2 s on one core.
Identical ranks are simulated once (rank symmetry); with jitter every rank is simulated.
"""

import time

from sim.scenario.loader import scenario_from_dict
from sim.simulate import simulate

TARGET_S = 2.0


def _scenario(k: int, layers: int, jitter: float = 0.0):  # type: ignore[no-untyped-def]
    preset = "llama3-70b" if layers == 80 else "llama2-7b"
    return scenario_from_dict(
        {
            "model": {"preset": preset, "n_layers": layers},
            "training": {"micro_batch": 1, "seq_len": 4096},
            "parallel": {"world_size": k, "strategy": "FULL_SHARD", "wrap": "block"},
            "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "simulation": {"compute_jitter": jitter, "seed": 0},
        },
        "bench",
    )


def _time(k: int, layers: int, jitter: float = 0.0) -> tuple[float, int, int]:
    scenario = _scenario(k, layers, jitter)
    start = time.perf_counter()
    result = simulate(scenario)
    wall = time.perf_counter() - start
    return wall, len(result.events.ops), len(result.events.simulated_ranks)


def main() -> None:
    print(f"{'ranks':>6} {'layers':>6} {'jitter':>6} {'simulated':>9} {'ops':>9} {'wall s':>8} {'ops/s':>10}")
    for layers in (32, 80):
        for k in (8, 64, 512, 1024):
            wall, ops, simulated = _time(k, layers)
            print(f"{k:>6} {layers:>6} {0:>6} {simulated:>9} {ops:>9,} {wall:>8.3f} {ops / wall:>10,.0f}")
    for k in (8, 64):
        wall, ops, simulated = _time(k, 32, jitter=0.05)
        print(f"{k:>6} {32:>6} {0.05:>6} {simulated:>9} {ops:>9,} {wall:>8.3f} {ops / wall:>10,.0f}")
    wall, _, _ = _time(1024, 80)
    print(f"1,024 ranks x 80 layers: {wall:.3f} s (target < {TARGET_S} s, ratio {wall / TARGET_S:.2f})")


if __name__ == "__main__":
    main()
