"""``fsdpsim run``: simulate one step of a scenario; print the report, write timeline and traces."""

import argparse
import json
import sys
from pathlib import Path

from sim.cli.parser import add_set_flag
from sim.errors import UserError
from sim.fileio import write_text_atomic
from sim.outputs.report import build_report
from sim.outputs.report_text import format_table
from sim.scenario.loader import load_scenario
from sim.simulate import SimResult, simulate


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    run = sub.add_parser("run", help="simulate one training step of a scenario")
    run.add_argument("scenario", help="scenario TOML file (see scenarios/)")
    add_set_flag(run, "override a scenario key, e.g. --set parallel.world_size=64 (repeatable)")
    run.add_argument(
        "--deepspeed",
        metavar="DS_CONFIG.json",
        help="simulate DeepSpeed ZeRO as this DeepSpeed config sets it up (its batch, precision, optimizer "
        "and zero_optimization override the scenario; --set still applies after it)",
    )
    run.add_argument("--format", choices=("table", "json"), default="table", help="report format on stdout")
    run.add_argument("--out", metavar="FILE", help="also write the report (in --format) to FILE")
    run.add_argument("--timeline", metavar="HTML", help="write an interactive plotly timeline")
    run.add_argument(
        "--compare-set",
        dest="compare",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="with --timeline: also simulate the scenario with these overrides (repeatable) and stack "
        "both runs on one time axis, e.g. --compare-set parallel.strategy=SHARD_GRAD_OP",
    )
    run.add_argument("--trace", metavar="JSON", help="write a Chrome trace (open in Perfetto)")
    run.add_argument(
        "--trace-dir", metavar="DIR", help="write one Chrome trace per rank (rank<r>.trace.json, for HTA)"
    )


def _check_paths(args: argparse.Namespace) -> None:
    for path in (args.out, args.timeline, args.trace):
        if path and Path(path).is_dir():
            raise UserError(f"{path}: is a directory, expected a file path")
    if args.compare and not args.timeline:
        raise UserError("--compare-set draws a comparison timeline: give --timeline FILE.html too")


def _write_timeline(args: argparse.Namespace, result: SimResult, other: SimResult | None) -> None:
    from sim.outputs.report import device_overhead_bytes, reserved_of
    from sim.outputs.timeline import DeviceLines, write_timeline_html

    device = DeviceLines(
        memory_bytes=result.profile.device.memory_bytes,
        reserved_of=lambda rank: reserved_of(result, rank),
        overhead_of=lambda rank: device_overhead_bytes(result, rank),
    )
    write_timeline_html(
        result.events,
        args.timeline,
        title=f"{args.scenario}",
        device=device,
        compare=(" ".join(args.compare), other.events) if other else None,
    )
    print(f"timeline written to {args.timeline}", file=sys.stderr)


def _write_traces(args: argparse.Namespace, result: SimResult) -> None:
    from sim.outputs.chrome_trace import TraceNames, write_chrome_trace, write_chrome_trace_per_rank

    names = TraceNames(backend=result.profile.backend.name, reduce_dtype=result.scenario.reduce_dtype)
    if args.trace:
        write_chrome_trace(result.events, args.trace, names=names)
        print(f"trace written to {args.trace}", file=sys.stderr)
    if args.trace_dir:
        files = write_chrome_trace_per_rank(result.events, args.trace_dir, names=names)
        print(f"{len(files)} per-rank traces written to {args.trace_dir}", file=sys.stderr)


def scenario_overrides(args: argparse.Namespace) -> list[str]:
    """``--deepspeed``'s overrides, then ``--set``'s; the DeepSpeed fields without effect on one
    step are named on stderr."""
    if not getattr(args, "deepspeed", None):
        return list(args.overrides)
    from sim.scenario.deepspeed_config import deepspeed_overrides

    overrides, no_effect = deepspeed_overrides(args.deepspeed)
    if no_effect:
        print(f"{args.deepspeed}: accepted, no effect on one step: {', '.join(no_effect)}", file=sys.stderr)
    return [*overrides, *args.overrides]


def main(args: argparse.Namespace) -> int:
    _check_paths(args)
    overrides = scenario_overrides(args)
    scenario = load_scenario(args.scenario, overrides)
    for warning in scenario.warnings:
        print(f"fsdpsim: warning: {warning}", file=sys.stderr)
    result = simulate(scenario)
    other = simulate(load_scenario(args.scenario, [*overrides, *args.compare])) if args.compare else None
    report = build_report(result)
    text = json.dumps(report.to_json(), indent=2) if args.format == "json" else format_table(report)
    print(text)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    if args.timeline:
        _write_timeline(args, result, other)
    if args.trace or args.trace_dir:
        _write_traces(args, result)
    return 0
