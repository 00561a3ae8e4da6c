"""Sweep plots: step time against peak memory with the Pareto front, and the step-time breakdown.

Plotly is imported only inside the writers.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.fileio import write_text_atomic
from sim.outputs.display import BYTES_PER_GIB, MS_PER_S, fmt_bytes
from sim.outputs.timeline import standalone_html


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (smaller is better), by the first."""
    front: list[int] = []
    best = float("inf")
    for i in sorted(range(len(points)), key=lambda i: points[i]):
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


SWEEP_BREAKDOWN = (("compute", "#4C78A8"), ("exposed_comm", "#E45756"), ("idle", "#BAB0AC"))
WRAP_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star")


def sweep_figure(rows: Sequence[dict[str, Any]]) -> Any:
    """Step time against peak memory (Pareto front, device memory) above a stacked breakdown per run."""
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2,
        cols=1,
        vertical_spacing=0.16,
        subplot_titles=(
            "step time vs peak memory (Pareto front dashed)",
            "step-time breakdown per configuration",
        ),
    )
    _add_points(fig, rows)
    _add_pareto_front(fig, rows)
    for device in sorted({r["device_memory_bytes"] for r in rows if r.get("device_memory_bytes")}):
        fig.add_vline(
            x=device / BYTES_PER_GIB,
            line=dict(color="red", dash="dot"),
            row=1,
            col=1,
            annotation_text=f"device {fmt_bytes(device)}",
        )
    _add_breakdown(fig, rows)
    fig.update_xaxes(title_text="peak memory (GiB)", row=1, col=1)
    fig.update_yaxes(title_text="step time (ms)", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_layout(barmode="stack", height=900, template="plotly_white", title=dict(text="sweep"))
    return fig


def _add_points(fig: Any, rows: Sequence[dict[str, Any]]) -> None:
    """One marker per configuration in the top panel: colour by strategy, symbol by wrap."""
    from plotly.colors import qualitative

    strategies = sorted({str(r["strategy"]) for r in rows})
    wraps = sorted({str(r["wrap"]) for r in rows})
    for (strategy, wrap), group in _groups(rows).items():
        fig.add_trace(
            dict(
                type="scatter",
                mode="markers",
                name=f"{strategy} · {wrap}",
                x=[r["peak_memory_bytes"] / BYTES_PER_GIB for r in group],
                y=[r["step_time_s"] * MS_PER_S for r in group],
                marker=dict(
                    size=11,
                    color=qualitative.Plotly[strategies.index(strategy) % 10],
                    symbol=WRAP_SYMBOLS[wraps.index(wrap) % len(WRAP_SYMBOLS)],
                ),
                text=[r["name"] for r in group],
                hovertemplate="%{text}<br>peak %{x:.2f} GiB · step %{y:.2f} ms<extra></extra>",
            ),
            row=1,
            col=1,
        )


def _add_pareto_front(fig: Any, rows: Sequence[dict[str, Any]]) -> None:
    """The configurations no other beats in both step time and peak memory, as a dashed staircase."""
    points = [(r["peak_memory_bytes"], r["step_time_s"]) for r in rows]
    front = [rows[i] for i in pareto_front(points)]
    fig.add_trace(
        dict(
            type="scatter",
            mode="lines",
            name="Pareto front",
            line=dict(color="black", dash="dash", shape="hv"),
            x=[r["peak_memory_bytes"] / BYTES_PER_GIB for r in front],
            y=[r["step_time_s"] * MS_PER_S for r in front],
            hoverinfo="skip",
        ),
        row=1,
        col=1,
    )


def _add_breakdown(fig: Any, rows: Sequence[dict[str, Any]]) -> None:
    """The bottom panel: each configuration's step time stacked by part (compute, exposed, idle)."""
    for key, colour in SWEEP_BREAKDOWN:
        fig.add_trace(
            dict(
                type="bar",
                name=key,
                x=[r["name"] for r in rows],
                y=[r["breakdown_s"][key] * MS_PER_S for r in rows],
                marker=dict(color=colour),
                hovertemplate=f"%{{x}}<br>{key} %{{y:.2f}} ms<extra></extra>",
            ),
            row=2,
            col=1,
        )


def _groups(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["strategy"]), str(r["wrap"])), []).append(r)
    return groups


def write_sweep_plots(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write the sweep plots of ``rows`` as one standalone HTML file, atomically.

    Each row has ``name``, ``strategy``, ``wrap``, ``step_time_s``, ``peak_memory_bytes``,
    ``device_memory_bytes`` and ``breakdown_s`` (``compute``, ``exposed_comm``, ``idle``, seconds).
    """
    if not rows:
        raise ValueError("write_sweep_plots needs at least one run")
    fig = sweep_figure(rows)
    write_text_atomic(path, standalone_html(fig, "fsdp-sim sweep"))
