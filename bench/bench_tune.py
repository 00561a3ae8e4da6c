"""Tuner speed and pruning: wall time of ``fsdpsim tune`` on the library's 7B scenarios, with the
share of configurations the memory and step-time bounds kept from being simulated, against the
brute force that simulates every configuration."""

import time

from sim.hardware.registry import load_profile
from sim.scenario.loader import load_scenario
from sim.study.tune.search import Status, search
from sim.study.tune.space import global_batch

SCENARIOS = ("scenarios/llama2-7b-8xh100-zero3.toml", "scenarios/sft-vs-grpo-7b.toml")
MARGIN = 0.1


def _run(path: str, prune: bool) -> tuple[float, int, int, int, float]:
    scenario = load_scenario(path)
    profile = load_profile(scenario.cluster.profile)
    limit = profile.device.memory_bytes * (1 - MARGIN)
    start = time.perf_counter()
    result = search(scenario, profile, global_batch(scenario), limit, 5, prune=prune)
    wall = time.perf_counter() - start
    best = result.top[0].step_time_s if result.top else float("nan")
    return (
        wall,
        len(result.evaluated),
        result.count(Status.PRUNED_MEMORY),
        result.count(Status.PRUNED_TIME),
        best,
    )


def main() -> None:
    print(
        f"{'scenario':<40}{'configs':>8}{'mem-pruned':>11}{'time-pruned':>12}{'tune s':>8}{'brute s':>9}{'same best':>10}"
    )
    for path in SCENARIOS:
        wall, n, mem, slow, best = _run(path, True)
        brute_wall, _, _, _, brute_best = _run(path, False)
        print(
            f"{path.split('/')[-1]:<40}{n:>8}{mem:>11}{slow:>12}{wall:>8.2f}{brute_wall:>9.2f}{str(best == brute_best):>10}"
        )


if __name__ == "__main__":
    main()
