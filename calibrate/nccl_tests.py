"""Parse nccl-tests outputs (NVIDIA/nccl-tests ``*_perf``) into measured curves.

Two formats, both written by ``src/util.cu`` of nccl-tests:

- the text table on stdout: a ``# Using devices`` block with one ``#  Rank N Group G Pid P on
  HOST device D [BUS] NAME`` line per rank, a two-line column header (``size count type redop
  root time algbw busbw #wrong time algbw busbw #wrong``; older releases lack ``root`` or
  ``redop``), one row per size with out-of-place then in-place results, times in µs, bandwidths
  in GB/s (1e9 B/s);
- the ``-J FILE`` JSON document (``"version": 2``): ``args`` (argv, whose first entry names the
  test binary), ``config`` (``nthreads``, ``ngpus``, ``devices``: one entry per process),
  ``results`` (``size``, ``count``, ``type``, ``redop``, ``root``, ``out_of_place`` and
  ``in_place`` objects of ``time`` µs, ``alg_bw``, ``bus_bw``, ``nwrong``, and with ``-I``
  ``*_per_iter`` objects of ``min_us``/``max_us``/``p50_us``).

``size`` is nccl-tests' size (all-gather output, reduce-scatter input, all-reduce buffer), the
same as ours. Which result is used: out-of-place for all-gather and reduce-scatter (FSDP's
collectives are out-of-place), in-place for all-reduce (torch's ``all_reduce`` is in-place);
the other one when that is missing. nccl-tests reports one average time per size: that is the
point's ``time_s`` (a mean, as ``calibrate comm`` records); its median, min and max are that
average unless per-iteration statistics are present.
"""

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate.fit import fit_curve
from calibrate.records import Curve, CurveKey, Point
from sim.errors import UserError

# nccl-tests' type names (src/common.cu test_typenames) -> fsdp-sim dtypes.
NCCL_TYPES = {"float": "fp32", "half": "fp16", "bfloat16": "bf16", "f8e4m3": "fp8", "f8e5m2": "fp8"}
_BINARIES = {
    "all_gather_perf": "all_gather",
    "reduce_scatter_perf": "reduce_scatter",
    "all_reduce_perf": "all_reduce",
    "alltoall_perf": "all_to_all",
}
_RANK_LINE = re.compile(r"^#\s*Rank\s+(\d+)\s+Group\s+(\d+)\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)")
_STARTING = re.compile(r"#\s*Collective test starting:\s*(\S+)")
_PREFERRED = {
    "all_gather": "out_of_place",
    "reduce_scatter": "out_of_place",
    "all_reduce": "in_place",
    "all_to_all": "out_of_place",  # torch's all_to_all_single takes separate buffers
}


@dataclass(frozen=True, kw_only=True)
class Row:
    size: int
    dtype_name: str
    time_us: float  # the average over the iterations
    median_us: float
    min_us: float
    max_us: float
    iters: int
    wrong: int | None


@dataclass(frozen=True, kw_only=True)
class NcclTestsRun:
    """One nccl-tests output file."""

    path: str
    collective: str
    ranks: int
    hosts: tuple[str, ...]
    device_name: str
    rows: tuple[Row, ...]
    nccl_version: str | None


def collective_from_name(text: str) -> str | None:
    """'all_gather' from 'build/all_gather_perf', 'all_gather_perf_mpi', 'ag-all_gather_perf.txt'..."""
    for binary, collective in _BINARIES.items():
        if binary in text:
            return collective
    return None


def _collective(path: Path, hints: list[str]) -> str:
    for text in [*hints, path.name]:
        found = collective_from_name(text)
        if found:
            return found
    raise UserError(
        f"{path}: cannot tell which collective this nccl-tests output measured; keep the "
        "'# Collective test starting: X_perf' line, or name the file after the binary (e.g. all_gather_perf.txt)"
    )


def _nccl_version(code: int) -> str:
    """NCCL_VERSION_CODE (major*10000 + minor*100 + patch for 2.9+) as 'major.minor.patch'."""
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}" if code >= 20900 else str(code)


