"""A sweep's plan: the axes of a ``[sweep]`` table and ``--sweep`` flags, expanded into points.

A ``[sweep]`` table in the scenario file names the axes, ``"section.key" = [v1, v2, ...]``, and
``mode = "grid"`` (every combination, the last axis varying fastest) or ``"zip"`` (the i-th values
of every axis together; lists of equal length). ``--sweep section.key=v1,v2`` adds an axis or
replaces the file's, ``--zip`` switches to zip mode and ``--set`` fixes a key for every point (a
file axis on that key is dropped). Every key and list is checked before anything runs; a point
whose values the scenario rejects is reported in its row, not raised.
"""

import difflib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from sim.errors import UserError
from sim.scenario.loader import parse_override, read_scenario_toml
from sim.scenario.sections import SECTIONS
from sim.study.sweep.execute import Base, Point

MODES = ("grid", "zip")


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


def _apply_fixed(data: dict[str, Any], overrides: Sequence[str], where: str) -> tuple[Base, list[str]]:
    """The scenario's tables with each ``--set`` applied, and the keys they fix."""
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
    data = read_scenario_toml(path)
    file_axes, mode = axes_from_table(data.pop("sweep", {}), path)
    base, fixed = _apply_fixed(data, overrides, path)
    axes = merge_axes(file_axes, [axis_from_flag(f) for f in flags], fixed)
    points = expand(axes, "zip" if zip_mode else mode, path)
    return Plan(base=base, where=path, axes=axes, points=points)


def _label(point: Point) -> str:
    return " ".join(f"{key.split('.', 1)[1]}={value_text(value)}" for key, value in point)


def make_rows(plan: Plan, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point, in point order: ``point``, the swept keys, the figures (or ``error``)."""
    rows = []
    for i, (point, result) in enumerate(zip(plan.points, results, strict=True)):
        row: dict[str, Any] = {"point": i, **dict(point), "name": _label(point)}
        row.update(result)
        row.setdefault("error", "")
        rows.append(row)
    return rows


def value_text(value: Any) -> str:
    """A value as TOML writes it for booleans, as ``str`` otherwise (``repr`` round-trips floats)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)
