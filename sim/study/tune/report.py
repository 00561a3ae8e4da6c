"""What ``fsdpsim tune`` prints: the top configurations, why each wins, the best per choice, and
for a scenario where nothing fits, the cheapest change that makes it fit. Table or JSON."""

from collections.abc import Callable, Sequence
from typing import Any

from sim.outputs.display import gib
from sim.study.tune.fix import ChangeResult, cheapest
from sim.study.tune.search import Evaluated, Status
from sim.study.tune.space import Candidate
from sim.study.tune.tuner import TuneOutcome

DIMENSIONS: dict[str, Callable[[Candidate], object]] = {
    "strategy": lambda c: c.strategy.value,
    "wrap": lambda c: c.wrap.value,
    "micro_batch": lambda c: c.micro_batch,
    "checkpointing": lambda c: c.checkpointing.value,
    "prefetch": lambda c: f"{c.forward_prefetch}/{c.backward_prefetch}",
}

WHERE = {
    "compute_s": "compute-stream work (kernels, FSDP2 copies)",
    "exposed_comm_s": "exposed communication",
    "idle_s": "idle time",
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def why(e: Evaluated, limit_bytes: float, first: Evaluated | None) -> str:
    """What the step is made of (compute share, exposed communication, what dominates the peak);
    for a runner-up, where its extra time goes against ``first``."""
    assert e.report is not None
    r, step = e.report, e.step_time_s
    b = r.breakdown
    comm_s = sum(c.time_s for c in r.collectives.values())
    hidden = 1.0 - b.exposed_comm_s / comm_s if comm_s > 0 else 1.0
    memory = r.memory_at_peak
    dominant = max(sorted(memory), key=lambda k: memory[k])
    parts = [
        f"compute {b.compute_s / step:.0%} of the step",
        f"exposed comm {_ms(b.exposed_comm_s)} ({hidden:.0%} of {_ms(comm_s)} of collectives hidden)",
        f"peak {gib(e.required_bytes)}, mostly {dominant.value} ({memory[dominant] / e.required_bytes:.0%})",
        f"{gib(limit_bytes - e.required_bytes)} under the limit",
    ]
    if first is not None and first is not e:
        assert first.report is not None
        fb = first.report.breakdown
        deltas = {k: getattr(b, k) - getattr(fb, k) for k in WHERE}
        main = max(sorted(deltas), key=lambda k: deltas[k])
        parts.append(f"+{_ms(step - first.step_time_s)} vs #1, mostly {WHERE[main]} (+{_ms(deltas[main])})")
    return "; ".join(parts)


def choice_summary(
    evaluated: Sequence[Evaluated], pick: Callable[[Candidate], object], limit: float
) -> list[str]:
    """Per value of one dimension: its best fitting simulated step time, else why it has none."""
    groups: dict[object, list[Evaluated]] = {}
    for e in evaluated:
        groups.setdefault(pick(e.candidate), []).append(e)
    return [f"{value}: {_group_text(members, limit)}" for value, members in groups.items()]


def _group_text(members: Sequence[Evaluated], limit: float) -> str:
    fitting = [e.step_time_s for e in members if e.fits(limit)]
    if fitting:
        return _ms(min(fitting))
    slower = [e.time_bound_s for e in members if e.status is Status.PRUNED_TIME]
    if slower:
        return f">= {_ms(min(slower))} (bound, not simulated)"
    peaks = [e.required_bytes for e in members if e.report is not None]
    if peaks:
        return f"none fits (smallest peak {gib(min(peaks))})"
    bounds = [e.memory_bound_bytes for e in members if e.status is Status.PRUNED_MEMORY]
    return f"none fits (>= {gib(min(bounds))})" if bounds else "invalid"


def command(o: TuneOutcome, sets: Sequence[str]) -> str:
    return " ".join(["fsdpsim run", o.path, *(f"--set {s}" for s in [*o.user_sets, *sets])])


def _header(o: TuneOutcome) -> list[str]:
    s, res = o.scenario, o.result
    n_fit = sum(e.fits(o.limit_bytes) for e in res.evaluated)
    calibrated = "" if o.profile.calibrated else " (datasheet, not calibrated)"
    return [
        f"tune          {o.path}",
        f"model         {s.model.name}, {s.parallel.world_size} ranks ({s.gpus_per_node} per node), "
        f"profile {o.profile.name}{calibrated}",
        f"batch         {o.global_batch:,} sequences x {s.training.seq_len:,} tokens per step, kept by every "
        "configuration (micro-batch x accumulation x ranks)",
        f"fits          peak <= {gib(o.limit_bytes)} ({gib(o.profile.device.memory_bytes)} device, "
        f"margin {o.margin:.0%})",
        f"search        {len(res.evaluated)} configurations: {res.count(Status.PRUNED_MEMORY)} pruned by the "
        f"memory bound, {res.count(Status.PRUNED_TIME)} by the step-time bound, "
        f"{res.count(Status.SIMULATED)} simulated ({n_fit} fit), {res.count(Status.INVALID)} invalid",
        *(f"note          {n}" for n in o.notes),
        "",
        f"file's config {_summary(o.baseline, o.limit_bytes)}",
    ]


def _summary(e: Evaluated, limit: float) -> str:
    assert e.report is not None
    fit = "fits" if e.fits(limit) else f"does not fit by {gib(e.required_bytes - limit)}"
    return (
        f"{e.candidate.label()}: {_ms(e.step_time_s)}, {e.report.tokens_per_s:,.0f} tokens/s, "
        f"peak {gib(e.required_bytes)} ({fit})"
    )


def _top_lines(o: TuneOutcome) -> list[str]:
    top, base = o.result.top, o.baseline
    lines = [
        f" #  {'configuration':<44}{'step':>12}{'tokens/s':>12}{'vs file':>9}{'peak':>12}{'exposed':>12}"
    ]
    for i, e in enumerate(top, 1):
        assert e.report is not None
        gain = e.report.tokens_per_s / base.report.tokens_per_s - 1 if base.report else 0.0
        lines.append(
            f"{i:>2}  {e.candidate.label():<44}{_ms(e.step_time_s):>12}{e.report.tokens_per_s:>12,.0f}"
            f"{gain:>+9.1%}{gib(e.required_bytes):>12}{_ms(e.report.breakdown.exposed_comm_s):>12}"
        )
    lines += ["", "why"]
    lines += [f"{i:>2}  {why(e, o.limit_bytes, top[0])}" for i, e in enumerate(top, 1)]
    lines += ["", "best per choice (fastest fitting simulated configuration)"]
    for name, pick in DIMENSIONS.items():
        lines.append(f"  {name:<14}" + " | ".join(choice_summary(o.result.evaluated, pick, o.limit_bytes)))
    lines += ["", f"reproduce #1  {command(o, top[0].candidate.overrides())}"]
    return lines


def _change_text(r: ChangeResult, limit: float) -> str:
    if r.error:
        return f"{r.change.what}: invalid ({r.error})"
    if r.best is None:
        return f"{r.change.what} [{r.change.cost}]: does not fit (memory lower bound {gib(r.memory_bound_bytes)}), not simulated"
    return f"{r.change.what} [{r.change.cost}]: {_summary(r.best, limit)}"


def _no_fit_lines(o: TuneOutcome) -> list[str]:
    lines = ["NOTHING FITS: no configuration keeps the peak under the limit."]
    if o.closest is not None:
        lines.append(f"closest       {_summary(o.closest, o.limit_bytes)}")
    lines += ["", "changes tried (cheapest first; each simulated at its smallest-memory configurations)"]
    lines += [f"  {_change_text(r, o.limit_bytes)}" for r in o.changes]
    best = cheapest(o.changes)
    if best is None:
        lines += ["", "no single change among these makes it fit"]
        return lines
    lines += [
        "",
        f"cheapest fix  {best.change.what} ({best.change.cost})"
        + ("" if best.global_batch == o.global_batch else f"; global batch becomes {best.global_batch}"),
        f"apply         {command(o, best.overrides)}",
        f"then          fsdpsim tune {o.path} "
        + " ".join(f"--set {s}" for s in [*o.user_sets, *best.change.overrides])
        + "   (the fastest configuration with the change)",
    ]
    return lines


def format_table(o: TuneOutcome) -> str:
    body = _top_lines(o) if o.result.top else _no_fit_lines(o)
    return "\n".join([*_header(o), "", *body])


def _entry(e: Evaluated, limit: float, first: Evaluated | None) -> dict[str, Any]:
    assert e.report is not None
    r = e.report.to_json()
    keys = (
        "step_time_s",
        "tokens_per_s",
        "tokens_per_s_per_gpu",
        "mfu",
        "hfu",
        "breakdown_s",
        "peak_memory_bytes",
        "memory_at_peak_bytes",
        "model_state_bytes",
        "collectives",
    )
    return {
        "config": e.candidate.as_dict(),
        "overrides": list(e.candidate.overrides()),
        **{k: r[k] for k in keys},
        "required_bytes": e.required_bytes,
        "fits": e.fits(limit),
        "why": why(e, limit, first) if e.fits(limit) else None,
    }


def to_json(o: TuneOutcome) -> dict[str, Any]:
    """The whole answer as one JSON object (stable keys, deterministic order)."""
    res, limit = o.result, o.limit_bytes
    top = [_entry(e, limit, res.top[0]) for e in res.top]
    best = cheapest(o.changes)
    return {
        "scenario": o.path,
        "overrides": list(o.user_sets),
        "global_batch": o.global_batch,
        "margin": o.margin,
        "device_memory_bytes": o.profile.device.memory_bytes,
        "limit_bytes": limit,
        "counts": {
            "candidates": len(res.evaluated),
            **{s.value: res.count(s) for s in Status},
            "fit": sum(e.fits(limit) for e in res.evaluated),
        },
        "baseline": _entry(o.baseline, limit, None),
        "top": top,
        "best_per_choice": {
            name: choice_summary(res.evaluated, pick, limit) for name, pick in DIMENSIONS.items()
        },
        "fits": bool(res.top),
        "closest": _entry(o.closest, limit, None) if o.closest else None,
        "changes": [_change_json(r, limit) for r in o.changes],
        "suggestion": _change_json(best, limit) if best else None,
        "notes": list(o.notes),
    }


def _change_json(r: ChangeResult, limit: float) -> dict[str, Any]:
    return {
        "change": r.change.what,
        "cost": r.change.cost,
        "fits": r.fits,
        "global_batch": r.global_batch,
        "overrides": list(r.overrides),
        "memory_lower_bound_bytes": r.memory_bound_bytes,
        "peak_memory_bytes": r.best.report.peak_memory_bytes if r.best and r.best.report else None,
        "required_bytes": r.best.required_bytes if r.best else None,
        "step_time_s": r.best.step_time_s if r.best else None,
        "error": r.error,
    }
