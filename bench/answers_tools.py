"""The README's ``fsdpsim sweep`` and ``fsdpsim tune`` examples, recomputed (``bench.answers``
writes them between their markers): the strategy sweep's best configuration against FULL_SHARD
and HYBRID_SHARD, the tuner's #1 on one node and the cheapest fix where nothing fits.
"""

import re

from bench.answer_kit import NODE_7B, ROOT, SCALEOUT, claim, n, para, pct, scenario, t, world_busbw
from sim.outputs.display import gib
from sim.study.sweep.execute import run_points
from sim.study.sweep.plan import make_plan, make_rows
from sim.study.tune.fix import cheapest
from sim.study.tune.search import SearchResult, Status
from sim.study.tune.space import Candidate
from sim.study.tune.tuner import TuneOutcome, tune
from sim.workload.options import CheckpointMode

SWEEP = "scenarios/sweep-7b-strategies.toml"


def sweep_example() -> str:
    plan = make_plan(str(ROOT / SWEEP), [], [], False)
    rows = make_rows(plan, run_points(plan.base, plan.where, plan.points, jobs=1))
    fitting = [r for r in rows if not r["error"] and r["fits"]]
    best = max(fitting, key=lambda r: r["tokens_per_s"])
    same = ("checkpointing.mode", "training.micro_batch")
    full = next(
        r for r in rows if r["parallel.strategy"] == "FULL_SHARD" and all(r[k] == best[k] for k in same)
    )
    s = scenario(SWEEP)
    nodes = s.parallel.world_size // s.gpus_per_node
    hybrid = next(
        r for r in rows if r["parallel.strategy"] == "HYBRID_SHARD" and all(r[k] == best[k] for k in same)
    )
    claim(best["parallel.strategy"] == "SHARD_GRAD_OP", "the most tokens/s that still fits: SHARD_GRAD_OP")
    claim(best["checkpointing.mode"] == "none", "no checkpointing")
    claim(
        full["tokens_per_s"] < best["tokens_per_s"] and hybrid["tokens_per_s"] < best["tokens_per_s"],
        "FULL_SHARD and HYBRID_SHARD ... get less",
    )
    claim(nodes == 2, "FULL_SHARD across both nodes")
    return para(
        f"""`{SWEEP}` asks which strategy, checkpointing mode and micro-batch give Llama-2-7B on
        {s.parallel.world_size} H100s the most tokens/s that still fits: SHARD_GRAD_OP (ZeRO-2: no
        re-gather in backward), no checkpointing, micro-batch {best["training.micro_batch"]}:
        {n(best["tokens_per_s"])} tokens/s at {gib(best["peak_memory_bytes"])}; with the same
        settings FULL_SHARD across both nodes gets {n(full["tokens_per_s"])} at
        {gib(full["peak_memory_bytes"])} and HYBRID_SHARD (shard within each node) {n(hybrid["tokens_per_s"])}
        at {gib(hybrid["peak_memory_bytes"])}: rings over all eight 400 Gb/s NICs of a DGX H100 node
        (NCCL's model: {world_busbw(SWEEP) / 1e9:.0f} GB/s bus bandwidth for a 1 GiB all-gather
        over the 16 ranks) let the inter-node all-gathers hide behind compute, and HSDP's extra
        all-reduce is not repaid."""
    )


def _describe(c: Candidate, brief: bool = False) -> str:
    """``SHARD_GRAD_OP, linear wrap, micro-batch 2``; accumulation, checkpointing and prefetch
    only when they are not the defaults; ``brief``: ``FULL_SHARD, linear, checkpointing`` (no
    micro-batch when it is 1)."""
    parts = [c.strategy.value, c.wrap.value if brief else f"{c.wrap.value} wrap"]
    if not brief or c.micro_batch > 1 or c.grad_accum > 1:
        parts.append(f"micro-batch {c.micro_batch}")
        if c.grad_accum > 1:
            parts[-1] += f" × {c.grad_accum} accumulation steps"
    if c.checkpointing is CheckpointMode.FULL:
        parts.append("checkpointing")
    elif c.checkpointing is not CheckpointMode.NONE:
        parts.append(f"{c.checkpointing.value} checkpointing")
    if (c.forward_prefetch, c.backward_prefetch) != (0, 1):
        parts.append(f"prefetch {c.forward_prefetch}/{c.backward_prefetch}")
    return ", ".join(parts)


def _counts(searched: SearchResult) -> str:
    """``76 configurations (4 pruned by memory, 44 by the step-time bound, 28 simulated)``."""
    text = (
        f"{len(searched.evaluated)} configurations ({searched.count(Status.PRUNED_MEMORY)} pruned by "
        f"memory, {searched.count(Status.PRUNED_TIME)} by the step-time bound, "
        f"{searched.count(Status.SIMULATED)} simulated"
    )
    invalid = searched.count(Status.INVALID)
    return text + (f", {invalid} invalid)" if invalid else ")")


def _tune_best(fits: TuneOutcome) -> str:
    """#1 of the tuner against the file's own configuration."""
    first, base = fits.result.top[0], fits.baseline
    assert first.report is not None and base.report is not None
    head = f"#1 is {_describe(first.candidate)}: {t(first.step_time_s)}"
    limit = f"peak {gib(first.required_bytes)} against a {gib(fits.limit_bytes)} limit"
    if first.candidate == base.candidate:
        second = fits.result.top[1]
        assert second.report is not None
        slower = second.step_time_s / first.step_time_s - 1
        claim(slower >= 0, "the runner-up is slower")
        return (
            f"{head}, the file's own configuration, {limit}; the runner-up, "
            f"{_describe(second.candidate)}, is {pct(slower)} slower"
        )
    gain = first.report.tokens_per_s / base.report.tokens_per_s - 1
    claim(gain > 0, "#1 ... faster than the file's configuration")
    b = base.candidate
    return f"{head}, {pct(gain)} faster than the file's {b.strategy.value}/{b.wrap.value}, {limit}"


def tune_example() -> str:
    fits = tune(str(ROOT / NODE_7B))
    sets = ("parallel.world_size=8",)
    none = tune(str(ROOT / SCALEOUT), sets)
    searched = none.result
    claim(not searched.top, "nothing fits")
    claim(
        searched.count(Status.PRUNED_MEMORY) == len(searched.evaluated),
        "(every configuration pruned by memory)",
    )
    fix = cheapest(none.changes)
    claim(fix is not None and fix.best is not None, "the cheapest fix is ...")
    assert fix is not None and fix.best is not None
    what = re.sub(r"^(\d+)x ", r"\1× ", fix.change.what)  # "4x the ranks (32)" -> "4× the ranks (32)"
    return para(
        f"""Examples: `fsdpsim tune {NODE_7B}` looks at {_counts(fits.result)};
        {_tune_best(fits)}. `fsdpsim tune {SCALEOUT} --set {sets[0]}`: nothing fits
        (every configuration pruned by memory); the cheapest fix is {what}:
        {_describe(fix.best.candidate, brief=True)}, {gib(fix.best.required_bytes)}."""
    )
