"""Predicted against measured: the side-by-side table of one validation."""

import statistics
from dataclasses import dataclass, field
from typing import Any

from sim.core.events import EventTable, MemoryCategory, OpKind
from sim.outputs.report import StepReport

PHASES = ("forward", "backward", "optimizer")


def simulated_phases(table: EventTable, rank: int = 0) -> dict[str, float]:
    """Forward, backward and optimizer time of one rank, split where a real run's timers split.

    Forward runs from a micro-batch's first op to its last forward op (``model(...)``); backward
    from there to its last op (``loss.backward()``, including the final callback's reductions).
    """
    ops = table.ops_of(rank)
    phases = dict.fromkeys(PHASES, 0.0)
    for mb in sorted({o.microbatch for o in ops}):
        mine = [o for o in ops if o.microbatch == mb and o.kind not in (OpKind.OPTIMIZER, OpKind.HOST)]
        forward_end = max(o.end_s for o in mine if o.kind is OpKind.FORWARD)
        phases["forward"] += forward_end - min(o.start_s for o in mine)
        phases["backward"] += max(o.end_s for o in mine) - forward_end
    phases["optimizer"] = sum(o.duration_s for o in ops if o.kind is OpKind.OPTIMIZER)
    return phases


@dataclass
class Row:
    metric: str
    predicted: float
    measured: float
    unit: str

    @property
    def error(self) -> float | None:
        """Signed relative error of the prediction."""
        return (self.predicted - self.measured) / self.measured if self.measured else None


@dataclass
class Comparison:
    rows: list[Row] = field(default_factory=list)
    collectives: list[dict[str, Any]] = field(default_factory=list)
    measured_step_s: dict[str, float] = field(default_factory=dict)

    @property
    def collectives_match(self) -> bool:
        return all(c["match"] for c in self.collectives)

    def error(self, metric: str) -> float | None:
        return next(r.error for r in self.rows if r.metric == metric)


