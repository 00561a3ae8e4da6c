"""DeepSpeed ZeRO's model state per rank, as DeepSpeed 0.19.8 allocates it.

- Stages 1 and 2 (``deepspeed/runtime/zero/stage_1_and_2.py``): the model's parameters in the
  training dtype, flattened into one buffer per parameter group and padded to a multiple of
  2 x the data-parallel size (``nccl_start_alignment_factor``), kept whole on every rank; each
  rank owns 1/N of it: an fp32 master partition and AdamW's two fp32 states. Stage 1 keeps every
  gradient whole (``param.grad``); stage 2 keeps its partition of them (``grads_in_partition``),
  in the training dtype (``grad_accum_dtype`` defaults to the model's). ``grads_in_partition``
  and the IPG bucket buffers are allocated in each backward and released after it
  (``_release_ipg_buffers``), so they are not resident between steps.
- Stage 3 (``stage3.py``, ``partition_parameters.py``): every parameter is padded to a multiple
  of N and split (``_aligned_size``); a rank keeps its partitions in the training dtype, the fp32
  master and AdamW states of them, and a flat gradient-partition buffer in the training dtype
  (``grad_partitions_flat_buffer``). Parameters below ``stage3_param_persistence_threshold``
  elements are persistent: whole on every rank, always.
The fp32 master copy counts as optimizer state, as the ZeRO paper counts it (2Φ + 2Φ + 12Φ:
Rajbhandari et al. 2020, Sec. 3.1); with ``offload_optimizer`` it lives in host memory, and with
``offload_param`` so do the stage-3 parameter partitions.
"""

from dataclasses import dataclass
from math import ceil

from sim.core.events import MemoryCategory
from sim.core.program import Alloc
from sim.schedule.step import StepConfig
from sim.workload.model import ParamSpec
from sim.workload.options import OPTIMIZER_STATES, OffloadDevice

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py: 4-byte alignment / sizeof(fp16)


def zero_params(step: StepConfig) -> list[ParamSpec]:
    """Every parameter once, in the order the forward pass uses them (for a Llama, registration
    order: one optimizer parameter group)."""
    seen: dict[str, ParamSpec] = {}
    for seg in step.segments:
        for p in seg.params:
            seen.setdefault(p.name, p)
    return list(seen.values())


def flat_padded_numel(step: StepConfig) -> int:
    """Stages 1/2: the flattened group padded to a multiple of 2·N."""
    alignment = NCCL_START_ALIGNMENT_FACTOR * step.world_size
    return ceil(sum(p.numel for p in zero_params(step)) / alignment) * alignment


def partition_numel(spec: ParamSpec, world: int) -> int:
    """Stage 3: one parameter's partition, the parameter padded to a multiple of N."""
    return ceil(spec.numel / world)


def gathered_numel(spec: ParamSpec, world: int) -> int:
    """Stage 3: one parameter as gathered and as reduce-scattered, padded to a multiple of N."""
    return partition_numel(spec, world) * world


def persistent(step: StepConfig, spec: ParamSpec) -> bool:
    """Stage 3: ``ds_persist``, parameters at or below the persistence threshold."""
    assert step.zero is not None
    return spec.numel <= step.zero.param_persistence_threshold


@dataclass(frozen=True, kw_only=True)
class ZeroState:
    """Device bytes of the persistent state per rank, and what offload moves to the host."""

    params: int
    grads: int
    optimizer: int
    host_bytes: int  # pinned host memory: offloaded master weights, states, gradients, parameters
    partition_numel: int  # elements whose optimizer state this rank owns
    nvme_bytes: int = 0  # ZeRO-Infinity: what this rank swaps to NVMe


def zero_state(step: StepConfig) -> ZeroState:
    zero = step.zero
    assert zero is not None
    n, b = step.world_size, step.param_bytes
    states = OPTIMIZER_STATES[step.optimizer] + 1  # + the fp32 master copy
    if zero.stage < 3:
        flat = flat_padded_numel(step)
        part = flat // n
        params, grads = flat * b, (flat if zero.stage == 1 else part) * b  # stage 1: every gradient whole
    else:
        specs = zero_params(step)
        part = sum(partition_numel(p, n) for p in specs)
        whole = sum(p.numel for p in specs if persistent(step, p))
        params, grads = part * b + whole * b, part * b
    optimizer = states * part * step.master_bytes
    params, grads, optimizer, host, nvme = _offloaded(step, params, grads, optimizer, part)
    return ZeroState(
        params=params,
        grads=grads,
        optimizer=optimizer,
        host_bytes=host,
        partition_numel=part,
        nvme_bytes=nvme,
    )


