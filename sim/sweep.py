"""``fsdpsim sweep``: simulate every variant of a scenario and tabulate them.

A ``[sweep]`` table in the scenario file names the axes, ``"section.key" = [v1, v2, ...]``, and
``mode = "grid"`` (every combination, the last axis varying fastest) or ``"zip"`` (the i-th values
of every axis together; lists of equal length). ``--sweep section.key=v1,v2`` adds an axis or
replaces the file's, ``--zip`` switches to zip mode and ``--set`` fixes a key for every point (a
file axis on that key is dropped). Every key and list is checked before anything runs; a point
whose values the scenario rejects is reported in its row, not raised.

Outputs (each written atomically): ``sweep.csv`` (seconds and bytes), ``sweep.md`` (also printed)
and ``sweep.html`` (step time against peak memory with the Pareto front, ``sim.sweep_plots``).
"""

import argparse
import csv
import difflib
import io
import itertools
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

from sim.errors import UserError
from sim.io import write_text_atomic
from sim.sweep_exec import Base, Point, parse_executor, run_points

MODES = ("grid", "zip")
METRICS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_bytes", "fits")
"""Figures of every row, after the point number and the swept keys; ``error`` comes last."""
BYTES_PER_GIB = float(1 << 30)
MS_PER_S = 1e3


