"""The step report: step time and its breakdown, throughput, MFU and HFU, peak memory and its
breakdown, model state and collectives, as a frozen dataclass with ``to_json()``.

Everything is computed from the event table (``sim.outputs.intervals``, ``sim.outputs.memory_curve``),
the one model-state formula (``sim.schedule.model_state``) and the FLOPs definitions of
``sim.workload.flops``. JSON keys and units (seconds, bytes) are the README's.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sim.core.events import EventTable, MemoryCategory, OpKind
from sim.core.topology import GroupKind
from sim.costs.nccl import runtime_channels
from sim.hardware.registry import builtin_devices
from sim.outputs.allocator import ReservedCurve, nccl_buffer_bytes, reserved_curve
from sim.outputs.attention_timing import AttentionTiming, attention_timing
from sim.outputs.intervals import Breakdown, rank_breakdown, step_time
from sim.outputs.memory_curve import MemoryCurve, memory_curve
from sim.schedule.model_state import ModelState, deepspeed_convention_bytes, host_bytes, model_state
from sim.schedule.zero_state import zero_infinity_working_memory, zero_state
from sim.simulate import SimResult, attention_profile, compute_jitter, job_topology, scenario_network
from sim.workload.flops import model_flops_per_token, recompute_flops_per_token
from sim.workload.model import n_params

COLLECTIVE_KINDS = (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE, OpKind.ALL_TO_ALL)


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
class Packing:
    """With ``training.avg_doc_len``: rows packed from documents of that mean length, their
    positions restarting at each; ``document_mask``: SDPA is given their block-diagonal mask
    (else, with a KV cache or before transformers 4.36, attention crosses the documents)."""

    seq_len: int
    avg_doc_len: int
    document_mask: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "avg_doc_len": self.avg_doc_len,
            "documents_per_row": self.seq_len / self.avg_doc_len,
            "document_mask": self.document_mask,
            "note": (
                "SDPA given the documents' block-diagonal mask: memory-efficient attention over every pair"
                if self.document_mask
                else "no document mask (a KV cache, or transformers before 4.36): attention crosses the documents"
            ),
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
            "note": "tokens_per_s counts real tokens; step time, memory and MFU include the padding"
            + (
                " and the collator's attention mask (SDPA given a mask: memory-efficient attention over every pair)"
                if self.avg_seq_len < self.seq_len
                else ""
            ),
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
    system: str = "FSDP2"  # FSDP2, FSDP1, DDP, DeepSpeed ZeRO-<stage>
    profile: str
    profile_calibrated: bool
    compute_jitter: float = 0.0  # each compute op's relative spread per rank (sim.simulate.compute_jitter)
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
    # its active peak: its blocks in the host's order, record_stream frees held until the stream
    # passes (sim.core.host_clock); on a host without a caching allocator, the allocated peak
    peak_active_bytes: int
    device_overhead_bytes: int  # outside the allocator: CUDA context, NCCL buffers
    collectives: Mapping[OpKind, CollectiveTotals]  # rank 0
    ranks_simulated: int
    per_rank: tuple[RankFigures, ...]
    padding: Padding | None = None
    packing: Packing | None = None
    # how a GPU profile's kernel model times the attention calls (None on a CPU or calibrated one)
    attention: AttentionTiming | None = None
    host_memory_bytes: int = 0  # host memory per rank (offload; pinned unless FSDP2 is told otherwise)
    nvme_bytes: int = 0  # what a rank keeps on NVMe (ZeRO-Infinity)
    offload_bytes: Mapping[str, int] = field(default_factory=dict)  # per step, by stream: h2d, d2h, nvme
    zero_infinity: Mapping[str, int] | None = None  # the paper's working-memory formulas (DeepSpeed)
    skipped_step_fraction: float = 0.0  # what-if: steps an fp16 overflow skips (no update, same time)

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
            "compute_jitter": self.compute_jitter,
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
            "peak_active_bytes": self.peak_active_bytes,
            "device_overhead_bytes": self.device_overhead_bytes,
            "fits": self.fits,
            "memory_headroom_bytes": self.memory_headroom_bytes,
            "collectives": {k.value: t.to_json() for k, t in self.collectives.items()},
            "ranks_simulated": self.ranks_simulated,
            "per_rank": [r.to_json() for r in self.per_rank],
            **({"padding": self.padding.to_json()} if self.padding else {}),
            **({"packing": self.packing.to_json()} if self.packing else {}),
            **({"attention": self.attention.to_json()} if self.attention else {}),
            **self._offload_json(),
        }

    def _offload_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "system": self.system,
            "host_memory_bytes": self.host_memory_bytes,
            "nvme_bytes": self.nvme_bytes,
            "offload_bytes": dict(self.offload_bytes),
        }
        if self.zero_infinity is not None:
            out["zero_infinity"] = dict(self.zero_infinity)
        if self.skipped_step_fraction:
            out["skipped_step_fraction"] = self.skipped_step_fraction
            out["effective_tokens_per_s"] = self.tokens_per_s * (1 - self.skipped_step_fraction)
        return out


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
    as NCCL runs them on that group's fabric (``sim.costs.nccl.runtime_channels``). An integer
    ``reshard_after_forward`` gives every unit its own post-forward mesh, so its own communicator
    (``fully_shard`` builds a ``DeviceMesh`` per call)."""
    s = result.scenario
    topology = job_topology(s)
    network = scenario_network(s, result.profile)
    kinds = {op.group for op in result.program.ops if op.group is not None}
    post_forward_units = {op.unit for op in result.program.ops if op.group is GroupKind.POST_FORWARD}
    communicators = {kind: len(post_forward_units) if kind is GroupKind.POST_FORWARD else 1 for kind in kinds}
    if network is None:
        return 0
    channels = 0
    for kind, count in communicators.items():
        members = topology.members(kind, rank)
        if len(members) > 1:
            channels += count * runtime_channels(network.fabric(members))
    return channels