def parse_file(path: str | Path) -> NcclTestsRun:
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e})") from None
    if text.lstrip().startswith("{"):
        return parse_json(text, path)
    return parse_text(text, path)


# ---- JSON (-J) --------------------------------------------------------------------------


def _json_row(r: dict[str, Any], collective: str, where: str, iters: int) -> Row:
    order = [
        _PREFERRED[collective],
        "in_place" if _PREFERRED[collective] == "out_of_place" else "out_of_place",
    ]
    which = next((k for k in order if isinstance(r.get(k), dict)), None)
    if which is None:
        raise UserError(f"{where}: result of size {r.get('size')} has neither out_of_place nor in_place")
    res = r[which]
    t = float(res.get("time", res.get("cpu_time", 0.0)))
    stats = r.get(f"{which}_per_iter")
    lo, hi, mid = (t, t, t)
    if isinstance(stats, dict):
        lo, hi, mid = float(stats["min_us"]), float(stats["max_us"]), float(stats["p50_us"])
    wrong = res.get("nwrong")
    return Row(
        size=int(r["size"]),
        dtype_name=str(r["type"]),
        time_us=t,
        median_us=mid,
        min_us=lo,
        max_us=hi,
        iters=int(r.get("actual_iterations", iters)),
        wrong=None if wrong is None or wrong == "nan" else int(float(wrong)),
    )


def parse_json(text: str, path: Path) -> NcclTestsRun:
    try:
        doc = json.loads(text)
        config, results = doc["config"], doc["results"]
        collective = _collective(path, [str(a) for a in doc.get("args", [])[:1]])
        devices = config.get("devices", [])
        ranks = len(devices) * int(config.get("nthreads", 1)) * int(config.get("ngpus", 1))
        iters = int(config.get("iterations", 1))
        rows = tuple(_json_row(r, collective, str(path), iters) for r in results)
        version = doc.get("nccl_version")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not an nccl-tests -J JSON output ({type(e).__name__}: {e})") from None
    return NcclTestsRun(
        path=str(path),
        collective=collective,
        ranks=ranks,
        hosts=tuple(sorted({str(d.get("hostname", "")) for d in devices})),
        device_name=str(devices[0].get("device_info", "unknown")) if devices else "unknown",
        rows=rows,
        nccl_version=_nccl_version(int(version)) if isinstance(version, int) else None,
    )


# ---- text table ---------------------------------------------------------------------------


def _header_columns(lines: list[str]) -> list[str] | None:
    """Column names from the '#  size  count  type ...' header line."""
    for line in lines:
        tokens = line.lstrip("#").split()
        if tokens[:2] == ["size", "count"]:
            return tokens
    return None


def _text_row(tokens: list[str], columns: list[str], collective: str, iters: int) -> Row:
    times = [i for i, c in enumerate(columns) if c in ("time", "cputime")]
    wrongs = [i for i, c in enumerate(columns) if c in ("#wrong", "error")]
    oop, ip = times[0], times[1] if len(times) > 1 else times[0]
    pick = oop if _PREFERRED[collective] == "out_of_place" else ip
    if tokens[pick] in ("N/A", ""):
        pick = ip if pick == oop else oop
    wrong_col = next((w for w in wrongs if w > pick), None)
    wrong_text = tokens[wrong_col] if wrong_col is not None else "N/A"
    t = float(tokens[pick])
    following = columns[pick + 1 :]
    end = following.index("time") if "time" in following else len(following)
    per_iter = {
        c: float(tokens[pick + 1 + i]) for i, c in enumerate(following[:end]) if c in ("i_min", "i_max")
    }
    return Row(
        size=int(tokens[0]),
        dtype_name=tokens[columns.index("type")],
        time_us=t,
        median_us=t,
        min_us=per_iter.get("i_min", t),
        max_us=per_iter.get("i_max", t),
        iters=iters,
        wrong=None if wrong_text == "N/A" or columns[wrong_col or 0] == "error" else int(float(wrong_text)),
    )