def measured_step(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Median, min and max over steps of the slowest rank's step time (steps start at a barrier)."""
    per_step = [max(times) for times in zip(*(r["step_times_s"] for r in ranks), strict=True)]
    return {"median": statistics.median(per_step), "min": min(per_step), "max": max(per_step)}


def collective_waits(ranks: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(collective time, wait for the late rank) of rank 0 in the step every rank timed on the
    host (``timeline``, CPU runs): each collective counts from the last rank's arrival to rank
    0's end; the wait is from rank 0's arrival to the last rank's. None without such timelines
    (a GPU run, or DDP, whose reducer calls the backend below ``torch.distributed``)."""
    records = [r.get("timeline", {}).get("collectives") or [] for r in ranks]
    if not records[0] or any(len(r) != len(records[0]) for r in records):
        return None
    busy = wait = 0.0
    for calls in zip(*records, strict=True):
        last_arrival = max(start for _, start, _, _ in calls)
        _, start, end, _ = calls[0]
        busy += end - last_arrival
        wait += last_arrival - start
    return busy, wait


def simulated_waits(table: EventTable, rank: int = 0) -> tuple[float, float]:
    """The same two figures for a simulated rank: collective durations, and their waits (start
    after ready: the late rank, or the previous collective of the same group)."""
    ops = [o for o in table.ops_of(rank) if o.kind.is_collective]
    return sum(o.end_s - o.start_s for o in ops), sum(o.start_s - o.ready_s for o in ops)


def _time_rows(
    report: StepReport, table: EventTable, ranks: list[dict[str, Any]], measured_step_s: float, fsdp: bool
) -> list[Row]:
    """Step time and its phases; on a CPU FSDP2 run, the collectives' own time and the wait for the
    late rank (DDP's reducer calls the backend below ``torch.distributed``, so it has no such rows)."""
    rows = [Row("step time", report.step_time_s, measured_step_s, "s")]
    predicted_phases = simulated_phases(table)
    rows += [
        Row(phase, predicted_phases[phase], max(r["phases_s"][phase] for r in ranks), "s") for phase in PHASES
    ]
    measured_waits = collective_waits(ranks) if fsdp else None
    simulated_count = sum(1 for o in table.ops_of(0) if o.kind.is_collective)
    timed_count = len(ranks[0].get("timeline", {}).get("collectives") or [])
    if measured_waits is not None and timed_count == simulated_count:  # one step: noisier than the medians
        predicted_waits = simulated_waits(table)
        rows.append(Row("collectives, one step", predicted_waits[0], measured_waits[0], "s"))
        rows.append(Row("wait for the late rank, one step", predicted_waits[1], measured_waits[1], "s"))
    return rows


def memory_rows(report: StepReport, measured: dict[str, Any]) -> list[Row]:
    """The peak and its categories (each side at its own peak); on a GPU also the allocator's peak."""
    rows = [Row("peak memory", report.peak_memory_bytes, measured["total"], "B")]
    if "cuda_max_allocated" in measured:
        rows.append(
            Row("peak memory (allocator)", report.peak_memory_bytes, measured["cuda_max_allocated"], "B")
        )
    if "cuda_max_reserved" in measured:
        rows.append(Row("peak reserved", report.peak_reserved_bytes, measured["cuda_max_reserved"], "B"))
    rows += [
        Row(f"  {c.value}", report.memory_at_peak[c], measured.get(c.value, 0), "B") for c in MemoryCategory
    ]
    return rows


def _collective_rows(report: StepReport, real: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted against counted collectives, per kind that either side issued."""
    out = []
    for kind in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE):
        p = report.collectives.get(kind)
        p_count, p_bytes = (p.count, p.bytes) if p else (0, 0)
        m = real.get(kind.value, {"count": 0, "bytes": 0})
        if p_count or m["count"]:
            out.append(
                {
                    "collective": kind.value,
                    "predicted_count": p_count,
                    "measured_count": m["count"],
                    "predicted_bytes": p_bytes,
                    "measured_bytes": m["bytes"],
                    "match": p_count == m["count"] and p_bytes == m["bytes"],
                }
            )
    return out


def compare(
    report: StepReport, table: EventTable, ranks: list[dict[str, Any]], *, fsdp: bool = True
) -> Comparison:
    """The prediction against every rank's measurements. ``fsdp``: FSDP2 issues every collective
    through ``torch.distributed`` (timed on the host); DDP's reducer does not."""
    step = measured_step(ranks)
    peak_rank = max(ranks, key=lambda r: r["memory_peak"]["total"])["memory_peak"]
    return Comparison(
        rows=_time_rows(report, table, ranks, step["median"], fsdp) + memory_rows(report, peak_rank),
        collectives=_collective_rows(report, ranks[0]["collectives"]),
        measured_step_s=step,
    )


# a memory category this small a share of the measured peak has no relative error worth printing
# (DeepSpeed ZeRO-3's partitioned parameters: a few KiB its run counts as params at the peak)
SMALL_CATEGORY_SHARE = 0.01


def _error_text(row: Row, measured_peak: float | None) -> str:
    """The row's signed error; "n/a" where there is none, or for a memory category under
    ``SMALL_CATEGORY_SHARE`` of the measured peak."""
    small = (
        row.metric.startswith("  ") and measured_peak and row.measured < SMALL_CATEGORY_SHARE * measured_peak
    )
    return "n/a" if row.error is None or small else f"{row.error:+.1%}"


def _fmt(value: float, unit: str) -> str:
    return f"{value * 1e3:,.2f} ms" if unit == "s" else f"{value / 2**30:,.3f} GiB"


def format_markdown(title: str, comparison: Comparison) -> str:
    lines = [f"### {title}", "", "| metric | predicted | measured | error |", "|---|---|---|---|"]
    peak = next((r.measured for r in comparison.rows if r.metric == "peak memory"), None)
    for row in comparison.rows:
        err = _error_text(row, peak)
        lines.append(
            f"| {row.metric} | {_fmt(row.predicted, row.unit)} | {_fmt(row.measured, row.unit)} | {err} |"
        )
    s = comparison.measured_step_s
    if s:
        lines += [
            "",
            f"Measured step: median {s['median'] * 1e3:.2f} ms, min {s['min'] * 1e3:.2f}, max {s['max'] * 1e3:.2f}.",
        ]
    if not comparison.collectives:
        return "\n".join(lines)
    lines += [
        "",
        "| collective | predicted count | measured count | predicted bytes | measured bytes | match |",
        "|---|---|---|---|---|---|",
    ]
    for c in comparison.collectives:
        lines.append(
            f"| {c['collective']} | {c['predicted_count']} | {c['measured_count']} | {c['predicted_bytes']:,} | "
            f"{c['measured_bytes']:,} | {'yes' if c['match'] else 'NO'} |"
        )
    return "\n".join(lines)


def as_json(comparison: Comparison) -> dict[str, Any]:
    return {
        "rows": [
            {
                "metric": r.metric.strip(),
                "predicted": r.predicted,
                "measured": r.measured,
                "unit": r.unit,
                "error": r.error,
            }
            for r in comparison.rows
        ],
        "measured_step_s": comparison.measured_step_s,
        "collectives": comparison.collectives,
        "collectives_match": comparison.collectives_match,
    }
