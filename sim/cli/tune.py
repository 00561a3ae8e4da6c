"""``fsdpsim tune FILE``: the fastest FSDP configuration of a scenario that fits in device memory
(``sim.study.tune.tuner``), printed as a table or JSON (``sim.study.tune.report``)."""

import argparse
import json

from sim.cli.parser import ArgumentParser, add_set_flag
from sim.study.tune.report import format_table, to_json
from sim.study.tune.tuner import tune


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="fsdpsim tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scenario", help="scenario TOML file (see scenarios/)")
    add_set_flag(parser, "override a scenario key before tuning (repeatable)")
    parser.add_argument(
        "--margin",
        type=float,
        default=0.1,
        help="safety margin: a configuration fits when peak <= device memory x (1 - margin); default 0.1",
    )
    parser.add_argument("--top", type=int, default=5, help="configurations to print (default 5)")
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="N",
        help="sequences per optimizer step (default: micro_batch x grad_accum x world_size of the file)",
    )
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    return parser


def main(argv: list[str]) -> int:
    """``fsdpsim tune ARGS``: print the answer; 0 on success (also when nothing fits)."""
    args = build_parser().parse_args(argv)
    outcome = tune(
        args.scenario, args.overrides, margin=args.margin, top=args.top, global_sequences=args.global_batch
    )
    print(json.dumps(to_json(outcome), indent=2) if args.format == "json" else format_table(outcome))
    return 0