def reserved_of(result: SimResult, rank: int) -> ReservedCurve | None:
    """The caching allocator's reserved bytes of ``rank`` over the step (with the cuBLAS
    workspace); None on a host without a caching allocator (gloo, CPU)."""
    profile = result.profile
    if profile.backend.name != "nccl":
        return None
    device = profile.device
    return reserved_curve(
        result.events,
        rank,
        device.memory_bytes - device.context_bytes,
        expandable=result.scenario.cluster.expandable_segments,
        workspace_bytes=device.cublas_workspace_bytes,
    )


def device_overhead_bytes(result: SimResult, rank: int) -> int:
    """What the device holds outside the caching allocator on ``rank``: the CUDA context and NCCL's
    communicator buffers (0 on a CPU host)."""
    if result.profile.backend.name != "nccl":
        return 0
    return result.profile.device.context_bytes + nccl_buffer_bytes(communicator_channels(result, rank))


def device_memory(result: SimResult, rank: int, peak_allocated_bytes: int) -> dict[str, Any]:
    """``peak_reserved_bytes`` and ``device_overhead_bytes`` of ``rank``: on a CUDA device the
    caching allocator's replay (with the cuBLAS workspace) and the context and NCCL buffers; on a
    host without a caching allocator (gloo, CPU), the allocated peak and nothing more."""
    curve = reserved_of(result, rank)
    if curve is None:
        return {
            "peak_reserved_bytes": peak_allocated_bytes,
            "peak_active_bytes": peak_allocated_bytes,
            "device_overhead_bytes": 0,
        }
    return {
        "peak_reserved_bytes": curve.peak_bytes(),
        "peak_active_bytes": curve.peak_active_bytes(),
        "device_overhead_bytes": device_overhead_bytes(result, rank),
    }


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
        strategy=s.parallel.strategy.value if step.zero is None else f"ZeRO-{step.zero.stage}",
        system=step.system,
        wrap=s.parallel.wrap.value if step.zero is None else "every module with parameters",
        n_units=len(step.units),
        profile=profile.name,
        profile_calibrated=profile.calibrated,
        compute_jitter=compute_jitter(s, profile),
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
            n,
            s.parallel.strategy,
            max(1, step.shard_size),
            step.zero.stage if step.zero else None,
            frozen=sum(p.quantized_numel or p.numel for u in step.units for p in u.params if not p.trainable),
        ),
        device_memory_bytes=profile.device.memory_bytes,
        **device_memory(result, worst, curves[worst].peak_bytes()),
        collectives=collective_totals(table, 0),
        ranks_simulated=len(table.simulated_ranks),
        per_rank=_per_rank(table, figures, k),
        padding=Padding(seq_len=t.seq_len, avg_seq_len=t.avg_seq_len) if t.avg_seq_len is not None else None,
        packing=(
            Packing(seq_len=t.seq_len, avg_doc_len=t.avg_doc_len, document_mask=s.document_mask)
            if t.avg_doc_len is not None and t.packed
            else None
        ),
        attention=attention_timing(
            attention_profile(s, profile), s.param_dtype, result.layer_ops, builtin_devices()
        ),
        **_offload_fields(result),
    )


def _offload_fields(result: SimResult) -> dict[str, Any]:
    step = result.step
    return {
        "host_memory_bytes": host_bytes(step),
        "nvme_bytes": zero_state(step).nvme_bytes if step.zero else 0,
        "offload_bytes": offload_totals(result.events, 0),
        "zero_infinity": _zero_infinity(result) if step.zero else None,
        "skipped_step_fraction": result.scenario.precision.skipped_step_fraction,
    }


def offload_totals(table: EventTable, rank: int) -> dict[str, int]:
    """Bytes one rank moves per step over PCIe (h2d, d2h) and to and from NVMe."""
    out: dict[str, int] = {}
    for op in table.ops_of(rank):
        if op.kind is OpKind.OFFLOAD:
            out[op.stream.value] = out.get(op.stream.value, 0) + op.bytes
    return out


def _zero_infinity(result: SimResult) -> dict[str, int]:
    s, plan = result.scenario, result.step.checkpoint
    every = None
    if plan.active:
        every = max(1, s.model.n_layers // len(plan.blocks))
    return zero_infinity_working_memory(
        hidden=s.model.hidden,
        n_heads=s.model.n_heads,
        n_layers=s.model.n_layers,
        micro_batch=s.training.micro_batch,
        seq_len=s.training.seq_len,
        checkpoint_every=every,
    )
