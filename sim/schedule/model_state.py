"""The one model-state formula: what each rank holds for the whole step, before and after it.

Used by the schedules (their resident allocations), the report (``model_state_bytes``) and the
tuner's memory bound, so the three can never disagree.

FSDP2 pads each parameter's dim 0 to a multiple of the shard group (``_get_dim0_padded_size``)
and keeps fp32 shards of parameters, gradients and every optimizer state; FSDP1 pads each unit's
``FlatParameter`` instead (``StepConfig.padded_numel``) and keeps the same fp32 shards (without
``MixedPrecision``, over a model stored in bf16 and trained whole: bf16 ones, ``master_dtype``); DDP keeps
all of them whole, plus its gradient buckets (``gradient_as_bucket_view=False``: a second copy of
the gradients in ``reduce_dtype``). A frozen parameter (LoRA's base, FSDP2 and DDP) is stored in its
own dtype with no gradient and no optimizer state (FSDP1: a frozen unit's whole ``FlatParameter``);
QLoRA's quantization state is whole on every rank.
FSDP1's ``CPUOffload`` and FSDP2's ``CPUOffloadPolicy`` keep the shards and states in host memory
(``host_bytes``), except where the device is the host.
"""

from dataclasses import dataclass

from sim.core.events import MemoryCategory
from sim.core.program import Alloc
from sim.dtypes import dtype_bytes
from sim.schedule.step import StepConfig
from sim.workload.options import OPTIMIZER_STATES, Strategy
from sim.workload.params import ParamSpec
from sim.workload.units import WrapUnit, padded_numel


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


def _shard_size(step: StepConfig) -> int:
    return step.shard_size if step.sharded else 1


def stored_bytes(step: StepConfig, p: ParamSpec) -> int:
    """Bytes per element of a parameter as stored: the master dtype, or a frozen one's own."""
    return step.master_bytes if p.dtype is None else dtype_bytes(p.dtype)


def unit_stored_bytes(step: StepConfig, unit: WrapUnit) -> int:
    """Bytes per element of an FSDP1 unit's ``FlatParameter``: its parameters' one dtype (FSDP1
    flattens only tensors of a uniform dtype, which the scenario's checks ensure)."""
    return max(stored_bytes(step, p) for p in unit.params) if unit.params else step.master_bytes


def unit_dtype(step: StepConfig, unit: WrapUnit) -> str:
    """The dtype name of an FSDP1 unit's ``FlatParameter``: its frozen parameters' own, else the
    masters'."""
    return next((p.dtype for p in unit.params if p.dtype is not None), step.master_dtype)


def fsdp1_unit_trains(unit: WrapUnit) -> bool:
    """FSDP1: the ``FlatParameter`` requires a gradient (uniform within a unit, the checks ensure)."""
    return any(p.trainable for p in unit.params)


