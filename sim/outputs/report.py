"""The step report: step time and its breakdown, throughput, MFU and HFU, peak memory and its
breakdown, model state and collectives, as a frozen dataclass with ``to_json()``.

Everything is computed from the event table (``sim.outputs.intervals``, ``sim.outputs.memory_curve``),
the one model-state formula (``sim.schedule.model_state``) and the FLOPs definitions of
``sim.workload.flops``. JSON keys and units (seconds, bytes) are the README's.
"""

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sim.core.events import EventTable, MemoryCategory, OpKind
from sim.costs.nccl import runtime_channels
from sim.outputs.allocator import nccl_buffer_bytes, peak_reserved_bytes
from sim.outputs.intervals import Breakdown, rank_breakdown, step_time
from sim.outputs.memory_curve import MemoryCurve, memory_curve
from sim.schedule.model_state import ModelState, deepspeed_convention_bytes, model_state
from sim.simulate import SimResult, job_topology, scenario_network
from sim.workload.flops import model_flops_per_token, recompute_flops_per_token
from sim.workload.model import n_params

COLLECTIVE_KINDS = (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE)


@dataclass(frozen=True, kw_only=True)
class CollectiveTotals:
    """One collective kind on one rank over the step: how many, their nccl-tests sizes, their time."""

    count: int
    bytes: int
    time_s: float

    def to_json(self) -> dict[str, float]:
        return {"count": self.count, "bytes": self.bytes, "time_s": self.time_s}


@dataclass(frozen=True, kw_only=True)
class RankFigures:
    rank: int
    step_time_s: float
    peak_memory_bytes: int
    breakdown: Breakdown

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "breakdown_s": self.breakdown.to_json(),
        }


@dataclass(frozen=True, kw_only=True)
class Padding:
    """With ``training.avg_seq_len``: tokens/s count real tokens only; compute, memory, MFU and
    HFU are those of the padded sequences the kernels actually process."""

    seq_len: int
    avg_seq_len: int

    def to_json(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "avg_seq_len": self.avg_seq_len,
            "real_token_fraction": self.avg_seq_len / self.seq_len,
            "note": "tokens_per_s counts real tokens; step time, memory and MFU include the padding",
        }


@dataclass(frozen=True, kw_only=True)
class StepReport:
    scenario: str
    model: str
    n_params: int
    world_size: int
    strategy: str
    wrap: str
    n_units: int
    profile: str
    profile_calibrated: bool
    step_time_s: float
    tokens_per_step: int
    mfu: float  # torchtitan's model FLOPs (sim.workload.flops) over the dense peak of the compute dtype
    hfu: float  # the same with the recomputed forward counted
    breakdown: Breakdown  # rank 0
    peak_memory_bytes: int  # max over ranks
    peak_memory_rank: int
    memory_at_peak: Mapping[MemoryCategory, int]
    model_state: ModelState
    model_state_bytes_deepspeed_convention: int
    device_memory_bytes: int
    peak_reserved_bytes: int  # the caching allocator's reserved peak (sim.outputs.allocator)
    device_overhead_bytes: int  # outside the allocator: CUDA context, NCCL buffers
    collectives: Mapping[OpKind, CollectiveTotals]  # rank 0
    ranks_simulated: int
    per_rank: tuple[RankFigures, ...]
    padding: Padding | None = None

    @property
    def tokens_per_s(self) -> float:
        """Real tokens of the whole job per second."""
        return self.tokens_per_step / self.step_time_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size

    @property
    def required_bytes(self) -> int:
        """What the device must hold at the peak: reserved by the allocator, plus what lies outside it."""
        return self.peak_reserved_bytes + self.device_overhead_bytes

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.device_memory_bytes

    @property
    def memory_headroom_bytes(self) -> int:
        return self.device_memory_bytes - self.required_bytes

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (seconds and bytes), with the keys the README lists."""
        return {
            "scenario": self.scenario,
            "model": self.model,
            "n_params": self.n_params,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "wrap": self.wrap,
            "n_units": self.n_units,
            "profile": self.profile,
            "profile_calibrated": self.profile_calibrated,
            "step_time_s": self.step_time_s,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "breakdown_s": self.breakdown.to_json(),
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_rank": self.peak_memory_rank,
            "memory_at_peak_bytes": {c.value: b for c, b in self.memory_at_peak.items()},
            "model_state_bytes": self.model_state.total,
            "model_state_breakdown_bytes": {
                "params": self.model_state.params,
                "grads": self.model_state.grads,
                "optimizer": self.model_state.optimizer,
            },
            "model_state_bytes_deepspeed_convention": self.model_state_bytes_deepspeed_convention,
            "device_memory_bytes": self.device_memory_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_overhead_bytes": self.device_overhead_bytes,
            "fits": self.fits,
            "memory_headroom_bytes": self.memory_headroom_bytes,
            "collectives": {k.value: t.to_json() for k, t in self.collectives.items()},
            "ranks_simulated": self.ranks_simulated,
            "per_rank": [r.to_json() for r in self.per_rank],
            **({"padding": self.padding.to_json()} if self.padding else {}),
        }


def collective_totals(table: EventTable, rank: int) -> dict[OpKind, CollectiveTotals]:
    """Count, total nccl-tests size and total time per collective kind on one rank, in the order
    the kinds first occur."""
    totals: dict[OpKind, list[float]] = {}
    for op in table.ops_of(rank):
        if op.kind.is_collective:
            t = totals.setdefault(op.kind, [0, 0, 0.0])
            t[0], t[1], t[2] = t[0] + 1, t[1] + op.bytes, t[2] + op.duration_s
    return {k: CollectiveTotals(count=int(c), bytes=int(b), time_s=s) for k, (c, b, s) in totals.items()}


def flops_utilisation(result: SimResult, step_s: float) -> tuple[float, float]:
    """(MFU, HFU) of one rank's step (``sim.workload.flops``): FLOPs per token times the tokens
    the rank processes (padding included), over the step time and the dense peak."""
    s = result.scenario
    model, seq = s.model, s.training.seq_len
    tokens = s.tokens_processed_per_rank
    peak = result.profile.device.peak_flops[s.param_dtype]
    model_flops = model_flops_per_token(model, seq) * tokens
    hardware_flops = model_flops + recompute_flops_per_token(model, seq, result.step.checkpoint) * tokens
    return model_flops / (step_s * peak), hardware_flops / (step_s * peak)


def communicator_channels(result: SimResult, rank: int) -> int:
    """The channels of every communicator ``rank`` belongs to (one per process group of the step),
    as NCCL runs them on that group's fabric (``sim.costs.nccl.runtime_channels``)."""
    s = result.scenario
    topology = job_topology(s)
    network = scenario_network(s, result.profile)
    kinds = {op.group for op in result.program.ops if op.group is not None}
    members = [topology.members(kind, rank) for kind in kinds]
    if network is None:
        return 0
    return sum(runtime_channels(network.fabric(m)) for m in members if len(m) > 1)


