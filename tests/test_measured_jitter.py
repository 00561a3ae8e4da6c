"""The spread a compute calibration measured is the simulator's default per-op jitter: ranks
drift apart between collectives and wait for the late one (``sim.simulate.compute_jitter``)."""

import json
from pathlib import Path

import pytest

from sim.outputs.report import build_report
from sim.outputs.report_text import format_table
from sim.scenario.loader import load_scenario
from sim.simulate import compute_jitter, simulate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "scenarios" / "tiny.toml"
CPU_PROFILE = ROOT / "profiles" / "cpu-2x-gloo.json"


def _profile(tmp_path: Path, spread: float | None) -> Path:
    doc = json.loads(CPU_PROFILE.read_text())
    if spread is None:
        doc["compute"].pop("compute_time_rel_std", None)  # a profile from before it was measured
    else:
        doc["compute"]["compute_time_rel_std"] = spread
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(doc))
    return path


def _run(profile: Path, *sets: str):  # type: ignore[no-untyped-def]
    scenario = load_scenario(str(TINY), [f"cluster.profile={profile}", "parallel.world_size=2", *sets])
    return scenario, simulate(scenario)


def _waits_s(result) -> float:  # type: ignore[no-untyped-def]
    """Time rank ops spent ready but not started: a collective waiting for the late rank."""
    ops = [o for r in range(2) for o in result.events.ops_of(r) if o.kind.is_collective]
    return sum(o.start_s - o.ready_s for o in ops)


def test_the_measured_spread_makes_ranks_wait_for_each_other(tmp_path: Path) -> None:
    scenario, drifting = _run(_profile(tmp_path, 0.08))
    assert compute_jitter(scenario, drifting.profile) == 0.08
    _, steady = _run(_profile(tmp_path, 0.0))
    assert _waits_s(steady) == 0.0
    assert _waits_s(drifting) > 0.0
    # the step ends when the late rank does: slower than ranks in lockstep
    assert build_report(drifting).step_time_s > build_report(steady).step_time_s
    report = build_report(drifting)
    assert report.compute_jitter == 0.08 and report.to_json()["compute_jitter"] == 0.08
    assert "compute jitter 8.0% per op and rank" in format_table(report)


def test_the_scenarios_own_jitter_wins_and_older_profiles_have_none(tmp_path: Path) -> None:
    scenario, result = _run(_profile(tmp_path, 0.08), "simulation.compute_jitter=0")
    assert compute_jitter(scenario, result.profile) == 0.0 and _waits_s(result) == 0.0
    scenario, result = _run(_profile(tmp_path, None))
    assert result.profile.compute is not None and result.profile.compute.compute_time_rel_std == 0.0
    assert compute_jitter(scenario, result.profile) == 0.0
    assert "ranks drift" not in format_table(build_report(result))
    scenario, result = _run(_profile(tmp_path, None), "simulation.compute_jitter=0.05")
    assert compute_jitter(scenario, result.profile) == pytest.approx(0.05)


def test_the_spread_estimator_is_the_normal_sigma_of_the_mean_pairwise_difference() -> None:
    import math
    import random
    import statistics

    from calibrate.overheads import gini_sigma

    # three samples: pairs differ by 1, 2 and 1, mean 4/3; sigma = sqrt(pi)/2 * 4/3
    assert gini_sigma([1.0, 2.0, 3.0]) == pytest.approx(math.sqrt(math.pi) / 2 * 4 / 3)
    assert gini_sigma([5.0] * 10) == 0.0
    rng = random.Random(1)
    draws = [rng.gauss(10.0, 0.5) for _ in range(4000)]
    assert gini_sigma(draws) == pytest.approx(0.5, rel=0.05)  # a normal law's own sigma
    # one preempted run among 29 steady ones counts by its size, not its square
    steady = [1.0 + 0.01 * (i % 3) for i in range(29)]
    assert gini_sigma([*steady, 10.0]) < statistics.stdev([*steady, 10.0]) / 2
