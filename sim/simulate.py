"""One call from a scenario to a simulated step: build units and costs, write the program, run it.

The step's report, timeline and trace are made from the result by ``sim.outputs``.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from sim.core.engine import GroupCost, Variability, run_program
from sim.core.events import EventTable, OpKind
from sim.core.program import Program, ProgramOp
from sim.core.topology import GroupKind, Topology
from sim.costs.collectives import CollectiveCost, collective_cost
from sim.costs.compute import ComputeCosts
from sim.costs.compute_build import build_compute_costs
from sim.costs.offload import HostCosts
from sim.dtypes import dtype_bytes
from sim.errors import UserError
from sim.hardware.cluster_spec import default_cluster
from sim.hardware.network import Network, job_network
from sim.hardware.registry import builtin_devices, load_profile
from sim.hardware.schema import HardwareProfile
from sim.scenario.sections import VECTOR_RANKS, Scenario
from sim.schedule.ddp import build_ddp_program
from sim.schedule.fsdp1 import build_fsdp1_program
from sim.schedule.fsdp2 import build_fsdp2_program
from sim.schedule.step import StepConfig
from sim.schedule.zero import build_zero12_program
from sim.schedule.zero3 import build_zero3_program
from sim.workload.checkpointing import block_input_bytes, checkpoint_plan, kv_cache_bytes
from sim.workload.expert_parallel import expert_parallel_view, split_at_experts
from sim.workload.finetune import total_quant_state_bytes
from sim.workload.forward import layer_ops
from sim.workload.layer_op import LayerOp
from sim.workload.layers import model_buffer_bytes, stack_masks
from sim.workload.loss import output_logits_bytes
from sim.workload.model import ModelConfig
from sim.workload.options import AttentionImpl, OutputFormat, Strategy, WrapPolicy
from sim.workload.shapes import Workload
from sim.workload.stack_bias import stack_biases
from sim.workload.units import build_segments, build_units

MASTER_DTYPE = "fp32"  # FSDP2 keeps sharded parameters, gradients and optimizer states in fp32


@dataclass(frozen=True, kw_only=True)
class SimResult:
    scenario: Scenario
    profile: HardwareProfile
    step: StepConfig
    layer_ops: Sequence[LayerOp]
    program: Program
    events: EventTable


def job_topology(scenario: Scenario) -> Topology:
    """Ranks, nodes and process groups of the scenario's job."""
    return Topology(
        world_size=scenario.parallel.world_size,
        gpus_per_node=scenario.gpus_per_node,
        shard_size=scenario.shard_group_size,
        post_forward_size=scenario.post_forward_shard_size or 0,
        expert_size=scenario.parallel.expert_parallel,
    )


def _vectorised(scenario: Scenario) -> bool:
    engine = scenario.simulation.engine
    return engine == "vector" or (engine == "auto" and scenario.parallel.world_size > VECTOR_RANKS)


def compute_jitter(scenario: Scenario, profile: HardwareProfile) -> float:
    """Each compute op's relative spread per rank: the scenario's ``simulation.compute_jitter``,
    else the spread the profile's compute calibration measured (0 without one)."""
    if scenario.simulation.compute_jitter is not None:
        return scenario.simulation.compute_jitter
    return profile.compute.compute_time_rel_std if profile.compute is not None else 0.0


def _variability(scenario: Scenario, profile: HardwareProfile, network: Network | None) -> Variability:
    sim = scenario.simulation
    return Variability(
        seed=sim.seed,
        compute_jitter=compute_jitter(scenario, profile),
        slow_rank=sim.slow_rank,
        slow_rank_factor=sim.slow_rank_factor,
        links_identical=network is None or network.links_identical,
    )


def scenario_network(scenario: Scenario, profile: HardwareProfile) -> Network | None:
    """The cluster the scenario's ranks run on, with its what-ifs; None where collectives are not
    NCCL's (gloo: the profile's measured curves and links)."""
    if profile.backend.name != "nccl":
        return None
    c, s = scenario.cluster, scenario.simulation
    return job_network(
        scenario.cluster_spec or default_cluster(profile, scenario.gpus_per_node),
        world_size=scenario.parallel.world_size,
        ranks_per_node=scenario.gpus_per_node,
        arch=profile.device.architecture,
        nics_per_node=c.nics_per_node,
        nic_gbps=c.nic_gbps,
        nic_factor=c.nic_factor,
        nvlink_factor=c.nvlink_factor,
        spine_oversubscription=c.spine_oversubscription,
        nic_jitter=s.nic_jitter,
        seed=s.seed,
        slow_nic=None if s.slow_nic_node is None else (s.slow_nic_node, s.slow_nic),
        slow_nic_factor=s.slow_nic_factor,
    )