def _offloaded(step: StepConfig, params: int, grads: int, optimizer: int, part: int) -> tuple[int, ...]:
    """(params, grads, optimizer) left on the device, and (host, NVMe) bytes, under offload: the
    master and states leave the device with ``offload_optimizer`` and the fp32 gradient partition
    lives on the host (stage 3: ``grad_partitions_flat_buffer`` pinned there, so the device keeps
    no gradient partition; stage 1 still keeps every gradient whole); ``offload_param`` moves the
    stage-3 parameter partitions."""
    zero = step.zero
    assert zero is not None
    host = nvme = 0
    if zero.offload_optimizer is not OffloadDevice.NONE:
        if zero.offload_optimizer is OffloadDevice.NVME:
            nvme += optimizer
        else:
            host += optimizer
        host += part * step.master_bytes
        optimizer = 0
        grads = grads if zero.stage == 1 else 0
    if zero.offload_param is not OffloadDevice.NONE:
        moved = part * step.param_bytes
        nvme, host = (
            (nvme + moved, host) if zero.offload_param is OffloadDevice.NVME else (nvme, host + moved)
        )
        params -= moved
    return params, grads, optimizer, host, nvme


def zero_resident_allocs(step: StepConfig) -> list[Alloc]:
    """What a ZeRO rank holds when a step starts: its parameters (and persistent ones), the
    optimizer's fp32 partition and states, and for stage 3 the gradient-partition buffer and the
    IPG bucket (allocated at init; stages 1/2 allocate theirs in each backward)."""
    zero = step.zero
    assert zero is not None
    state = zero_state(step)
    allocs = [
        Alloc(label="params", category=MemoryCategory.PARAMS, bytes=state.params),
        Alloc(label="optimizer", category=MemoryCategory.OPTIMIZER, bytes=state.optimizer),
    ]
    if zero.stage == 3:
        allocs.append(Alloc(label="grads_in_partition", category=MemoryCategory.GRADS, bytes=state.grads))
        if zero.contiguous_gradients:
            nbytes = zero.reduce_bucket_size * step.param_bytes
            allocs.append(Alloc(label="ipg_bucket", category=MemoryCategory.COMM_BUFFERS, bytes=nbytes))
    return allocs


def grads_in_partition_numel(step: StepConfig) -> int:
    """Stages 1/2: ``grads_in_partition`` holds every parameter that overlaps a rank's partition,
    whole (``copy_grads_in_partition`` sums ``params_in_partition``); the largest over ranks."""
    part = flat_padded_numel(step) // step.world_size
    sizes = [0] * step.world_size
    start = 0
    for p in zero_params(step):
        first, last = start // part, min(step.world_size - 1, (start + p.numel - 1) // part)
        for rank in range(first, last + 1):
            sizes[rank] += p.numel
        start += p.numel
    return max(sizes)


def zero_infinity_working_memory(
    *, hidden: int, n_heads: int, n_layers: int, micro_batch: int, seq_len: int, checkpoint_every: int | None
) -> dict[str, int]:
    """ZeRO-Infinity's memory requirements beside the model states (Rajbhandari et al. 2021,
    "ZeRO-Infinity: Breaking the GPU Memory Wall", arXiv:2104.07857, Sec. 3), for a transformer of
    hidden size hd with a 4·hd MLP, as the paper writes them:
    - activation checkpoints: 2 · bsz · seq · hd · nl / ci bytes (ci blocks between checkpoints);
    - model state working memory (MSWM), the largest operator's fp32 parameters and gradients
      once every state is offloaded: the hd x 4hd linear, 4 · hd · 4hd bytes;
    - activation working memory (AWM), what recomputing between two checkpoints holds:
      bsz · seq · ci · (16 · hd + 2 · attn_heads · seq) bytes.
    Without checkpointing ci is the whole model (nl) and there is no checkpoint to keep."""
    ci = checkpoint_every or n_layers
    return {
        "activation_checkpoint_bytes": 2 * micro_batch * seq_len * hidden * n_layers // ci
        if checkpoint_every
        else 0,
        "model_state_working_memory_bytes": 4 * hidden * 4 * hidden,
        "activation_working_memory_bytes": micro_batch * seq_len * ci * (16 * hidden + 2 * n_heads * seq_len),
        "checkpoint_interval_blocks": ci,
    }
