"""What a sweep writes (each file atomically): ``sweep.csv`` in seconds and bytes, ``sweep.md``
(also printed) in milliseconds and GiB, and ``sweep.html`` (``sim.study.sweep.plots``)."""

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.fileio import write_text_atomic
from sim.outputs.display import BYTES_PER_GIB, MS_PER_S
from sim.study.sweep.plan import Axis, value_text
from sim.study.sweep.plots import write_sweep_plots

METRICS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_bytes", "fits")
"""Figures of every row, after the point number and the swept keys; ``error`` comes last."""


def csv_text(rows: Sequence[dict[str, Any]], axes: Sequence[Axis]) -> str:
    """``point``, the swept keys, ``METRICS`` in seconds and bytes, ``error``; empty figures for errors."""
    columns = ["point", *(a.key for a in axes), *METRICS, "error"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([value_text(row.get(c)) for c in columns])
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
        cells = [str(row["point"]), *(value_text(row[a.key]) for a in axes)]
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
    write_sweep_plots(valid, html)
    return [*written, html]