def unit_tensor_numels_per_rank(step: StepConfig, unit: WrapUnit) -> tuple[int, ...]:
    """The tensors of ``unit`` one rank holds with gradients and optimizer states, their element
    counts: FSDP1's one flat-parameter shard, FSDP2's padded shard of each trainable parameter,
    each whole under NO_SHARD."""
    w = _shard_size(step)
    if step.fsdp1 is not None:  # one FlatParameter, trained or frozen as a whole
        return (step.padded_numel(unit) // w,) if fsdp1_unit_trains(unit) else ()
    if step.expert_params:  # expert parallelism (full training only): local experts over world / E
        return tuple(n // s for n, s in map(step.param_sharding, unit.params))
    # dim 0 padded to a multiple of w: every shard is exactly 1/w of it
    return tuple(padded_numel(p, w) // w for p in unit.params if p.trainable)


def unit_numel_per_rank(step: StepConfig, unit: WrapUnit) -> int:
    """Trainable elements of ``unit`` one rank holds (those with gradients and optimizer states):
    its padded shard under FSDP, all of it under NO_SHARD."""
    return sum(unit_tensor_numels_per_rank(step, unit))


def unit_frozen_bytes_per_rank(step: StepConfig, unit: WrapUnit) -> int:
    """Bytes of ``unit``'s frozen parameters one rank holds, in their own dtypes (FSDP1: a frozen
    unit's padded ``FlatParameter`` shard)."""
    w = _shard_size(step)
    if step.fsdp1 is not None:
        return 0 if fsdp1_unit_trains(unit) else step.padded_numel(unit) // w * unit_stored_bytes(step, unit)
    return sum(padded_numel(p, w) // w * stored_bytes(step, p) for p in unit.params if not p.trainable)


def numel_per_rank(step: StepConfig) -> int:
    """Elements whose optimizer state this rank steps."""
    if step.zero is not None:
        from sim.schedule.zero_state import zero_state

        return zero_state(step).partition_numel
    return sum(unit_numel_per_rank(step, u) for u in step.units)


def optimizer_tensor_numels(step: StepConfig) -> tuple[int, ...]:
    """The tensors the optimizer steps on this rank, their element counts (summing to
    ``numel_per_rank``): each unit's (``unit_tensor_numels_per_rank``), empty ones left out; ZeRO's
    partition as one."""
    if step.zero is not None:
        return (numel_per_rank(step),)
    return tuple(n for u in step.units for n in unit_tensor_numels_per_rank(step, u) if n)


def model_state(step: StepConfig) -> ModelState:
    if step.zero is not None:
        from sim.schedule.zero_state import zero_state

        z = zero_state(step)
        return ModelState(params=z.params, grads=z.grads, optimizer=z.optimizer)
    numel, b = numel_per_rank(step), step.master_bytes
    if step.fsdp1 is not None and step.fsdp1.offload_params:  # CPUOffload: shards and states on the host
        return ModelState(params=step.quant_state_bytes, grads=numel * b, optimizer=0)
    if step.fsdp2_host_state:  # CPUOffloadPolicy: every shard and state on the host; QLoRA's state stays
        return ModelState(params=step.quant_state_bytes, grads=0, optimizer=0)
    frozen = sum(unit_frozen_bytes_per_rank(step, u) for u in step.units) + step.quant_state_bytes
    return ModelState(
        params=numel * b + frozen, grads=numel * b, optimizer=OPTIMIZER_STATES[step.optimizer] * numel * b
    )


def host_bytes(step: StepConfig) -> int:
    """Pinned host memory one rank holds: FSDP1 CPUOffload's fp32 shards, ``_cpu_grad`` and the
    optimizer states; ZeRO-Offload's master, states and fp32 gradients (``zero_state``)."""
    if step.zero is not None:
        from sim.schedule.zero_state import zero_state

        return zero_state(step).host_bytes
    offloaded = (step.fsdp1 is not None and step.fsdp1.offload_params) or step.fsdp2_host_state
    if offloaded:  # CPUOffload(Policy): the shards (frozen ones in their dtype), gradients, states
        frozen = sum(unit_frozen_bytes_per_rank(step, u) for u in step.units)
        return (2 + OPTIMIZER_STATES[step.optimizer]) * numel_per_rank(step) * step.master_bytes + frozen
    return 0


def ddp_bucket_bytes(step: StepConfig) -> int:
    """DDP's persistent gradient buckets (none under FSDP)."""
    return numel_per_rank(step) * step.reduce_bytes if step.ddp else 0


def resident_allocs(step: StepConfig) -> list[Alloc]:
    """What is allocated before the step starts: module buffers, parameters and optimizer states
    (per unit under FSDP, as each ``fully_shard`` group or ``FlatParameter`` owns its shards), DDP's buckets."""
    b, states = step.master_bytes, OPTIMIZER_STATES[step.optimizer]
    buffers = Alloc(label="buffers", category=MemoryCategory.PARAMS, bytes=step.buffer_bytes)
    quant = (
        [Alloc(label="quant_state", category=MemoryCategory.PARAMS, bytes=step.quant_state_bytes)]
        if step.quant_state_bytes
        else []
    )
    if step.zero is not None:
        from sim.schedule.zero_state import zero_resident_allocs

        return [buffers, *zero_resident_allocs(step)]
    if step.ddp:
        numel = numel_per_rank(step)
        frozen = sum(unit_frozen_bytes_per_rank(step, u) for u in step.units)
        return [
            Alloc(label="params", category=MemoryCategory.PARAMS, bytes=numel * b + frozen),
            buffers,
            *quant,
            Alloc(label="optimizer", category=MemoryCategory.OPTIMIZER, bytes=states * numel * b),
            Alloc(label="ddp_buckets", category=MemoryCategory.COMM_BUFFERS, bytes=ddp_bucket_bytes(step)),
        ]
    allocs = [buffers, *quant]
    if (step.fsdp1 is not None and step.fsdp1.offload_params) or step.fsdp2_host_state:
        return allocs  # CPUOffload(Policy): the shards and the optimizer states live in host memory
    for unit in step.units:
        numel = unit_numel_per_rank(step, unit)
        nbytes = numel * b + unit_frozen_bytes_per_rank(step, unit)
        allocs.append(Alloc(label=f"param:{unit.name}", category=MemoryCategory.PARAMS, bytes=nbytes))
        if states and numel:
            allocs.append(
                Alloc(label=f"optim:{unit.name}", category=MemoryCategory.OPTIMIZER, bytes=states * numel * b)
            )
    return allocs


def deepspeed_convention_bytes(
    n_params: int, strategy: Strategy, shard: int, zero_stage: int | None = None, frozen: int = 0
) -> int:
    """The ZeRO paper's count (Rajbhandari et al. 2020, Sec. 3.1): 2Φ fp16 params + 2Φ grads +
    12Φ fp32 master/momentum/variance, partitioned by stage (P_os: 4Φ + 12Φ/N; P_os+g: 2Φ + 14Φ/N;
    P_os+g+p: 16Φ/N). Not what FSDP2 allocates (see README). ``frozen`` of the ``n_params``
    (LoRA's base) count their 2Φ fp16 weights only, partitioned with the parameters."""
    t = n_params - frozen
    if zero_stage == 1:
        return 4 * t + 12 * t // shard + 2 * frozen
    if strategy is Strategy.NO_SHARD:
        return 16 * t + 2 * frozen
    if strategy in (Strategy.SHARD_GRAD_OP, Strategy.HYBRID_SHARD_ZERO2) or zero_stage == 2:
        return 2 * t + 14 * t // shard + 2 * frozen
    return (16 * t + 2 * frozen) // shard