def device_memory(result: SimResult, rank: int, peak_allocated_bytes: int) -> dict[str, int]:
    """``peak_reserved_bytes`` and ``device_overhead_bytes`` of ``rank``: on a CUDA device the
    caching allocator's replay (with the cuBLAS workspace) and the context and NCCL buffers; on a
    host without a caching allocator (gloo, CPU), the allocated peak and nothing more."""
    profile = result.profile
    if profile.backend.name != "nccl":
        return {"peak_reserved_bytes": peak_allocated_bytes, "device_overhead_bytes": 0}
    device = profile.device
    reserved = peak_reserved_bytes(
        result.events,
        rank,
        device.memory_bytes - device.context_bytes,
        expandable=result.scenario.cluster.expandable_segments,
        workspace_bytes=device.cublas_workspace_bytes,
    )
    nccl = nccl_buffer_bytes(communicator_channels(result, rank))
    return {"peak_reserved_bytes": reserved, "device_overhead_bytes": device.context_bytes + nccl}


def _rank_figures(table: EventTable, curves: dict[int, MemoryCurve], step_s: float) -> dict[int, RankFigures]:
    """Each simulated rank's figures, computed once (identical ranks share them)."""
    return {
        r: RankFigures(
            rank=r,
            step_time_s=max(o.end_s for o in table.ops_of(r)),
            peak_memory_bytes=curves[r].peak_bytes(),
            breakdown=rank_breakdown(table, r, step_s),
        )
        for r in table.simulated_ranks
    }


def _per_rank(table: EventTable, figures: dict[int, RankFigures], k: int) -> tuple[RankFigures, ...]:
    """Every job rank's figures: from the vectorised engine's summaries where it kept them (it
    holds the records of a few ranks only), else from the simulated rank that stands for it."""
    if table.rank_summaries:
        return tuple(
            RankFigures(
                rank=r,
                step_time_s=s.step_time_s,
                peak_memory_bytes=s.peak_memory_bytes,
                breakdown=Breakdown(compute_s=s.compute_s, exposed_comm_s=s.exposed_comm_s, idle_s=s.idle_s),
            )
            for r, s in sorted(table.rank_summaries.items())
        )
    return tuple(replace(figures[table.rank_of(rank)], rank=rank) for rank in range(k))


def build_report(result: SimResult) -> StepReport:
    s, profile, step, table = result.scenario, result.profile, result.step, result.events
    k = s.parallel.world_size
    step_s = step_time(table)
    curves = {r: memory_curve(table, r) for r in table.simulated_ranks}
    figures = _rank_figures(table, curves, step_s)
    worst = max(table.simulated_ranks, key=lambda r: curves[r].peak_bytes())
    n = n_params(s.model)
    mfu, hfu = flops_utilisation(result, step_s)
    t = s.training
    return StepReport(
        scenario=s.source,
        model=s.model.name,
        n_params=n,
        world_size=k,
        strategy=s.parallel.strategy.value,
        wrap=s.parallel.wrap.value,
        n_units=len(step.units),
        profile=profile.name,
        profile_calibrated=profile.calibrated,
        step_time_s=step_s,
        tokens_per_step=s.tokens_per_step,
        mfu=mfu,
        hfu=hfu,
        breakdown=figures[table.rank_of(0)].breakdown,
        peak_memory_bytes=curves[worst].peak_bytes(),
        peak_memory_rank=worst,
        memory_at_peak=curves[worst].at(curves[worst].peak_index()),
        model_state=model_state(step),
        model_state_bytes_deepspeed_convention=deepspeed_convention_bytes(
            n, s.parallel.strategy, max(1, step.shard_size)
        ),
        device_memory_bytes=profile.device.memory_bytes,
        **device_memory(result, worst, curves[worst].peak_bytes()),
        collectives=collective_totals(table, 0),
        ranks_simulated=len(table.simulated_ranks),
        per_rank=_per_rank(table, figures, k),
        padding=Padding(seq_len=t.seq_len, avg_seq_len=t.avg_seq_len) if t.avg_seq_len is not None else None,
    )