def attention_profile(scenario: Scenario, profile: HardwareProfile) -> HardwareProfile:
    """``profile`` running the scenario's ``training.attention``: "sdpa" leaves it as it is (its
    kernel: the calibrated one, else the backend's); "eager" costs every attention op as HF's eager
    path (``sim.workload.eager_attention``: memory op by op, FLOPs of the full s² matmuls, a GPU's
    time as matmuls plus memory-bound softmax). Refused where the simulator cannot say: a profile
    whose compute section timed SDPA's kernel (the calibration does not time the eager path), and
    a model whose attention adds a position bias (T5: its eager path is not described)."""
    if scenario.training.attention is AttentionImpl.SDPA:
        return profile
    where = f'{scenario.source}: training.attention = "eager"'
    if profile.compute is not None:
        raise UserError(
            f"{where}: profile {profile.name}'s compute section timed SDPA's kernel, not HF's eager "
            "attention; use an uncalibrated profile"
        )
    d = scenario.model.description
    if d is not None and any(op.attention is not None and op.attention.bias for op in d.ops):
        raise UserError(
            f"{where}: model {d.name}'s attention adds a position bias, whose eager path is not described"
        )
    return replace(profile, backend=replace(profile.backend, attention_kernel="eager"))


def build_step(
    scenario: Scenario, profile: HardwareProfile, network: Network | None = None
) -> tuple[StepConfig, Topology, Sequence[LayerOp]]:
    """Everything the schedule builders need, from a scenario and a profile (and the scenario's
    network on that profile, ``scenario_network``, when the caller has it already)."""
    model, training, parallel = scenario.model, scenario.training, scenario.parallel
    profile = attention_profile(scenario, profile)
    workload = _workload(scenario, profile)
    ops = layer_ops(model, workload)
    # DeepSpeed ZeRO hooks every module that owns parameters: one unit per linear and embedding
    units = build_units(model, WrapPolicy.LINEAR if scenario.deepspeed.enabled else parallel.wrap)
    e, expert_modules, expert_names = parallel.expert_parallel, frozenset[str](), frozenset[str]()
    if e > 1:  # this rank's experts and the work they do (sim.workload.expert_parallel)
        ops, units, expert_modules, expert_names = expert_parallel_view(ops, units, e)
    segments = split_at_experts(build_segments(ops, units), expert_modules)
    costs = _compute_costs(scenario, profile, ops)
    topology = job_topology(scenario)
    network = network or scenario_network(scenario, profile)
    collective = _collective_cost_of(scenario, profile, topology, network)

    step = StepConfig(
        strategy=parallel.strategy,
        units=tuple(units),
        segments=segments,
        figures=costs.segment_figures(segments),
        shard_size=scenario.shard_group_size,
        reshard_after_forward=scenario.reshard_after_forward,
        forward_prefetch=parallel.forward_prefetch,
        backward_prefetch=parallel.backward_prefetch,
        checkpoint=checkpoint_plan(
            scenario.checkpointing.mode, scenario.checkpointing.selective, model.n_layers
        ),
        grad_accum=training.grad_accum,
        optimizer=scenario.optimizer.name,
        optimizer_implementation=scenario.optimizer.implementation,
        master_dtype=scenario.master_dtype,
        param_dtype=scenario.param_dtype,
        param_bytes=dtype_bytes(scenario.param_dtype),
        reduce_dtype=scenario.reduce_dtype,
        reduce_bytes=dtype_bytes(scenario.reduce_dtype),
        block_input_bytes=block_input_bytes(model, workload),
        kv_cache_bytes=kv_cache_bytes(model, workload) if scenario.use_cache else (),
        kv_cache_in_block_inputs=scenario.output_format is OutputFormat.CURRENT,
        kept_output_bytes=output_logits_bytes(
            model, workload, fp32=scenario.output_format is OutputFormat.LEGACY
        )
        if training.keep_outputs
        else 0,
        stack_masks=stack_masks(model, ops, workload),
        stack_biases=stack_biases(model, workload),
        buffer_bytes=model_buffer_bytes(model)
        * dtype_bytes(_buffer_dtype(scenario))
        // dtype_bytes(MASTER_DTYPE),
        collective_temp_buffers=profile.backend.collective_temp_buffers,
        ddp_bucket_bytes=int(parallel.ddp_bucket_mb * (1 << 20)),
        costs=costs,
        collective=collective,
        world_size=parallel.world_size,
        fsdp1=scenario.fsdp1_options,
        zero=scenario.zero_options,
        grad_scaler=scenario.precision.grad_scaler,
        # DeepSpeed clips inside its own step, which already all-reduces the gradient norm
        clip_grad_norm=training.max_grad_norm > 0 and not scenario.deepspeed.enabled,
        host=HostCosts(
            node=profile.node,
            ranks_per_node=min(scenario.gpus_per_node, parallel.world_size),
            profile=profile.name,
            host_is_device=profile.host_is_device,
        ),
        fsdp2_offload=scenario.fsdp2_offload,
        quant_state_bytes=_quant_state_bytes(model),
        sync_every_microbatch=training.sync_every_microbatch,
        post_forward_size=scenario.post_forward_shard_size,
        **_expert_fields(scenario, expert_modules, expert_names, workload),
    )
    return step, topology, ops


