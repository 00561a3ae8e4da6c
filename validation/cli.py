"""``fsdpsim validate``: run a scenario for real (FSDP2 or DDP on gloo/NCCL) and simulate it, side by side."""

import argparse
import json
import sys
from pathlib import Path

from sim.errors import UserError
from sim.fileio import write_text_atomic
from validation.run import Validation, validate_one

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
        "--systems",
        help="with --matrix: only the rows of these systems (comma-separated: fsdp2, fsdp1, deepspeed, hf), "
        "written between markers in --out, the rest of the file kept",
    )
    p.add_argument("--rounds", type=int, default=None, help="with --matrix: interleaved rounds (default 3)")
    p.add_argument(
        "--published",
        action="store_true",
        help="predict the published GPU runs of the development set and write their section of --out",
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="measure one rank's real FSDP2 peak memory at the scenario's world size in one process "
        "(fake process group) instead of running on --nproc ranks",
    )
    return p


def main(argv: list[str]) -> int:
    from validation.compare import as_json, format_markdown

    args = build_parser().parse_args(argv)
    if args.published:
        from validation.published import write_published

        print(write_published(args.out or "VALIDATION.md"))
        return 0
    if args.matrix:
        return _matrix(args)
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
        args.scenario,
        args.overrides,
        nproc=args.nproc,
        steps=args.steps,
        warmup=args.warmup,
        profile=args.profile,
        timeout_s=args.timeout,
    )
    comparison = validation.comparison
    if args.timeline:
        _write_timeline(args.timeline, args.scenario, validation)
    text = format_markdown(f"{args.scenario} on {args.nproc} ranks", comparison)
    print(json.dumps(as_json(comparison), indent=2) if args.format == "json" else text)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    return 0 if comparison.collectives_match else 1


def _matrix(args: argparse.Namespace) -> int:
    from validation.matrix import ROUNDS, run_matrix

    out, systems = args.out or "VALIDATION.md", _systems(args.systems)
    rounds = ROUNDS if args.rounds is None else args.rounds
    if rounds < 1:
        raise UserError(f"--rounds must be >= 1, got {rounds}")
    run_matrix(
        out=out, steps=args.steps, warmup=args.warmup, nproc=args.nproc, systems=systems, rounds=rounds
    )
    return 0


def _systems(text: str | None) -> set[str] | None:
    from validation.matrix_rows import SYSTEMS

    if text is None:
        return None
    chosen = {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(chosen - set(SYSTEMS))
    if unknown or not chosen:
        raise UserError(f"--systems {text!r}: allowed: {', '.join(SYSTEMS)}")
    return chosen


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
        validation.predicted.events,
        path,
        title=f"{title}: predicted (top) and measured on rank 0 (bottom)",
        compare=("measured", table),
    )
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
