"""``fsdpsim sweep``: simulate every variant of a scenario and tabulate them.

See ``sim.study.sweep.plan`` for the ``[sweep]`` table and the flags, ``sim.study.sweep.execute``
for where points run, and ``sim.study.sweep.outputs`` for what is written.
"""

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.cli.parser import ArgumentParser, add_set_flag
from sim.errors import UserError
from sim.study.sweep.execute import parse_executor, run_points
from sim.study.sweep.outputs import markdown_text, write_outputs
from sim.study.sweep.plan import make_plan, make_rows


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fsdpsim sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", help="scenario TOML file, optionally with a [sweep] table")
    p.add_argument(
        "--sweep",
        dest="axes",
        action="append",
        default=[],
        metavar="SECTION.KEY=V1,V2,...",
        help="sweep a key over values (repeatable; replaces the file's axis on that key)",
    )
    p.add_argument("--zip", action="store_true", help="pair the i-th values of every axis (equal lengths)")
    add_set_flag(p, "fix a key for every point (repeatable; drops a file axis on that key)")
    p.add_argument("--jobs", type=_positive_int, help="parallel workers (default: the local cores)")
    p.add_argument(
        "--executor",
        default="local",
        metavar="local|ray|dask://HOST:PORT",
        help="where points run (default local; ray uses RAY_ADDRESS when set)",
    )
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default out/<scenario name>)")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``fsdpsim sweep`` flags; mistakes raise ``UserError``."""
    return _parser().parse_args(list(argv))


def main(argv: list[str]) -> int:
    """``fsdpsim sweep``: exit 0 when some point is valid, 1 when every point is invalid."""
    args = parse_args(argv)
    executor = parse_executor(args.executor)
    out_dir = Path(args.out) if args.out else Path("out") / Path(args.scenario).stem
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: exists and is not a directory")
    plan = make_plan(args.scenario, args.axes, args.overrides, args.zip)
    _require_plotly()
    start = time.perf_counter()
    results = run_points(plan.base, plan.where, plan.points, executor=executor, jobs=args.jobs, progress=True)
    wall_s = time.perf_counter() - start
    rows = make_rows(plan, results)
    written = write_outputs(rows, plan.axes, out_dir)
    print(markdown_text(rows, plan.axes), end="")
    _summary(rows, wall_s, written)
    return 0 if any(not row["error"] for row in rows) else 1


def _require_plotly() -> None:
    """Refuse before running anything when ``sweep.html`` could not be written."""
    if importlib.util.find_spec("plotly") is None:
        raise UserError("fsdpsim sweep writes sweep.html with plotly: pip install -e '.[plot]'")


def _summary(rows: Sequence[dict[str, Any]], wall_s: float, written: Sequence[Path]) -> None:
    failed = [row for row in rows if row["error"]]
    internal = sum(row["error"].startswith("internal error") for row in failed)
    print(
        f"{len(rows)} points, {len(rows) - len(failed)} valid, {len(failed)} invalid, in {wall_s:.1f} s; "
        f"wrote {', '.join(map(str, written))}",
        file=sys.stderr,
    )
    if internal:
        print(
            f"warning: {internal} points hit an internal error (a simulator bug; please report)",
            file=sys.stderr,
        )
