"""Interactive plotly timeline of one simulated step (and sweep plots), as standalone offline HTML.

Everything is read from an ``EventTable``; the exposed-communication spans use the same definitions
as the report (``sim.outputs.intervals``). plotly is imported inside the writers only, so importing this
module costs nothing. Times are shown in milliseconds, memory in GiB; internal units stay s and bytes.

Layout of ``write_timeline_html``: on top one lane per (rank, stream) with one bar per op, coloured by
kind (WebGL ``Scattergl`` line segments separated by gaps, so thousands of ops stay fast); a thin grey
segment before a collective is its wait for the slowest rank; translucent red spans on the compute
lane mark exposed communication (a collective ran and the compute stream was empty). Below, on the
same time axis, the memory of one rank as a stacked step curve by category, its peak marked and
broken down in the hover, and the device memory as a line; on a CUDA device also the caching
allocator's reserved bytes and what the device holds in all (reserved + CUDA context + NCCL
buffers, the figure ``fits`` is judged on) as lines over the same step. With 16 ranks or more only representative
ranks are drawn (rank 0, the slowest, the fastest), with a selector that focuses one of them and shows
its memory. A comparison table is drawn as a second block of lanes on the same time axis.
The memory rows' traces are ``sim.outputs.timeline_memory``'s.
"""

import html
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.core.events import EventTable, OpKind, OpRecord, Stream
from sim.fileio import write_text_atomic
from sim.outputs.allocator import ReservedCurve
from sim.outputs.display import MS_PER_S, fmt_bytes
from sim.outputs.intervals import exposed_comm_intervals, step_time
from sim.outputs.memory_curve import MemoryCurve, memory_curves
from sim.outputs.timeline_memory import (
    device_memory_trace,
    memory_traces,
    reserved_traces,
    total_memory_trace,
)

REPRESENTATIVE_FROM = 16  # with this many ranks or more, draw only representative ranks
LANE_PX = 26
BAR_PX = 14
MEMORY_PX = 320

KIND_COLOURS: dict[OpKind, str] = {
    OpKind.FORWARD: "#4C78A8",
    OpKind.BACKWARD: "#F58518",
    OpKind.RECOMPUTE: "#B279A2",
    OpKind.OPTIMIZER: "#54A24B",
    OpKind.COPY: "#9D755D",
    OpKind.ALL_GATHER: "#72B7B2",
    OpKind.REDUCE_SCATTER: "#EECA3B",
    OpKind.ALL_REDUCE: "#FF9DA6",
    OpKind.ALL_TO_ALL: "#17BECF",
    OpKind.HOST: "#79706E",
    OpKind.OFFLOAD: "#E45756",
}
EXPOSED_COLOUR = "rgba(214, 39, 40, 0.35)"
WAIT_COLOUR = "rgba(120, 120, 120, 0.8)"
NAN = float("nan")


@dataclass(frozen=True, kw_only=True)
class ShownRank:
    """A job rank drawn in the timeline, the simulated rank whose records stand for it, and why."""

    rank: int
    sim_rank: int
    label: str


@dataclass(frozen=True, kw_only=True)
class Lanes:
    """The lanes of one table: y position of each (simulated rank, stream), tick labels, rank spans."""

    y: dict[tuple[int, Stream], int]
    ticks: list[tuple[int, str]]
    spans: dict[int, tuple[int, int]]  # simulated rank -> (first y, last y)


@dataclass(frozen=True, kw_only=True)
class DeviceLines:
    """What the memory row draws beyond the allocated tensors: the device's memory, and per rank
    the caching allocator's reserved curve and the bytes held outside it (context, NCCL)."""

    memory_bytes: int | None = None
    reserved_of: Callable[[int], ReservedCurve | None] | None = None
    overhead_of: Callable[[int], int] | None = None


