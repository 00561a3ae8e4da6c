"""``fsdpsim``: run a scenario, calibrate a machine, validate against real FSDP2.

User mistakes print one line on stderr and exit with code 2; nothing half-written is left.
"""

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from sim.errors import UserError
from sim.io import write_text_atomic


def _add_run(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    run = sub.add_parser("run", help="simulate one training step of a scenario")
    run.add_argument("scenario", help="scenario TOML file (see scenarios/)")
    run.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a scenario key, e.g. --set parallel.world_size=64 (repeatable)",
    )  # fmt: skip
    run.add_argument("--format", choices=("table", "json"), default="table", help="report format on stdout")
    run.add_argument("--out", metavar="FILE", help="also write the report (in --format) to FILE")
    run.add_argument("--timeline", metavar="HTML", help="write an interactive plotly timeline")
    run.add_argument(
        "--compare-set", dest="compare", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="with --timeline: also simulate the scenario with these overrides (repeatable) and stack "
        "both runs on one time axis, e.g. --compare-set parallel.strategy=SHARD_GRAD_OP",
    )  # fmt: skip
    run.add_argument("--trace", metavar="JSON", help="write a Chrome trace (open in Perfetto)")
    run.add_argument(
        "--trace-dir", metavar="DIR", help="write one Chrome trace per rank (rank<r>.trace.json, for HTA)"
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from sim.report import format_table
    from sim.scenario import load_scenario
    from sim.simulate import simulate

    for path in (args.out, args.timeline, args.trace):
        if path and Path(path).is_dir():
            raise UserError(f"{path}: is a directory, expected a file path")
    if args.compare and not args.timeline:
        raise UserError("--compare-set draws a comparison timeline: give --timeline FILE.html too")
    result = simulate(load_scenario(args.scenario, args.overrides))
    other = simulate(load_scenario(args.scenario, [*args.overrides, *args.compare])) if args.compare else None
    text = json.dumps(result.report, indent=2) if args.format == "json" else format_table(result.report)
    print(text)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    if args.timeline:
        from sim.timeline import write_timeline_html

        write_timeline_html(
            result.events,
            args.timeline,
            title=f"{args.scenario}",
            device_memory_bytes=result.report["device_memory_bytes"],
            compare=(" ".join(args.compare), other.events) if other else None,
        )
        print(f"timeline written to {args.timeline}", file=sys.stderr)
    if args.trace or args.trace_dir:
        from sim.chrome_trace import write_chrome_trace, write_chrome_trace_per_rank

        dtype = result.scenario.reduce_dtype
        if args.trace:
            write_chrome_trace(result.events, args.trace, reduce_dtype=dtype)
            print(f"trace written to {args.trace}", file=sys.stderr)
        if args.trace_dir:
            files = write_chrome_trace_per_rank(result.events, args.trace_dir, reduce_dtype=dtype)
            print(f"{len(files)} per-rank traces written to {args.trace_dir}", file=sys.stderr)
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    from sim.builtin_profiles import BUILTIN_PROFILES
    from sim.model import PRESETS, n_params

    print("model presets:")
    for name, cfg in PRESETS.items():
        print(f"  {name:<12} {n_params(cfg):>16,} params  layers={cfg.n_layers} hidden={cfg.hidden}")
    print("built-in hardware profiles (datasheet, not calibrated):")
    for name, data in BUILTIN_PROFILES.items():
        print(f"  {name:<12} {data['device']['name']}")
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    """Hand the rest of the command line to a module with its own flags (imported only when asked for)."""
    import importlib

    try:
        cli = importlib.import_module(module)
    except ModuleNotFoundError as e:
        extra = "torch" if module.split(".")[0] in ("calibrate", "validation") else "dev"
        raise UserError(f"`fsdpsim` needs {e.name!r} for this command: pip install -e '.[{extra}]'") from None
    return int(cli.main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        return _guard(lambda: _delegate("calibrate.cli", argv[1:]))
    if argv[:1] == ["validate"]:
        return _guard(lambda: _delegate("validation.cli", argv[1:]))
    if argv[:1] in (["sweep"], ["tune"]):
        # what-if studies: each module owns its flags (``main(argv) -> int``)
        return _guard(lambda: _delegate(f"sim.{argv[0]}", argv[1:]))
    parser = argparse.ArgumentParser(prog="fsdpsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    sub.add_parser("presets", help="list model presets and built-in hardware profiles")
    sub.add_parser("calibrate", help="measure collectives and per-unit compute (see `fsdpsim calibrate -h`)")
    sub.add_parser("validate", help="compare a prediction with a real FSDP2 run (see `fsdpsim validate -h`)")
    sub.add_parser("sweep", help="run a grid of scenario variants (see `fsdpsim sweep -h`)")
    sub.add_parser("tune", help="search for the fastest configuration that fits (see `fsdpsim tune -h`)")
    args = parser.parse_args(argv)
    commands = {"run": _cmd_run, "presets": _cmd_presets}
    return _guard(lambda: commands[args.command](args))


def _guard(action: Callable[[], int]) -> int:
    try:
        return int(action())
    except UserError as e:
        print(f"fsdpsim: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fsdpsim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