def parse_text(text: str, path: Path) -> NcclTestsRun:
    lines = text.splitlines()
    columns = _header_columns(lines)
    if columns is None:
        raise UserError(f"{path}: no nccl-tests result table (a '#  size  count  type ...' header) found")
    starting = [m.group(1) for line in lines if (m := _STARTING.search(line))]
    collective = _collective(path, starting)
    rank_lines = [(m, line) for line in lines if (m := _RANK_LINE.match(line))]
    if not rank_lines:
        raise UserError(f"{path}: no '#  Rank N ... on HOST device D' lines; cannot tell the number of ranks")
    iters_match = re.search(r"(?<!warmup )(?<!agg )\biters:\s*(\d+)", text)
    iters = int(iters_match.group(1)) if iters_match else 1
    # -S adds a timestamp column whose values are two tokens (date and time).
    widths = {len(columns), len(columns) + 1} if columns[-1] == "timestamp" else {len(columns)}
    rows = []
    for line in lines:
        tokens = line.split()
        if line.startswith("#") or len(tokens) not in widths or not tokens[0].isdigit():
            continue
        try:
            rows.append(_text_row(tokens, columns, collective, iters))
        except (ValueError, IndexError) as e:
            raise UserError(f"{path}: cannot read result row {line.strip()!r} ({e})") from None
    if not rows:
        raise UserError(f"{path}: the result table has no rows")
    version = re.search(r"nccl-library=(\d+)", text)
    first = rank_lines[0][1]
    return NcclTestsRun(
        path=str(path),
        collective=collective,
        ranks=len(rank_lines),
        hosts=tuple(sorted({m.group(4) for m, _ in rank_lines})),
        device_name=first.split("]", 1)[1].strip() if "]" in first else "unknown",
        rows=tuple(rows),
        nccl_version=_nccl_version(int(version.group(1))) if version else None,
    )


# ---- runs -> curves -----------------------------------------------------------------------


def curves_from_runs(runs: list[NcclTestsRun]) -> tuple[list[Curve], list[str]]:
    """One curve per (collective, ranks, dtype, spans-nodes); repeated sizes are averaged.

    Returns the curves and a list of skipped row types (dtypes fsdp-sim does not model).
    """
    grouped: dict[CurveKey, dict[int, list[Row]]] = {}
    sources: dict[CurveKey, set[str]] = {}
    skipped: set[str] = set()
    for run in runs:
        if run.ranks < 2:
            raise UserError(f"{run.path}: ran on {run.ranks} rank; a collective needs at least 2")
        for row in run.rows:
            dtype = NCCL_TYPES.get(row.dtype_name)
            if dtype is None:
                skipped.add(f"{run.path}: type {row.dtype_name}")
                continue
            nodes = max(1, len(run.hosts))
            key = CurveKey(
                collective=run.collective,
                group_size=run.ranks,
                dtype=dtype,
                spans_nodes=nodes > 1,
                ranks_per_node=run.ranks // nodes if run.ranks % nodes == 0 else None,
            )
            grouped.setdefault(key, {}).setdefault(row.size, []).append(row)
            sources.setdefault(key, set()).add(run.path)
    curves = []
    for key, by_size in grouped.items():
        points = tuple(_point(size, rows) for size, rows in sorted(by_size.items()) if size > 0)
        if not points:
            continue
        src = "nccl-tests: " + ", ".join(sorted(sources[key]))
        curves.append(Curve(key=key, points=points, fit=fit_curve(key, points), source=src))
    return curves, sorted(skipped)


def _point(size: int, rows: list[Row]) -> Point:
    wrongs = [r.wrong for r in rows if r.wrong is not None]
    return Point(
        bytes=size,
        time_s=sum(r.time_us * r.iters for r in rows) / sum(r.iters for r in rows) * 1e-6,
        median_s=statistics.median(r.median_us for r in rows) * 1e-6,
        min_s=min(r.min_us for r in rows) * 1e-6,
        max_s=max(r.max_us for r in rows) * 1e-6,
        iters=sum(r.iters for r in rows),
        wrong=sum(wrongs) if wrongs else None,
    )