def shown_ranks(
    table: EventTable, ops: dict[int, list[OpRecord]], memory_rank: int | None
) -> list[ShownRank]:
    """Ranks to draw: every simulated rank below ``REPRESENTATIVE_FROM`` ranks, else rank 0, the
    slowest and the fastest (by their last op's end), plus ``memory_rank`` when given."""
    sims = [r for r in table.simulated_ranks if r in ops] or table.simulated_ranks[:1]
    if len(sims) == 1 and table.world_size > 1:
        return [
            ShownRank(rank=0, sim_rank=sims[0], label=f"rank {sims[0]} (stands for all {table.world_size})")
        ]
    if table.world_size < REPRESENTATIVE_FROM:
        picks = [(r, "") for r in sims]
    else:
        finish = {r: max(o.end_s for o in ops[r]) for r in sims}
        picks = [
            (0, "rank 0"),
            (max(finish, key=finish.__getitem__), "slowest"),
            (min(finish, key=finish.__getitem__), "fastest"),
        ]
    if memory_rank is not None:
        picks.append((memory_rank, "memory"))
    roles: dict[int, list[str]] = {}
    for rank, role in picks:
        roles.setdefault(rank, [])
        if role and role != "rank 0" and role not in roles[rank]:
            roles[rank].append(role)
    return [
        ShownRank(
            rank=r,
            sim_rank=table.rank_of(r),
            label=f"rank {r}" + (f" ({', '.join(roles[r])})" if roles[r] else ""),
        )
        for r in roles
    ]


def layout_lanes(shown: Sequence[ShownRank], ops: dict[int, list[OpRecord]]) -> Lanes:
    """One lane per stream that each shown rank used, in ``Stream`` order, ranks top to bottom."""
    y: dict[tuple[int, Stream], int] = {}
    ticks: list[tuple[int, str]] = []
    spans: dict[int, tuple[int, int]] = {}
    for shown_rank in shown:
        used = {o.stream for o in ops.get(shown_rank.sim_rank, [])}
        first = len(ticks)
        for stream in (s for s in Stream if s in used):
            y[(shown_rank.sim_rank, stream)] = len(ticks)
            ticks.append((len(ticks), f"{shown_rank.label} · {stream}"))
        spans[shown_rank.sim_rank] = (first, max(first, len(ticks) - 1))
    return Lanes(y=y, ticks=ticks, spans=spans)


def op_hover(op: OpRecord) -> str:
    """Hover text of one bar: op, unit, bytes, start, duration and, for a collective, its wait."""
    lines = [
        f"<b>{op.name}</b> ({op.kind})",
        f"unit: {op.unit} · microbatch {op.microbatch}",
        f"start {op.start_s * MS_PER_S:.3f} ms · duration {op.duration_s * MS_PER_S:.3f} ms",
    ]
    if op.kind.is_collective:
        lines.append(f"{fmt_bytes(op.bytes)} over {op.group_size} ranks")
        if op.algorithm:
            how = " · ".join(
                x for x in (op.algorithm, op.protocol, f"{op.channels} channels" if op.channels else "") if x
            )
            lines.append(f"algorithm: {how}")
        lines.append(f"waited {(op.start_s - op.ready_s) * MS_PER_S:.3f} ms for the slowest rank")
    return "<br>".join(lines)


def segments(
    spans: Iterable[tuple[float, float, int, str]],
) -> tuple[list[float], list[float], list[str]]:
    """Line-segment arrays for ``Scattergl``: each (start_s, end_s, y, hover) becomes three vertices
    (start, middle, end, so the hover is found anywhere along the bar) and a gap."""
    xs: list[float] = []
    ys: list[float] = []
    texts: list[str] = []
    for start, end, y, text in spans:
        a, b = start * MS_PER_S, end * MS_PER_S
        xs += [a, (a + b) / 2, b, NAN]
        ys += [y, y, y, NAN]
        texts += [text, text, text, ""]
    return xs, ys, texts


def bar_traces(
    table_ops: dict[int, list[OpRecord]], lanes: Lanes, row: int, legend: bool, prefix: str
) -> list[tuple[Any, int]]:
    """(trace kwargs, row) for the op bars (one Scattergl per kind), the waits and the exposed spans."""
    lane_ops = [o for r in lanes.spans for o in table_ops.get(r, [])]
    out: list[tuple[Any, int]] = []
    for kind in OpKind:
        spans = [
            (o.start_s, o.end_s, lanes.y[(o.rank, o.stream)], op_hover(o)) for o in lane_ops if o.kind is kind
        ]
        if spans:
            x, y, text = segments(spans)
            out.append((_line(f"{prefix}{kind}", x, y, text, KIND_COLOURS[kind], BAR_PX, kind, legend), row))
    waits = [
        (
            o.ready_s,
            o.start_s,
            lanes.y[(o.rank, o.stream)],
            f"{o.name}: waited {(o.start_s - o.ready_s) * MS_PER_S:.3f} ms for the slowest rank",
        )
        for o in lane_ops
        if o.kind.is_collective and o.start_s > o.ready_s
    ]
    if waits:
        out.append(
            (_line(f"{prefix}wait for slowest rank", *segments(waits), WAIT_COLOUR, 3, "wait", legend), row)
        )
    exposed = [
        (a, b, lanes.y[(r, Stream.COMPUTE)], f"exposed communication {(b - a) * MS_PER_S:.3f} ms")
        for r in lanes.spans
        if (r, Stream.COMPUTE) in lanes.y
        for a, b in exposed_comm_intervals(table_ops.get(r, []))
    ]
    if exposed:
        trace = _line(
            f"{prefix}exposed communication",
            *segments(exposed),
            EXPOSED_COLOUR,
            BAR_PX + 8,
            "exposed",
            legend,
        )
        out.insert(0, (trace, row))  # drawn first, under the bars
    return out