def _workload(scenario: Scenario, profile: HardwareProfile) -> Workload:
    """The shapes every cost reads: the micro-batch, its sequences, the activation dtype and the
    kernels the scenario names (``profile``: with the scenario's attention kernel)."""
    training = scenario.training
    return Workload(
        micro_batch=training.micro_batch,
        seq_len=training.seq_len,
        decoder_seq_len=training.decoder_seq_len,
        act_bytes=dtype_bytes(scenario.param_dtype),
        attention_kernel=profile.attention_kernel,
        loss=training.loss,
        norm=training.norm,
        padded=training.padded,
        packed=training.packed,
        document_mask=scenario.document_mask,
    )


def _compute_costs(scenario: Scenario, profile: HardwareProfile, ops: Sequence[LayerOp]) -> ComputeCosts:
    """The ops' costs on ``profile`` as the scenario's system runs them."""
    parallel = scenario.parallel
    return build_compute_costs(
        profile,
        ops,
        model=scenario.model,
        micro_batch=scenario.training.micro_batch,
        seq_len=scenario.training.seq_len,
        param_dtype=scenario.param_dtype,
        optimizer=scenario.optimizer.name,
        allow_scaling=scenario.cluster.compute_scaling,
        fsdp=parallel.strategy is not Strategy.NO_SHARD
        and parallel.fsdp_version == 2
        and not scenario.deepspeed.enabled,
        fsdp_version=parallel.fsdp_version,
        lenders=builtin_devices(),
        deepspeed_stage=scenario.deepspeed.stage if scenario.deepspeed.enabled else None,
    )


def _collective_cost_of(
    scenario: Scenario, profile: HardwareProfile, topology: Topology, network: Network | None
) -> Callable[[str, int, GroupKind, str], CollectiveCost]:
    """A collective's cost by name, size, group and dtype, on rank 0's group of that kind."""
    identical = _variability(scenario, profile, network).ranks_identical

    @cache
    def collective(name: str, nbytes: int, group: GroupKind, dtype: str) -> CollectiveCost:
        shape = topology.shape(group)
        fabric = None
        if network is not None and shape.size > 1:
            # rank 0's group stands for every group of its kind; those that share its NIC are not
            # simulated when ranks are identical, so their share of the NIC is taken here
            peers = network.nic_peers(0) if identical else (0,)
            sharing = len({topology.group_id(group, r) for r in peers})
            fabric = network.fabric(topology.members(group, 0), sharing)
        return collective_cost(name, nbytes, shape, dtype, profile, fabric)

    return collective


