"""``fsdpsim validate``: run a scenario for real (FSDP2 or DDP on gloo/NCCL) and simulate it, side by side."""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from sim.errors import UserError
from sim.fileio import write_text_atomic

PROG = "fsdpsim validate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("scenario", nargs="?", help="scenario TOML; its parallel.world_size is set to --nproc")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the real run on this machine (default 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps after warm-up (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--profile", help="calibrated profile to simulate with (default: calibrate now)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--out", help="write the report as markdown to this file")
    p.add_argument(
        "--timeline",
        metavar="HTML",
        help="write the predicted step's timeline with the measured one (rank 0, CPU runs) stacked under it",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the real run is stopped")
    p.add_argument(
        "--matrix", action="store_true", help="run the validation matrix and write --out (VALIDATION.md)"
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="measure one rank's real FSDP2 peak memory at the scenario's world size in one process "
        "(fake process group) instead of running on --nproc ranks",
    )
    return p


def calibrated_profile(
    scenario_path: str, overrides: list[str], nproc: int, folder: Path, base: str | None
) -> str:
    """A profile with this machine's collectives and this scenario's per-unit compute."""
    from calibrate.cli import main as calibrate_main

    profile = folder / "profile.json"
    if base is not None:
        shutil.copyfile(base, profile)
    elif calibrate_main(["comm", "--nproc", str(nproc), "--out", str(profile), "--max-bytes", "16M"]) != 0:
        raise UserError("calibrating the collectives failed (see above)")
    sets = [a for o in overrides for a in ("--set", o)]
    # ranks compute at once in training: measure with as many ranks as the real run has
    if (
        calibrate_main(["compute", scenario_path, "--profile", str(profile), "--nproc", str(nproc), *sets])
        != 0
    ):
        raise UserError("calibrating the per-unit compute failed (see above)")
    return str(profile)


class Validation(NamedTuple):
    predicted: Any  # sim.simulate.SimResult
    ranks: list[dict[str, Any]]  # each rank's measurements (validation.worker)
    comparison: Any  # validation.compare.Comparison


def validate_one(
    scenario_path: str,
    overrides: list[str],
    *,
    nproc: int,
    steps: int,
    warmup: int,
    profile: str | None,
    timeout_s: float,
) -> "Validation":
    """Run for real, simulate with a calibrated profile, and compare."""
    from sim.hardware.registry import load_profile
    from sim.scenario.loader import load_scenario
    from sim.workload.options import Strategy
    from sim.simulate import simulate
    from validation.compare import compare
    from validation.launch import run_real

    overrides = [*overrides, f"parallel.world_size={nproc}"]
    load_scenario(scenario_path, overrides)  # a user mistake fails here, before anything runs
    with tempfile.TemporaryDirectory(prefix="fsdpsim-profile-") as tmp:
        if profile is None or load_profile(profile).compute is None:
            profile = calibrated_profile(scenario_path, overrides, nproc, Path(tmp), profile)
        scenario = load_scenario(scenario_path, [*overrides, f"cluster.profile={json.dumps(profile)}"])
        result = simulate(scenario)
    spec = {"scenario": scenario_path, "overrides": overrides, "steps": steps, "warmup": warmup}
    ranks = run_real(spec, nproc, timeout_s)
    fsdp = scenario.parallel.strategy is not Strategy.NO_SHARD
    return Validation(result, ranks, compare(result.report, result.events, ranks, fsdp=fsdp))


def main(argv: list[str]) -> int:
    from validation.compare import as_json, format_markdown

    args = build_parser().parse_args(argv)
    if args.matrix:
        from validation.matrix import run_matrix

        run_matrix(out=args.out or "VALIDATION.md", steps=args.steps, warmup=args.warmup, nproc=args.nproc)
        return 0
    if args.scenario is None:
        raise UserError("validate needs a scenario file (or --matrix)")
    if args.memory_only:
        return _memory_only(args)
    if args.steps < 1 or args.warmup < 1 or args.nproc < 1:
        raise UserError(
            "--steps, --warmup and --nproc must be >= 1 (one warm-up step creates the optimizer state)"
        )
    if args.timeline and Path(args.timeline).is_dir():
        raise UserError(f"{args.timeline}: is a directory, expected a file path")
    validation = validate_one(
        args.scenario, args.overrides, nproc=args.nproc, steps=args.steps, warmup=args.warmup,
        profile=args.profile, timeout_s=args.timeout,
    )  # fmt: skip
    comparison = validation.comparison
    if args.timeline:
        _write_timeline(args.timeline, args.scenario, validation)
    text = format_markdown(f"{args.scenario} on {args.nproc} ranks", comparison)
    print(json.dumps(as_json(comparison), indent=2) if args.format == "json" else text)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    return 0 if comparison.collectives_match else 1


def _write_timeline(path: str, title: str, validation: Validation) -> None:
    from sim.outputs.timeline import write_timeline_html
    from validation.real_timeline import timeline_table

    real = validation.ranks[0].get("timeline") or {}
    if not real:
        raise UserError(
            "--timeline: the real run recorded no host timeline (only CPU runs, whose collectives block)"
        )
    table = timeline_table(real["phases"], real["collectives"], validation.predicted.events.world_size)
    write_timeline_html(
        validation.predicted.events, path, title=f"{title}: predicted (top) and measured on rank 0 (bottom)",
        compare=("measured", table),
    )  # fmt: skip
    print(f"timeline written to {path}", file=sys.stderr)


def _memory_only(args: argparse.Namespace) -> int:
    from validation.compare import as_json, format_markdown
    from validation.memory_only import validate_memory_only

    comparison, measured = validate_memory_only(args.scenario, args.overrides, args.timeout)
    title = f"{args.scenario} (memory only, one rank of {measured['world_size']}, fake process group)"
    text = format_markdown(title, comparison)
    print(json.dumps(as_json(comparison), indent=2) if args.format == "json" else text)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