def _line(
    name: str, x: list, y: list, text: list, colour: str, width: float, group: str, legend: bool
) -> dict:
    """Kwargs of one Scattergl line-segment trace."""
    return dict(
        type="scattergl",
        name=name,
        x=x,
        y=y,
        mode="lines",
        hovertext=text,
        hoverinfo="text",
        line=dict(color=colour, width=width),
        legendgroup=str(group),
        showlegend=legend,
        connectgaps=False,
    )


def default_memory_rank(shown: Sequence[ShownRank], curves: dict[int, MemoryCurve]) -> int:
    """The shown simulated rank whose total memory peaks highest."""
    return max((s.sim_rank for s in shown), key=lambda r: curves[r].peak_bytes())


@dataclass
class Panel:
    """One table's lanes, ready to draw."""

    label: str
    table: EventTable
    ops: dict[int, list[OpRecord]]
    memory: dict[int, MemoryCurve]
    shown: list[ShownRank]
    lanes: Lanes


def make_panel(label: str, table: EventTable, memory_rank: int | None) -> Panel:
    ops = table.ops_by_rank
    shown = shown_ranks(table, ops, memory_rank)
    return Panel(label, table, ops, memory_curves(table), shown, layout_lanes(shown, ops))


def lane_axis(lanes: Lanes, span: tuple[int, int] | None = None) -> dict[str, Any]:
    """A lane y-axis: one tick per lane, top to bottom, showing ``span`` (default: all lanes)."""
    first, last = span if span is not None else (0, len(lanes.ticks) - 1)
    return dict(
        tickvals=[t for t, _ in lanes.ticks],
        ticktext=[s for _, s in lanes.ticks],
        range=[last + 0.6, first - 0.6],
        zeroline=False,
        showgrid=False,
        fixedrange=False,
    )


def timeline_figure(
    table: EventTable,
    *,
    title: str,
    memory_rank: int | None = None,
    compare: tuple[str, EventTable] | None = None,
    device: DeviceLines | None = None,
) -> Any:
    """The plotly figure behind ``write_timeline_html`` (see the module docstring for its layout)."""
    from plotly.subplots import make_subplots

    panels = [make_panel(title, table, memory_rank)]
    if compare is not None:
        panels.append(make_panel(compare[0], compare[1], None))
    end_s = max(step_time(p.table) for p in panels)
    heights = [len(p.lanes.ticks) * LANE_PX + 40 for p in panels] + [MEMORY_PX]
    titles = [
        f"{p.label}: step {step_time(p.table) * MS_PER_S:.2f} ms, {p.table.world_size} ranks" for p in panels
    ]
    fig = make_subplots(
        rows=len(heights),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=60 / sum(heights),
        row_heights=[h / sum(heights) for h in heights],
        subplot_titles=[*titles, "memory (GiB), peak marked"],
    )
    traces: list[tuple[Any, int]] = []
    for i, panel in enumerate(panels):
        traces += bar_traces(
            panel.ops, panel.lanes, i + 1, legend=i == 0, prefix="" if i == 0 else f"{panel.label}: "
        )
    mem_row = len(panels) + 1
    main = panels[0]
    chosen = (
        main.table.rank_of(memory_rank)
        if memory_rank is not None
        else default_memory_rank(main.shown, main.memory)
    )
    memory_of = _memory_panel(traces, panels, chosen, device or DeviceLines(), end_s, mem_row)
    for trace, row in traces:
        fig.add_trace(trace, row=row, col=1)
    for i, panel in enumerate(panels):
        fig.update_yaxes(lane_axis(panel.lanes), row=i + 1, col=1)
    fig.update_yaxes(title_text="GiB", rangemode="tozero", row=mem_row, col=1)
    fig.update_xaxes(title_text="time (ms)", range=[0, end_s * MS_PER_S * 1.01], row=mem_row, col=1)
    fig.update_layout(
        title=dict(text=title),
        height=sum(heights) + 160,
        hovermode="closest",
        hoverdistance=-1,
        legend=dict(orientation="h", yanchor="top", y=-60 / sum(heights), x=0),
        margin=dict(l=260, r=30, t=90, b=150),
        template="plotly_white",
    )
    if len(main.shown) > 1:
        fig.update_layout(updatemenus=[rank_selector(main, memory_of, chosen)])
    return fig


