"""Cheap bounds that let the tuner skip a candidate without simulating it.

Both are computed from the same ``StepConfig`` the schedule builders use (``sim.simulate.build_step``)
and the same model-state formula (``sim.schedule.model_state``), so they are bounds on the
simulator's own numbers, not estimates of a different model:

- ``memory_lower_bound_bytes``: the memory held at two instants every schedule goes through
  (``sim.schedule.fsdp2``, ``sim.schedule.ddp``): during the optimizer step and during the last
  forward op of the last micro-batch. Any peak is at least either.
- ``step_time_lower_bound_s``: the work that is certain to run on the compute stream of every rank,
  one op after another: forward, backward, recomputation, FSDP2's copy-out / copy-in, DDP's bucket
  copy-out and the optimizer. Without compute jitter no rank's compute is shorter than this, so
  neither is the step.
"""

from sim.schedule.model_state import ddp_bucket_bytes, model_state, numel_per_rank
from sim.schedule.optimizer import optimizer_temp_pieces
from sim.schedule.step import StepConfig
from sim.workload.units import WrapUnit


def activations_at_forward_end_bytes(step: StepConfig) -> int:
    """Saved activations of one micro-batch when its last forward op runs, plus that op's
    transient: the saved tensors of every segment outside a checkpoint region, and each region's
    input (and, under op-level SAC, the outputs it keeps): a region frees its intermediates as it ends."""
    segs, figs, plan = step.segments, step.figures, step.checkpoint
    saved = sum(step.block_input_bytes[b] for b in plan.blocks)
    for s, f in zip(segs, figs, strict=True):
        if not plan.covers(s.block):
            saved += f.saved_bytes
        elif plan.selective_op:
            saved += f.sac_kept_bytes
    return saved + figs[-1].forward_transient_bytes


def _unsharded_at_forward_end_bytes(step: StepConfig) -> int:
    """Unsharded parameters alive at the end of forward: DDP's autocast weight copies; FSDP2's
    root unit (never resharded) and, without reshard-after-forward, every unit."""
    if not step.sharded:
        if step.param_bytes == step.master_bytes:
            return 0
        return sum(sum(p.numel for p in s.params) for s in step.segments) * step.param_bytes
    kept = step.units if not step.reshard_after_forward else step.units[-1:]
    held = sum(_padded(step, u) for u in kept) * step.param_bytes
    if step.reshard_after_forward and step.post_forward_size is not None:  # the 1/k slices kept
        held += sum(_padded(step, u) for u in step.units[:-1]) * step.param_bytes // step.post_forward_size
    return held


def _padded(step: StepConfig, unit: WrapUnit) -> int:
    """A unit's unsharded elements as FSDP2 pads them (under EP its experts over world / E)."""
    return step.padded_numel(unit) if step.expert_params else unit.padded_numel(step.shard_size)


def memory_lower_bound_bytes(step: StepConfig) -> int:
    """A lower bound on the simulated peak memory of any rank, in bytes.

    During the optimizer step: parameters, gradients and optimizer states (the model state),
    AdamW's temporaries (``optimizer_temp_pieces``) and DDP's gradient buckets. During
    the last forward op: parameters, optimizer states, gradients when accumulating (kept from the
    first micro-batch on), the saved activations and the unsharded parameters still held.
    """
    state = model_state(step)
    temp = sum(optimizer_temp_pieces(step))
    persistent = state.params + state.optimizer + step.buffer_bytes + ddp_bucket_bytes(step)
    at_optimizer = persistent + state.grads + temp
    grads = state.grads if step.grad_accum > 1 else 0
    at_forward_end = (
        persistent + grads + activations_at_forward_end_bytes(step) + _unsharded_at_forward_end_bytes(step)
    )
    return max(at_optimizer, at_forward_end)


def step_time_lower_bound_s(step: StepConfig) -> float:
    """A lower bound on the simulated step time, in seconds: the compute stream's certain work."""
    costs, segs, figs = step.costs, step.segments, step.figures
    per_mb = sum(f.forward_s + f.backward_s for f in figs)
    plan = step.checkpoint
    per_mb += sum(
        f.sac_recompute_s if plan.selective_op else f.recompute_s
        for s, f in zip(segs, figs, strict=True)
        if plan.covers(s.block)
    )
    numel = numel_per_rank(step)
    if not step.sharded:
        per_mb += costs.copy_s(numel * step.master_bytes)  # the reducer's bucket copy-out
        return step.grad_accum * per_mb + costs.optimizer_s(numel, step.master_bytes)
    padded = [_padded(step, u) for u in step.units]
    copy_out = sum(costs.copy_s(n * step.param_bytes) for n in padded)  # forward, every unit
    if step.reshard_after_forward:  # backward re-gathers every non-root unit
        copy_out += sum(costs.copy_s(n * step.param_bytes) for n in padded[:-1])
    copy_in = sum(costs.copy_s(n * max(step.param_bytes, step.reduce_bytes)) for n in padded)
    per_mb += copy_out + copy_in
    return step.grad_accum * per_mb + costs.optimizer_s(numel, step.master_bytes)
