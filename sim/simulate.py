"""One call from a scenario to a simulated step: build units and costs, write the program, run it."""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from sim.comm_model import collective_time_s
from sim.compute_model import build_compute_costs
from sim.ddp_schedule import build_ddp_program
from sim.dtypes import dtype_bytes
from sim.engine import Variability, run_program
from sim.events import EventTable
from sim.fsdp_schedule import build_fsdp_program
from sim.layers import LayerOp, Workload, layer_ops, model_buffer_bytes
from sim.profile import HardwareProfile, load_profile
from sim.program import Program
from sim.report import build_report
from sim.scenario import CheckpointMode, Scenario, Strategy
from sim.step_config import StepConfig
from sim.topology import GroupKind, Topology
from sim.units import build_segments, build_units

MASTER_DTYPE = "fp32"  # FSDP2 keeps sharded parameters, gradients and optimizer states in fp32


@dataclass(frozen=True)
class SimResult:
    scenario: Scenario
    profile: HardwareProfile
    step: StepConfig
    layer_ops: Sequence[LayerOp]
    program: Program
    events: EventTable
    report: dict[str, Any]


def build_step(
    scenario: Scenario, profile: HardwareProfile
) -> tuple[StepConfig, Topology, Sequence[LayerOp]]:
    """Everything the schedule builders need, from a scenario and a profile."""
    model, training, parallel = scenario.model, scenario.training, scenario.parallel
    workload = Workload(
        micro_batch=training.micro_batch,
        seq_len=training.seq_len,
        act_bytes=dtype_bytes(scenario.param_dtype),
        attention_kernel=profile.backend.attention_kernel,
    )
    ops = layer_ops(model, workload)
    units = build_units(model, parallel.wrap)
    costs = build_compute_costs(
        profile, ops, model=model, micro_batch=training.micro_batch, seq_len=training.seq_len,
        param_dtype=scenario.param_dtype, optimizer=scenario.optimizer.name.value,
        allow_scaling=scenario.cluster.compute_scaling,
        fsdp=parallel.strategy is not Strategy.NO_SHARD,
    )  # fmt: skip
    gpus_per_node = scenario.cluster.gpus_per_node or profile.gpus_per_node
    topology = Topology(
        world_size=parallel.world_size, gpus_per_node=gpus_per_node, shard_size=scenario.shard_group_size
    )

    @cache
    def collective_s(collective: str, nbytes: int, group: GroupKind, dtype: str) -> float:
        return collective_time_s(collective, nbytes, topology.shape(group), dtype, profile)

    step = StepConfig(
        units=tuple(units),
        segments=tuple(build_segments(ops, units)),
        shard_size=scenario.shard_group_size,
        hybrid=parallel.strategy is Strategy.HYBRID_SHARD,
        reshard_after_forward=scenario.reshard_after_forward,
        forward_prefetch=parallel.forward_prefetch,
        backward_prefetch=parallel.backward_prefetch,
        checkpointing=scenario.checkpointing.mode is CheckpointMode.FULL,
        grad_accum=training.grad_accum,
        optimizer=scenario.optimizer.name.value,
        master_bytes=dtype_bytes(MASTER_DTYPE),
        param_dtype=scenario.param_dtype,
        param_bytes=dtype_bytes(scenario.param_dtype),
        reduce_dtype=scenario.reduce_dtype,
        reduce_bytes=dtype_bytes(scenario.reduce_dtype),
        block_input_bytes=workload.tokens * model.hidden * workload.act_bytes,
        buffer_bytes=model_buffer_bytes(model),
        collective_temp_buffers=profile.backend.collective_temp_buffers,
        ddp_bucket_bytes=int(parallel.ddp_bucket_mb * (1 << 20)),
        costs=costs,
        collective_s=collective_s,
    )
    return step, topology, ops


def compute_interference(profile: HardwareProfile) -> float:
    """Calibrated slowdown of compute while a collective runs (1.0 without a compute section)."""
    compute = profile.compute or {}
    return float(compute.get("compute_slowdown_during_collective", 1.0))


def simulate(scenario: Scenario, profile: HardwareProfile | None = None) -> SimResult:
    """Simulate one optimizer step (all micro-batches) of ``scenario``."""
    if profile is None:
        profile = load_profile(scenario.cluster.profile, where=f"{scenario.source}: cluster.profile")
    step, topology, ops = build_step(scenario, profile)
    no_shard = scenario.parallel.strategy is Strategy.NO_SHARD
    program = build_ddp_program(step) if no_shard else build_fsdp_program(step)
    sim = scenario.simulation
    variability = Variability(
        seed=sim.seed,
        compute_jitter=sim.compute_jitter,
        slow_rank=sim.slow_rank,
        slow_rank_factor=sim.slow_rank_factor,
    )
    table = run_program(
        program,
        topology,
        variability,
        serial=not profile.backend.overlaps_comm_compute,
        interference=compute_interference(profile),
    )
    report = build_report(scenario, profile, step, ops, table)
    return SimResult(scenario, profile, step, ops, program, table, report)