def _memory_panel(
    traces: list[tuple[Any, int]],
    panels: list[Panel],
    chosen: int,
    device: DeviceLines,
    end_s: float,
    mem_row: int,
) -> dict[int, list[int]]:
    """The memory row's traces, appended to ``traces``: each shown rank's curves (``chosen``'s
    visible) with its reserved memory where known, each compared run's total, the device's
    memory; returns each shown rank's trace indices (for the rank selector)."""
    main = panels[0]
    memory_of: dict[int, list[int]] = {}
    for s in main.shown:
        first, visible = len(traces), s.sim_rank == chosen
        traces += memory_traces(main.memory[s.sim_rank], end_s, s.label, mem_row, visible)
        reserved = device.reserved_of(s.sim_rank) if device.reserved_of is not None else None
        if reserved is not None:
            overhead = device.overhead_of(s.sim_rank) if device.overhead_of is not None else 0
            traces += reserved_traces(reserved, overhead, end_s, s.label, mem_row, visible)
        memory_of[s.sim_rank] = list(range(first, len(traces)))
    for p in panels[1:]:
        other = default_memory_rank(p.shown, p.memory)
        traces.append(total_memory_trace(p.memory[other], end_s, f"{p.label}, rank {other}", mem_row))
    if device.memory_bytes is not None:
        traces.append(device_memory_trace(device.memory_bytes, end_s, mem_row))
    return memory_of


def rank_selector(panel: Panel, memory_of: dict[int, list[int]], chosen: int) -> dict[str, Any]:
    """Dropdown: all shown ranks (memory of ``chosen``), or one rank's lanes and its memory."""
    mem_traces = [i for idx in memory_of.values() for i in idx]

    def button(label: str, focus: int | None, span: tuple[int, int] | None) -> dict[str, Any]:
        visible = [i in memory_of.get(focus, []) for i in mem_traces] if focus is not None else []
        axis = lane_axis(panel.lanes, span)
        return dict(
            label=label,
            method="update",
            args=[{"visible": visible}, {"yaxis.range": axis["range"]}, mem_traces],
        )

    buttons = [button("all shown ranks", chosen, None)]
    buttons += [button(s.label, s.sim_rank, panel.lanes.spans[s.sim_rank]) for s in panel.shown]
    return dict(
        buttons=buttons, direction="down", x=0, xanchor="left", y=1.0, yanchor="bottom", pad=dict(b=40)
    )


def write_timeline_html(
    table: EventTable,
    path: str | Path,
    *,
    title: str,
    memory_rank: int | None = None,
    compare: tuple[str, EventTable] | None = None,
    device: DeviceLines | None = None,
) -> None:
    """Write the step timeline of ``table`` as one standalone HTML file (plotly.js embedded), atomically.

    ``memory_rank`` picks the rank whose memory is drawn (default: the drawn rank with the highest
    peak); ``compare`` = (label, table) adds a second table on the same time axis;
    ``device`` draws the device's memory as a line and, per drawn rank, its reserved bytes and
    whole use (``DeviceLines``).
    """
    fig = timeline_figure(table, title=title, memory_rank=memory_rank, compare=compare, device=device)
    write_text_atomic(path, standalone_html(fig, f"fsdp-sim timeline: {title}"))


def standalone_html(fig: Any, title: str) -> str:
    """One offline HTML page (plotly.js embedded) with ``title`` as its ``<title>``."""
    page = fig.to_html(include_plotlyjs=True, full_html=True, config={"displaylogo": False})
    return str(page).replace("<head>", f"<head><title>{html.escape(title)}</title>", 1)