@dataclass(frozen=True, kw_only=True)
class Axis:
    """One swept key and its values, in the order they were given."""

    key: str
    values: tuple[Any, ...]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything a sweep runs: the base scenario, its source, the axes and the expanded points."""

    base: Base
    where: str
    axes: tuple[Axis, ...]
    points: tuple[Point, ...]


def _close(word: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {match[0]!r}?)" if match else f"; allowed: {', '.join(options)}"


def check_key(key: str, where: str) -> None:
    """Raise a ``UserError`` unless ``key`` is ``section.key`` of a scenario section."""
    from sim.scenario import SECTIONS

    section, _, name = key.partition(".")
    if section not in SECTIONS:
        raise UserError(f"{where}: {key!r}: unknown section {section!r}{_close(section, list(SECTIONS))}")
    known = [f.name for f in fields(SECTIONS[section])]
    if name not in known:
        options = [f"{section}.{k}" for k in known]
        raise UserError(f"{where}: unknown key {key!r}{_close(key, options)}")


def _flatten(table: dict[str, Any]) -> dict[str, Any]:
    """``{"parallel": {"wrap": [...]}}`` (TOML's unquoted dotted keys) becomes ``{"parallel.wrap": [...]}``."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def axes_from_table(table: Any, where: str) -> tuple[tuple[Axis, ...], str]:
    """The axes and mode of a ``[sweep]`` table, every key and list checked."""
    if not isinstance(table, dict):
        raise UserError(f"{where}: [sweep] must be a table")
    entries = _flatten(table)
    mode = entries.pop("mode", "grid")
    if mode not in MODES:
        raise UserError(f"{where}: [sweep] mode = {mode!r} is not allowed; allowed: {', '.join(MODES)}")
    axes = []
    for key, values in entries.items():
        check_key(key, f"{where}: [sweep]")
        if not isinstance(values, list) or not values:
            raise UserError(f"{where}: [sweep] {key!r} must be a non-empty list of values, got {values!r}")
        axes.append(Axis(key=key, values=tuple(values)))
    return tuple(axes), mode


def axis_from_flag(text: str) -> Axis:
    """Read ``--sweep section.key=v1,v2,...``; each value is read as ``--set`` reads it (TOML, else a string)."""
    from sim.scenario import parse_override

    key, sep, raw = text.partition("=")
    items = [item.strip() for item in raw.split(",")]
    if not sep or "." not in key or not all(items):
        raise UserError(f"--sweep {text!r}: expected section.key=v1,v2,..., e.g. training.micro_batch=1,2,4")
    check_key(key.strip(), f"--sweep {text!r}")
    return Axis(key=key.strip(), values=tuple(parse_override(f"{key}={item}")[2] for item in items))


def merge_axes(
    file_axes: Sequence[Axis], flag_axes: Sequence[Axis], fixed: Sequence[str]
) -> tuple[Axis, ...]:
    """File axes, replaced by a ``--sweep`` on the same key or dropped by a ``--set``, then new ``--sweep`` axes."""
    flags = {axis.key: axis for axis in flag_axes}
    if len(flags) != len(flag_axes):
        raise UserError(f"--sweep: a key is given twice ({', '.join(a.key for a in flag_axes)})")
    for key in fixed:
        if key in flags:
            raise UserError(f"--set {key} and --sweep {key} contradict each other; give one")
    merged = [flags.pop(a.key, a) for a in file_axes if a.key not in fixed]
    return tuple(merged + list(flags.values()))


def expand(axes: Sequence[Axis], mode: str, where: str) -> tuple[Point, ...]:
    """Points in a fixed order: grid = ``itertools.product`` (last axis fastest), zip = the i-th values."""
    if not axes:
        raise UserError(f"{where}: nothing to sweep: add a [sweep] table or --sweep section.key=v1,v2,...")
    if mode == "zip":
        lengths = {len(a.values) for a in axes}
        if len(lengths) > 1:
            sizes = ", ".join(f"{a.key} has {len(a.values)}" for a in axes)
            raise UserError(f"{where}: zip mode needs lists of equal length: {sizes}")
        combos: Any = zip(*(a.values for a in axes), strict=True)
    else:
        combos = itertools.product(*(a.values for a in axes))
    keys = [a.key for a in axes]
    return tuple(tuple(zip(keys, combo, strict=True)) for combo in combos)


def _load_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: scenario file not found")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None


def _apply_fixed(data: dict[str, Any], overrides: Sequence[str], where: str) -> tuple[Base, list[str]]:
    """The scenario's tables with each ``--set`` applied, and the keys they fix."""
    from sim.scenario import parse_override

    base: Base = {}
    for name, table in data.items():
        if not isinstance(table, dict):
            raise UserError(f"{where}: [{name}] must be a table")
        base[name] = dict(table)
    fixed = []
    for text in overrides:
        section, name, value = parse_override(text)
        check_key(f"{section}.{name}", f"--set {text!r}")
        base.setdefault(section, {})[name] = value
        fixed.append(f"{section}.{name}")
    return base, fixed


def make_plan(path: str, flags: Sequence[str], overrides: Sequence[str], zip_mode: bool) -> Plan:
    """Load ``path``, merge its ``[sweep]`` table with the flags and expand the points."""
    data = _load_toml(path)
    file_axes, mode = axes_from_table(data.pop("sweep", {}), path)
    base, fixed = _apply_fixed(data, overrides, path)
    axes = merge_axes(file_axes, [axis_from_flag(f) for f in flags], fixed)
    points = expand(axes, "zip" if zip_mode else mode, path)
    return Plan(base=base, where=path, axes=axes, points=points)


def _label(point: Point) -> str:
    return " ".join(f"{key.split('.', 1)[1]}={_text(value)}" for key, value in point)


def make_rows(plan: Plan, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point, in point order: ``point``, the swept keys, the figures (or ``error``)."""
    rows = []
    for i, (point, result) in enumerate(zip(plan.points, results, strict=True)):
        row: dict[str, Any] = {"point": i, **dict(point), "name": _label(point)}
        row.update(result)
        row.setdefault("error", "")
        rows.append(row)
    return rows


def _text(value: Any) -> str:
    """A value as TOML writes it for booleans, as ``str`` otherwise (``repr`` round-trips floats)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def csv_text(rows: Sequence[dict[str, Any]], axes: Sequence[Axis]) -> str:
    """``point``, the swept keys, ``METRICS`` in seconds and bytes, ``error``; empty figures for errors."""
    columns = ["point", *(a.key for a in axes), *METRICS, "error"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_text(row.get(c)) for c in columns])
    return out.getvalue()


MD_COLUMNS = (
    ("step_time_s", "step (ms)", lambda v: f"{v * MS_PER_S:.2f}"),
    ("tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"),
    ("tokens_per_s_per_gpu", "tokens/s/GPU", lambda v: f"{v:,.0f}"),
    ("mfu", "MFU", lambda v: f"{v * 100:.1f} %"),
    ("peak_memory_bytes", "peak (GiB)", lambda v: f"{v / BYTES_PER_GIB:.2f}"),
    ("fits", "fits", lambda v: "yes" if v else "no"),
)


def markdown_text(rows: Sequence[dict[str, Any]], axes: Sequence[Axis]) -> str:
    """A markdown table in display units; an ``error`` column only when some point failed."""
    with_errors = any(row["error"] for row in rows)
    header = ["#", *(a.key for a in axes), *(title for _, title, _ in MD_COLUMNS)]
    header += ["error"] if with_errors else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row["point"]), *(_text(row[a.key]) for a in axes)]
        cells += [("" if row["error"] else fmt(row[key])) for key, _, fmt in MD_COLUMNS]
        cells += [row["error"].replace("|", "\\|")] if with_errors else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(rows: Sequence[dict[str, Any]], axes: Sequence[Axis], out_dir: Path) -> list[Path]:
    """Write ``sweep.csv``, ``sweep.md`` and ``sweep.html`` (valid points only), each atomically.

    With no valid point there is nothing to plot, and an older ``sweep.html`` is removed so the
    folder never mixes two sweeps.
    """
    written = [out_dir / "sweep.csv", out_dir / "sweep.md"]
    write_text_atomic(written[0], csv_text(rows, axes))
    write_text_atomic(written[1], markdown_text(rows, axes))
    valid = [row for row in rows if not row["error"]]
    html = out_dir / "sweep.html"
    if not valid:
        html.unlink(missing_ok=True)
        return written
    from sim.sweep_plots import write_sweep_plots

    write_sweep_plots(valid, html)
    return [*written, html]


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are ``UserError`` (one line, exit code 2, from the CLI)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"sweep: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(prog="fsdpsim sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", help="scenario TOML file, optionally with a [sweep] table")
    p.add_argument("--sweep", dest="axes", action="append", default=[], metavar="SECTION.KEY=V1,V2,...",
                   help="sweep a key over values (repeatable; replaces the file's axis on that key)")  # fmt: skip
    p.add_argument("--zip", action="store_true", help="pair the i-th values of every axis (equal lengths)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="fix a key for every point (repeatable; drops a file axis on that key)")  # fmt: skip
    p.add_argument("--jobs", type=_positive_int, help="parallel workers (default: the local cores)")
    p.add_argument("--executor", default="local", metavar="local|ray|dask://HOST:PORT",
                   help="where points run (default local; ray uses RAY_ADDRESS when set)")  # fmt: skip
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
    import importlib.util

    if importlib.util.find_spec("plotly") is None:
        raise UserError("fsdpsim sweep writes sweep.html with plotly: pip install -e '.[plot]'")


def _summary(rows: Sequence[dict[str, Any]], wall_s: float, written: Sequence[Path]) -> None:
    failed = [row for row in rows if row["error"]]
    internal = sum(row["error"].startswith("internal error") for row in failed)
    print(f"{len(rows)} points, {len(rows) - len(failed)} valid, {len(failed)} invalid, in {wall_s:.1f} s; "
          f"wrote {', '.join(map(str, written))}", file=sys.stderr)  # fmt: skip
    if internal:
        print(
            f"warning: {internal} points hit an internal error (a simulator bug; please report)",
            file=sys.stderr,
        )
