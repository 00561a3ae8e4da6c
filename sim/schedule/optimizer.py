"""The step's end: a grad scaler's unscale (and, sharded, its found-inf all-reduce), the
gradients' norm clipped (and, sharded, the norm all-reduced) and the optimizer step over the
parameters this rank holds, with foreach AdamW's temporaries. Emitted
through any schedule's ``OpEmitter``; the gradients it consumes are the schedule's.
"""

from sim.core.events import MemoryCategory, OpKind, Stream
from sim.core.program import Alloc
from sim.core.topology import GroupKind
from sim.dtypes import dtype_bytes
from sim.schedule.emit import OpEmitter
from sim.schedule.model_state import numel_per_rank, optimizer_tensor_numels
from sim.schedule.step import StepConfig
from sim.workload.options import OptimizerImplementation, OptimizerName
from sim.workload.units import ROOT


def emit_grad_scaler_unscale(emitter: OpEmitter) -> None:
    """``scaler.unscale_(optimizer)``: ``_amp_foreach_non_finite_check_and_unscale_`` reads and
    writes every fp32 gradient element this rank holds; ``ShardedGradScaler`` then all-reduces
    its found-inf flag (one fp32 element) over the shard group (torch 2.13
    ``fsdp/sharded_grad_scaler.py``); DDP's ``GradScaler`` needs no collective."""
    cfg = emitter.cfg
    mb = cfg.grad_accum - 1
    numel = numel_per_rank(cfg)
    op = emitter.compute(
        OpKind.COPY, "grad scaler unscale_", ROOT, mb, cfg.costs.copy_s(numel * cfg.master_bytes)
    )
    if cfg.sharded and cfg.shard_size > 1:
        _small_all_reduce(emitter, dtype_bytes("fp32"), GroupKind.SHARD, op, "all_reduce found_inf")


def emit_grad_clip(emitter: OpEmitter) -> None:
    """``clip_grad_norm_`` (torch 2.13 ``nn/utils/clip_grad.py``, foreach, torchtitan's call):
    ``torch._foreach_norm`` reads every gradient element this rank holds; a sharded gradient's norm
    is partial, so it is all-reduced over the shard group (``_norm_bytes``); then
    ``torch._foreach_mul_`` scales every element in place. Its outputs are one scalar per tensor,
    small-pool blocks the allocator's existing segments hold: no buffer of note. DDP's gradients are
    whole on every rank: no collective (FSDP1's NO_SHARD all-reduces all the same)."""
    cfg = emitter.cfg
    mb = cfg.grad_accum - 1
    grad_bytes = numel_per_rank(cfg) * cfg.master_bytes
    # copy_s reads and writes its bytes: the norms only read theirs
    norms = emitter.compute(OpKind.COPY, "clip_grad_norm_ norms", ROOT, mb, cfg.costs.copy_s(grad_bytes) / 2)
    group = _norm_group(cfg)
    if group is not None:
        _small_all_reduce(emitter, _norm_bytes(cfg), group, norms, "all_reduce gradient norm")
    emitter.compute(OpKind.COPY, "clip_grad_norm_ scale", ROOT, mb, cfg.costs.copy_s(grad_bytes))


def optimizer_temp_pieces(cfg: StepConfig) -> tuple[int, ...]:
    """The bytes of the temporaries AdamW holds at once, one piece per tensor, in the states'
    dtype (torch 2.13 ``optim/adam.py``, which AdamW runs):
    - foreach: one per tensor it steps, all at once (``torch._foreach_sqrt(exp_avg_sqs)``,
      divided and added to in place, then read by ``_foreach_addcdiv_``);
    - for-loop: per tensor ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``, so
      at the division the square root and its quotient, while the name ``denom`` still holds the
      previous tensor's: at most the previous tensor and two of the current one (llama-recipes'
      ``AnyPrecisionAdamW`` loops the same way);
    - fused: none (``torch._fused_adamw_`` updates the states in its kernel).
    SGD with momentum updates its buffers in place: none."""
    if cfg.optimizer is not OptimizerName.ADAMW:
        return ()
    numels = optimizer_tensor_numels(cfg)
    b = cfg.master_bytes
    impl = cfg.optimizer_implementation
    if impl is OptimizerImplementation.FOREACH:
        return tuple(n * b for n in numels)
    if impl is OptimizerImplementation.FUSED or not numels:
        return ()
    previous = (0, *numels[:-1])
    _, before, current = max((p + 2 * n, p, n) for p, n in zip(previous, numels, strict=True))
    return tuple(x * b for x in (before, current, current) if x)


def emit_optimizer_step(emitter: OpEmitter, grad_labels: tuple[str, ...]) -> None:
    """One step over the parameters this rank holds; ``zero_grad(set_to_none=True)`` after it
    frees ``grad_labels``. AdamW's temporaries (``optimizer_temp_pieces``) are as many
    allocations, which the caching allocator fits into the holes backward left. The step's time
    is the calibrated per-element cost whatever the implementation (the calibration times
    foreach; a for-loop's launches per tensor are not modelled)."""
    cfg = emitter.cfg
    if cfg.grad_scaler:
        emit_grad_scaler_unscale(emitter)
    if cfg.clip_grad_norm:
        emit_grad_clip(emitter)
    numel = numel_per_rank(cfg)
    temp = "optimizer_temp"
    pieces = optimizer_temp_pieces(cfg)
    emitter.compute(
        OpKind.OPTIMIZER,
        "optimizer step",
        ROOT,
        cfg.grad_accum - 1,
        cfg.costs.optimizer_s(numel, cfg.master_bytes),
        allocs=(Alloc(label=temp, category=MemoryCategory.OTHER, bytes=sum(pieces), pieces=pieces),),
        frees=(temp, *grad_labels),
    )


def _norm_bytes(cfg: StepConfig) -> int:
    """What ``clip_grad_norm_`` all-reduces: FSDP1's one fp32 total (``dist.all_reduce`` of the
    local norm to the power p); over FSDP2's DTensor gradients the stacked per-parameter norms, one
    fp32 each, which their partial placement redistributes (measured: 156 B over llama-5m's 39
    parameters, a real 2-rank gloo step, ``fsdpsim validate`` with training.max_grad_norm = 1)."""
    fp32 = dtype_bytes("fp32")
    if cfg.fsdp1 is not None:
        return fp32
    return fp32 * sum(1 for u in cfg.units for p in u.params if p.trainable)


def _norm_group(cfg: StepConfig) -> GroupKind | None:
    """The group ``clip_grad_norm_`` all-reduces the norm over: a sharded gradient's shard group;
    FSDP1 under NO_SHARD still all-reduces its (zero) sharded norm, over the world; none where
    every rank holds whole gradients (DDP) or the group is one rank."""
    if cfg.sharded:
        return GroupKind.SHARD if cfg.shard_size > 1 else None
    return GroupKind.REPLICATE if cfg.fsdp1 is not None and cfg.world_size > 1 else None


def _small_all_reduce(emitter: OpEmitter, nbytes: int, group: GroupKind, after: int, name: str) -> None:
    """An fp32 all-reduce of a few elements after op ``after``, which the next compute op waits for
    (the step cannot go on before every rank's figure is in)."""
    op = emitter.collective(
        OpKind.ALL_REDUCE,
        Stream.ALL_REDUCE,
        ROOT,
        nbytes,
        group,
        "fp32",
        mb=emitter.cfg.grad_accum - 1,
        deps=(after,),
        name=name,
    )
    emitter.compute_waits.append(op)
