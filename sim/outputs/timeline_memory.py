"""The memory rows of the timeline (``sim.outputs.timeline``): one rank's memory as a stacked step
curve by category with its peak marked and broken down, the caching allocator's reserved and
active bytes and the device's whole use as lines, and a rank's total as one line for the
comparison table. Plotly figure kwargs only: nothing here imports plotly.
"""

from typing import Any

from sim.core.events import MemoryCategory
from sim.outputs.allocator import ReservedCurve
from sim.outputs.display import BYTES_PER_GIB, MS_PER_S, fmt_bytes
from sim.outputs.memory_curve import MemoryCurve

CATEGORY_COLOURS: dict[MemoryCategory, str] = {
    MemoryCategory.PARAMS: "#4C78A8",
    MemoryCategory.GRADS: "#F58518",
    MemoryCategory.OPTIMIZER: "#54A24B",
    MemoryCategory.ACTIVATIONS: "#B279A2",
    MemoryCategory.COMM_BUFFERS: "#72B7B2",
    MemoryCategory.OTHER: "#BAB0AC",
}


def curve_steps(curve: MemoryCurve, end_s: float) -> tuple[list[float], dict[MemoryCategory, list[float]]]:
    """The memory curve as a step plot: 0 B at 0 s, then every entry of the curve, held until
    ``end_s`` (entries at one instant are all drawn, so the peak the report names is on the plot)."""
    times = [0.0, *(float(x) for x in curve.times_s)]
    values = {c: [0.0, *(float(x) for x in v)] for c, v in curve.by_category.items()}
    if end_s > times[-1]:
        times.append(end_s)
        for c in values:
            values[c].append(values[c][-1])
    return times, values


def memory_traces(
    curve: MemoryCurve, end_s: float, label: str, row: int, visible: bool
) -> list[tuple[Any, int]]:
    """Stacked step curves by category (in GiB) and a marker on the peak, with its breakdown."""
    times, curves = curve_steps(curve, end_s)
    x = [t * MS_PER_S for t in times]
    used = [c for c in MemoryCategory if any(curves[c])]
    out: list[tuple[Any, int]] = []
    for c in used:
        y = [v / BYTES_PER_GIB for v in curves[c]]
        out.append(
            (
                dict(
                    type="scatter",
                    name=f"{c} ({label})",
                    x=x,
                    y=y,
                    mode="lines",
                    line=dict(shape="hv", width=0.5, color=CATEGORY_COLOURS[c]),
                    stackgroup=f"memory {label}",
                    legendgroup=f"memory {c}",
                    visible=visible,
                    hovertemplate=f"{c}: %{{y:.2f}} GiB at %{{x:.3f}} ms<extra>{label}</extra>",
                ),
                row,
            )
        )
    k = curve.peak_index() + 1 if len(curve.times_s) else 0  # +1: the step plot starts at 0 B
    at_peak = curve.at(curve.peak_index()) if len(curve.times_s) else dict.fromkeys(MemoryCategory, 0)
    total = curve.peak_bytes()
    breakdown = "<br>".join(f"{c}: {fmt_bytes(at_peak[c])}" for c in used)
    out.append(
        (
            dict(
                type="scatter",
                name=f"peak ({label})",
                x=[x[k]],
                y=[total / BYTES_PER_GIB],
                mode="markers+text",
                marker=dict(symbol="triangle-down", size=12, color="black"),
                text=[f"peak {fmt_bytes(total)}"],
                textposition="top center",
                visible=visible,
                showlegend=False,
                hovertext=[f"<b>peak {fmt_bytes(total)}</b> at {x[k]:.3f} ms ({label})<br>{breakdown}"],
                hoverinfo="text",
            ),
            row,
        )
    )
    return out


def reserved_traces(
    curve: ReservedCurve, overhead_bytes: int, end_s: float, label: str, row: int, visible: bool
) -> list[tuple[Any, int]]:
    """The reserved bytes as a step line, reserved + what lies outside the allocator (the
    device's whole use) as a second one, and the allocator's active bytes (dotted), all at the
    allocator's times and held until ``end_s``."""
    times = [0.0, *curve.times_s, end_s]
    reserved = [0, *curve.reserved_bytes, curve.reserved_bytes[-1] if curve.reserved_bytes else 0]
    x = [t * MS_PER_S for t in times]
    lines = [
        (f"reserved ({label})", [r / BYTES_PER_GIB for r in reserved], dict(color="#444444", dash="dash"))
    ]
    if overhead_bytes:
        whole = [(r + overhead_bytes) / BYTES_PER_GIB for r in reserved]
        lines.append((f"reserved + context + NCCL ({label})", whole, dict(color="#D62728", dash="dash")))
    if curve.active_bytes:  # the allocator's active blocks (record_stream frees held), at its times
        active = [0, *curve.active_bytes, curve.active_bytes[-1]]
        lines.append(
            (f"active ({label})", [a / BYTES_PER_GIB for a in active], dict(color="#444444", dash="dot"))
        )
    return [
        (
            dict(
                type="scatter",
                name=name,
                x=x,
                y=y,
                mode="lines",
                line=dict(shape="hv", width=1.5, **style),
                visible=visible,
                hovertemplate=f"{name.split(' (')[0]}: %{{y:.2f}} GiB at %{{x:.3f}} ms<extra>{label}</extra>",
            ),
            row,
        )
        for name, y, style in lines
    ]


def total_memory_trace(curve: MemoryCurve, end_s: float, label: str, row: int) -> tuple[Any, int]:
    """The total memory of a rank as one dashed step line (for the comparison table)."""
    times, curves = curve_steps(curve, end_s)
    y = [sum(v) / BYTES_PER_GIB for v in zip(*curves.values(), strict=True)]
    return (
        dict(
            type="scatter",
            name=f"total ({label})",
            x=[t * MS_PER_S for t in times],
            y=y,
            mode="lines",
            line=dict(shape="hv", dash="dash", color="black", width=1.5),
            hovertemplate=f"total %{{y:.2f}} GiB at %{{x:.3f}} ms<extra>{label}</extra>",
        ),
        row,
    )


def device_memory_trace(memory_bytes: int, end_s: float, row: int) -> tuple[Any, int]:
    """The device's memory, a dotted red line across the step."""
    return (
        dict(
            type="scatter",
            name=f"device memory {fmt_bytes(memory_bytes)}",
            x=[0, end_s * MS_PER_S],
            y=[memory_bytes / BYTES_PER_GIB] * 2,
            mode="lines",
            line=dict(color="red", dash="dot", width=2),
            hoverinfo="name",
        ),
        row,
    )
