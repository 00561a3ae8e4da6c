"""One validation: calibrate this machine for a scenario, run the scenario for real, simulate it
with the calibration, and compare (``validation.compare``). Calibration is called as Python
functions (``calibrate.api``)."""

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate.api import calibrate_comm, calibrate_compute
from calibrate.errors import CalibrationFailed
from sim.errors import UserError
from sim.hardware.registry import load_profile
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.simulate import SimResult, simulate
from sim.workload.options import Strategy
from validation.compare import Comparison, compare
from validation.launch import run_real

COMM_MAX_BYTES = 16 << 20  # the largest collective of the validation models, with room


def calibrate_collectives(out: Path, nproc: int) -> None:
    """This machine's collectives on ``nproc`` local ranks, up to the sizes a validation step uses."""
    try:
        calibrate_comm(out=out, nproc=nproc, max_bytes=COMM_MAX_BYTES)
    except CalibrationFailed as e:
        raise UserError(f"calibrating the collectives failed: {e}") from None


def calibrated_profile(
    scenario_path: str, overrides: list[str], nproc: int, folder: Path, base: str | None
) -> str:
    """A profile with this machine's collectives (``base``'s, else measured now) and this
    scenario's per-unit compute, measured with as many ranks as the real run has (ranks compute
    at once in training)."""
    profile = folder / "profile.json"
    if base is not None:
        shutil.copyfile(base, profile)
    else:
        calibrate_collectives(profile, nproc)
    try:
        calibrate_compute(scenario=scenario_path, profile=profile, nproc=nproc, overrides=overrides)
    except CalibrationFailed as e:
        raise UserError(f"calibrating the per-unit compute failed: {e}") from None
    return str(profile)


@dataclass(frozen=True, kw_only=True)
class Validation:
    predicted: SimResult
    ranks: list[dict[str, Any]]  # each rank's measurements (validation.worker)
    comparison: Comparison


def validate_one(
    scenario_path: str,
    overrides: list[str],
    *,
    nproc: int,
    steps: int,
    warmup: int,
    profile: str | None,
    timeout_s: float,
) -> Validation:
    """Run for real, simulate with a calibrated profile, and compare."""
    from validation.build import check_output_format  # torch: only when something runs
    from validation.build_fsdp1 import check_runs_here

    overrides = [*overrides, f"parallel.world_size={nproc}"]
    scenario = load_scenario(scenario_path, overrides)  # a user mistake fails here, before anything runs
    check_runs_here(scenario)
    check_output_format(scenario)
    with tempfile.TemporaryDirectory(prefix="fsdpsim-profile-") as tmp:
        if profile is None or load_profile(profile).compute is None:
            profile = calibrated_profile(scenario_path, overrides, nproc, Path(tmp), profile)
        scenario = load_scenario(scenario_path, [*overrides, f"cluster.profile={json.dumps(profile)}"])
        result = simulate(scenario)
        report = build_report(result)
    spec = {"scenario": scenario_path, "overrides": overrides, "steps": steps, "warmup": warmup}
    ranks = run_real(spec, nproc, timeout_s)
    fsdp = scenario.parallel.strategy is not Strategy.NO_SHARD or scenario.parallel.fsdp_version == 1
    return Validation(
        predicted=result, ranks=ranks, comparison=compare(report, result.events, ranks, fsdp=fsdp)
    )
