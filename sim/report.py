"""The step summary: step time and its breakdown, throughput, MFU, peak memory and its breakdown.

Everything here is computed from the event table, plus the analytic model-state formulas.
"""

from collections.abc import Sequence
from typing import Any

from sim.events import EventTable, MemoryCategory, OpKind
from sim.intervals import rank_breakdown, step_time
from sim.layers import LayerOp
from sim.memory import memory_curve
from sim.model import n_params
from sim.profile import HardwareProfile
from sim.scenario import Scenario, Strategy
from sim.step_config import OPTIMIZER_STATES, StepConfig

GB = 1e9


def model_state_bytes(step: StepConfig, no_shard: bool) -> dict[str, int]:
    """Per-rank persistent parameters, gradients and optimizer states, as FSDP2/DDP allocate them.

    FSDP2 pads each parameter's dim 0 to a multiple of the shard group (``_get_dim0_padded_size``)
    and keeps fp32 shards of parameters, gradients and every optimizer state.
    """
    w = 1 if no_shard else step.shard_size
    numel = sum(u.padded_numel(w) // w for u in step.units)
    b = step.master_bytes
    return {
        "params": numel * b,
        "grads": numel * b,
        "optimizer": OPTIMIZER_STATES[step.optimizer] * numel * b,
    }


def deepspeed_convention_bytes(n: int, strategy: Strategy, shard: int) -> int:
    """The ZeRO paper's count (Rajbhandari et al. 2020, Sec. 3.1): 2Φ fp16 params + 2Φ grads +
    12Φ fp32 master/momentum/variance, partitioned by stage. Not what FSDP2 allocates (see README)."""
    if strategy is Strategy.NO_SHARD:
        return 16 * n
    if strategy is Strategy.SHARD_GRAD_OP:
        return 2 * n + 14 * n // shard
    return 16 * n // shard


def collective_summary(table: EventTable, rank: int) -> dict[str, dict[str, float]]:
    """Count, total nccl-tests size and total time per collective kind on one rank."""
    summary: dict[str, dict[str, float]] = {}
    for op in table.ops_of(rank):
        if op.kind.is_collective:
            s = summary.setdefault(op.kind.value, {"count": 0, "bytes": 0, "time_s": 0.0})
            s["count"] += 1
            s["bytes"] += op.bytes
            s["time_s"] += op.duration_s
    return summary


def model_flops_per_rank(ops: Sequence[LayerOp], grad_accum: int) -> float:
    """Forward + backward FLOPs of one rank's step (recomputation excluded, as MFU defines it)."""
    return 3.0 * grad_accum * sum(op.flops for op in ops)


def build_report(
    scenario: Scenario, profile: HardwareProfile, step: StepConfig, ops: Sequence[LayerOp], table: EventTable
) -> dict[str, Any]:
    k = scenario.parallel.world_size
    step_s = step_time(table)
    curves = {r: memory_curve(table, r) for r in table.simulated_ranks}
    # identical ranks share their simulated rank's figures: compute each once
    figures = {
        r: {
            "step_time_s": max(o.end_s for o in table.ops_of(r)),
            "peak_memory_bytes": curves[r].peak_bytes(),
            "breakdown_s": rank_breakdown(table, r, step_s),
        }
        for r in table.simulated_ranks
    }
    per_rank = [{"rank": rank, **figures[table.rank_of(rank)]} for rank in range(k)]
    worst = max(table.simulated_ranks, key=lambda r: curves[r].peak_bytes())
    peak = curves[worst].peak_bytes()
    device = profile.device.memory_bytes
    no_shard = scenario.parallel.strategy is Strategy.NO_SHARD
    state = model_state_bytes(step, no_shard)
    n = n_params(scenario.model)
    tokens = scenario.tokens_per_step
    flops = model_flops_per_rank(ops, scenario.training.grad_accum)
    return {
        "scenario": scenario.source,
        "model": scenario.model.name,
        "n_params": n,
        "world_size": k,
        "strategy": scenario.parallel.strategy.value,
        "wrap": scenario.parallel.wrap.value,
        "n_units": len(step.units),
        "profile": profile.name,
        "profile_calibrated": profile.calibrated,
        "step_time_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / k,
        "mfu": flops / (step_s * profile.device.peak_flops[scenario.param_dtype]),
        "breakdown_s": figures[table.rank_of(0)]["breakdown_s"],
        "peak_memory_bytes": peak,
        "peak_memory_rank": worst,
        "memory_at_peak_bytes": curves[worst].at(curves[worst].peak_index()),
        "model_state_bytes": sum(state.values()),
        "model_state_breakdown_bytes": state,
        "model_state_bytes_deepspeed_convention": deepspeed_convention_bytes(
            n, scenario.parallel.strategy, max(1, step.shard_size)
        ),
        "device_memory_bytes": device,
        "fits": peak <= device,
        "memory_headroom_bytes": device - peak,
        "collectives": collective_summary(table, 0),
        "ranks_simulated": len(table.simulated_ranks),
        "per_rank": per_rank,
        **padding_note(scenario),
    }


def padding_note(scenario: Scenario) -> dict[str, Any]:
    """With ``training.avg_seq_len``, tokens/s count real tokens only; compute and memory (and MFU)
    are those of the padded sequences the kernels actually process."""
    t = scenario.training
    if t.avg_seq_len is None:
        return {}
    return {
        "padding": {
            "seq_len": t.seq_len,
            "avg_seq_len": t.avg_seq_len,
            "real_token_fraction": t.avg_seq_len / t.seq_len,
            "note": "tokens_per_s counts real tokens; step time, memory and MFU include the padding",
        }
    }


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def _padding_lines(report: dict[str, Any]) -> list[str]:
    pad = report.get("padding")
    if not pad:
        return []
    return [
        f"  padding       real tokens only: {pad['avg_seq_len']:,} of {pad['seq_len']:,} per sequence "
        f"({pad['real_token_fraction']:.0%}); MFU includes the padding"
    ]


def format_table(report: dict[str, Any]) -> str:
    """The human summary printed by ``fsdpsim run``."""
    b = report["breakdown_s"]
    step = report["step_time_s"]
    lines = [
        f"scenario      {report['scenario']}",
        f"model         {report['model']} ({report['n_params']:,} params)",
        f"parallel      {report['strategy']}, wrap={report['wrap']} ({report['n_units']} units), "
        f"{report['world_size']} ranks",
        f"profile       {report['profile']}"
        + ("" if report["profile_calibrated"] else " (datasheet, not calibrated)"),
        "",
        f"step time     {step * 1e3:,.2f} ms",
        f"  compute       {b['compute'] * 1e3:,.2f} ms ({b['compute'] / step:.0%})",
        f"  exposed comm  {b['exposed_comm'] * 1e3:,.2f} ms ({b['exposed_comm'] / step:.0%})",
        f"  idle          {b['idle'] * 1e3:,.2f} ms ({b['idle'] / step:.0%})",
        f"throughput    {report['tokens_per_s']:,.0f} tokens/s ({report['tokens_per_s_per_gpu']:,.0f} per rank), "
        f"MFU {report['mfu']:.1%}",
        *_padding_lines(report),
        "",
        f"peak memory   {_gb(report['peak_memory_bytes'])} of {_gb(report['device_memory_bytes'])} "
        f"on rank {report['peak_memory_rank']}: "
        + ("fits" if report["fits"] else f"DOES NOT FIT by {_gb(-report['memory_headroom_bytes'])}"),
    ]
    for category in MemoryCategory:
        lines.append(f"  {category.value:<12}{_gb(report['memory_at_peak_bytes'][category.value]):>14}")
    state = report["model_state_breakdown_bytes"]
    lines += [
        f"model state   {_gb(report['model_state_bytes'])} per rank (params {_gb(state['params'])}, "
        f"grads {_gb(state['grads'])}, optimizer {_gb(state['optimizer'])})",
        f"  ZeRO-paper convention (2+2+12 B/param): {_gb(report['model_state_bytes_deepspeed_convention'])}",
        "",
        "collectives per step (rank 0):",
    ]
    for kind in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE):
        s = report["collectives"].get(kind.value)
        if s:
            lines.append(
                f"  {kind.value:<15}{int(s['count']):>6} x, {_gb(s['bytes'])} total, {s['time_s'] * 1e3:,.2f} ms"
            )
    return "\n".join(lines)