def _expert_fields(
    scenario: Scenario, modules: frozenset[str], names: frozenset[str], workload: Workload
) -> dict[str, Any]:
    """StepConfig's expert-parallel fields; one all-to-all sends every (token, chosen expert) row."""
    moe = scenario.model.description.moe if scenario.model.description is not None else None
    if scenario.parallel.expert_parallel == 1 or moe is None:
        return {}
    return {
        "expert_parallel": scenario.parallel.expert_parallel,
        "expert_params": names,
        "experts_per_layer": moe.experts,
        "expert_modules": modules,
        "dispatch_bytes": workload.tokens * moe.top_k * scenario.model.hidden * workload.act_bytes,
    }


def _quant_state_bytes(model: ModelConfig) -> int:
    """QLoRA's quantization state of every 4-bit weight, whole on every rank."""
    d = model.description
    if d is None or d.finetune is None or not d.finetune.quantized:
        return 0
    return total_quant_state_bytes(d.params, d.finetune.double_quant)


def _group_cost(
    scenario: Scenario, profile: HardwareProfile, network: Network, topology: Topology
) -> GroupCost:
    """Where groups of a kind cross NICs of different speeds: each rank's group's own collective
    time (the program holds rank 0's; what it adds to it, FSDP2's copy overheads, is kept)."""

    @cache
    def cost(kind: OpKind, nbytes: int, group: GroupKind, rank: int) -> CollectiveCost:
        dtype = scenario.param_dtype if kind is OpKind.ALL_GATHER else scenario.reduce_dtype
        members = topology.members(group, rank)
        fabric = network.fabric(members)
        return collective_cost(kind.value, nbytes, topology.shape(group, rank), dtype, profile, fabric)

    def per_rank(op: ProgramOp, rank: int) -> tuple[float, float]:
        assert op.group is not None
        first = topology.members(op.group, rank)[0]
        base, mine = cost(op.kind, op.bytes, op.group, 0), cost(op.kind, op.bytes, op.group, first)
        return op.duration_s - base.time_s + mine.time_s, mine.wire_fraction

    return per_rank


def _buffer_dtype(scenario: Scenario) -> str:
    """FSDP1 casts module buffers to ``MixedPrecision.buffer_dtype``; FSDP2 and DDP keep them."""
    if scenario.parallel.fsdp_version == 1 and scenario.precision.buffer_dtype is not None:
        return scenario.precision.buffer_dtype
    return MASTER_DTYPE


def build_program(step: StepConfig) -> Program:
    """The schedule of the step's system: FSDP1, FSDP2, or DDP (FSDP2's NO_SHARD)."""
    if step.zero is not None:
        return build_zero3_program(step) if step.zero.stage == 3 else build_zero12_program(step)
    if step.fsdp1 is not None:
        return build_fsdp1_program(step)
    return build_ddp_program(step) if step.ddp else build_fsdp2_program(step)


def scenario_profile(scenario: Scenario, profile: HardwareProfile | None = None) -> HardwareProfile:
    """``profile`` (default: the scenario's ``cluster.profile``) with the scenario's own device
    memory when ``cluster.device_memory_gib`` is set."""
    if profile is None:
        profile = load_profile(scenario.cluster.profile, where=f"{scenario.source}: cluster.profile")
    gib = scenario.cluster.device_memory_gib
    if gib is None:
        return profile
    return replace(profile, device=replace(profile.device, memory_bytes=round(gib * (1 << 30))))


def simulate(scenario: Scenario, profile: HardwareProfile | None = None) -> SimResult:
    """Simulate one optimizer step (all micro-batches) of ``scenario``; ``profile`` defaults to
    the scenario's ``cluster.profile``."""
    profile = scenario_profile(scenario, profile)
    network = scenario_network(scenario, profile)
    step, topology, ops = build_step(scenario, profile, network)
    program = build_program(step)
    table = run_program(
        program,
        topology,
        _variability(scenario, profile, network),
        serial=not profile.backend.overlaps_comm_compute,
        interference=profile.compute_slowdown_during_collective,
        group_links=None
        if network is None
        else lambda kind, rank: network.links(topology.members(kind, rank)),
        group_cost=None
        if network is None or network.links_identical
        else _group_cost(scenario, profile, network, topology),
        vectorised=_vectorised(scenario),
    )
    return SimResult(
        scenario=scenario, profile=profile, step=step, layer_ops=ops, program=program, events=table
    )
