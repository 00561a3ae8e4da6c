"""The one model-state formula: what each rank holds for the whole step, before and after it.

Used by the schedules (their resident allocations), the report (``model_state_bytes``) and the
tuner's memory bound, so the three can never disagree.

FSDP2 pads each parameter's dim 0 to a multiple of the shard group (``_get_dim0_padded_size``)
and keeps fp32 shards of parameters, gradients and every optimizer state; DDP keeps all of them
whole, plus its gradient buckets (``gradient_as_bucket_view=False``: a second copy of the
gradients in ``reduce_dtype``).
"""

from dataclasses import dataclass

from sim.core.events import MemoryCategory
from sim.core.program import Alloc
from sim.schedule.step import StepConfig
from sim.workload.options import OPTIMIZER_STATES, Strategy
from sim.workload.units import WrapUnit


@dataclass(frozen=True, kw_only=True)
class ModelState:
    """Persistent bytes per rank: parameters, gradients (once the first backward has made them)
    and optimizer states."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def unit_numel_per_rank(step: StepConfig, unit: WrapUnit) -> int:
    """Elements of ``unit`` one rank holds: its padded shard under FSDP, all of it under DDP."""
    w = step.shard_size if step.sharded else 1
    return unit.padded_numel(w) // w


def numel_per_rank(step: StepConfig) -> int:
    return sum(unit_numel_per_rank(step, u) for u in step.units)


def model_state(step: StepConfig) -> ModelState:
    numel, b = numel_per_rank(step), step.master_bytes
    return ModelState(
        params=numel * b, grads=numel * b, optimizer=OPTIMIZER_STATES[step.optimizer] * numel * b
    )


def ddp_bucket_bytes(step: StepConfig) -> int:
    """DDP's persistent gradient buckets (none under FSDP)."""
    return 0 if step.sharded else numel_per_rank(step) * step.reduce_bytes


def resident_allocs(step: StepConfig) -> list[Alloc]:
    """What is allocated before the step starts: module buffers, parameters and optimizer states
    (per unit under FSDP, as each ``fully_shard`` group owns its shards), DDP's buckets."""
    b, states = step.master_bytes, OPTIMIZER_STATES[step.optimizer]
    buffers = Alloc(label="buffers", category=MemoryCategory.PARAMS, bytes=step.buffer_bytes)
    if not step.sharded:
        numel = numel_per_rank(step)
        return [
            Alloc(label="params", category=MemoryCategory.PARAMS, bytes=numel * b),
            buffers,
            Alloc(label="optimizer", category=MemoryCategory.OPTIMIZER, bytes=states * numel * b),
            Alloc(label="ddp_buckets", category=MemoryCategory.COMM_BUFFERS, bytes=ddp_bucket_bytes(step)),
        ]
    allocs = [buffers]
    for unit in step.units:
        numel = unit_numel_per_rank(step, unit)
        allocs.append(Alloc(label=f"param:{unit.name}", category=MemoryCategory.PARAMS, bytes=numel * b))
        if states:
            allocs.append(
                Alloc(label=f"optim:{unit.name}", category=MemoryCategory.OPTIMIZER, bytes=states * numel * b)
            )
    return allocs


def deepspeed_convention_bytes(n_params: int, strategy: Strategy, shard: int) -> int:
    """The ZeRO paper's count (Rajbhandari et al. 2020, Sec. 3.1): 2Φ fp16 params + 2Φ grads +
    12Φ fp32 master/momentum/variance, partitioned by stage. Not what FSDP2 allocates (see README)."""
    if strategy is Strategy.NO_SHARD:
        return 16 * n_params
    if strategy is Strategy.SHARD_GRAD_OP:
        return 2 * n_params + 14 * n_params // shard
    return 16 * n_params // shard
