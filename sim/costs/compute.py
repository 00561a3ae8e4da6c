"""Time and activation memory of the computation, per segment. Pure functions of a profile.

Each op's forward and backward time comes from a kernel model: on a GPU profile with the
published kernel-level figures, ``sim.costs.gpu.GpuKernelModel`` (matmul shapes, attention
kernels, memory-bound bytes, launch floors); otherwise ``Roofline``: flops / (peak × efficiency)
+ memory_bytes / HBM bandwidth, backward twice forward (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", Sec. 5.1). A ``compute`` section in the
profile (written by ``calibrate compute``) replaces these with measurements: each group
(embedding, decoder block, head) is scaled so that its total equals the measured time or bytes,
which keeps the split between the ops of a group (needed for ``linear`` wrapping) from the model.
A model described from its config.json is measured on its own units (``calibrate.hf_units``):
each decoder block is scaled by its kind's measurement (the section's ``block_units``), the
embedding by ``embed``, and all other work outside the blocks (rotary tables included) by
``head``, which was timed as the rest of the model; its bytes stay the description's
(``GroupScale``; the scales are found by ``sim.costs.compute_build``, which builds a scenario's
``ComputeCosts``). A segment's order of requests to the allocator is ``sim.costs.request_order``'s.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Protocol

from sim.core.events import RequestOrder
from sim.costs.request_order import backward_order, request_order
from sim.workload.layer_op import CalibrationGroup, LayerOp, figure_tensors
from sim.workload.op_counts import ATTENTION_LAUNCHES
from sim.workload.options import OptimizerName
from sim.workload.units import Segment

# Bytes AdamW and SGD-with-momentum move per fp32 element: AdamW reads param, grad, exp_avg,
# exp_avg_sq and writes param, exp_avg, exp_avg_sq (7 x 4 B); SGD reads param, grad, momentum
# and writes param, momentum (5 x 4 B).
OPTIMIZER_BYTES_PER_ELEMENT = {OptimizerName.ADAMW: 28, OptimizerName.SGD: 20, OptimizerName.NONE: 0}


class KernelModel(Protocol):
    def op_s(self, op: LayerOp, attention_kernel: str) -> tuple[float, float]: ...

    def sac_recompute_s(self, op: LayerOp, attention_kernel: str) -> float: ...


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """An op's forward time as flops at the peak × efficiency plus its bytes at the HBM bandwidth;
    backward twice forward."""

    flops_per_s: float
    hbm_Bps: float

    def op_s(self, op: LayerOp, attention_kernel: str) -> tuple[float, float]:
        if op.gradients_in_forward:  # a fused linear cross-entropy: its backward's matmuls in forward
            memory = op.memory_bytes / self.hbm_Bps
            return 3.0 * op.flops / self.flops_per_s + memory, op.backward_memory_factor * memory
        fwd = op.flops / self.flops_per_s + op.memory_bytes / self.hbm_Bps
        if op.backward_flops is None:
            return fwd, 2.0 * fwd
        return fwd, op.backward_flops / self.flops_per_s + (op.backward_memory_bytes or 0.0) / self.hbm_Bps

    def sac_recompute_s(self, op: LayerOp, attention_kernel: str) -> float:
        """Op-level selective checkpointing recomputes what it does not keep (see ``GpuKernelModel``)."""
        if op.sac_kept_bytes and op.gemm is not None:
            return 0.0
        if op.sac_kept_bytes:
            return op.memory_bytes / self.hbm_Bps
        return self.op_s(op, attention_kernel)[0]


@dataclass(frozen=True, kw_only=True)
class GroupScale:
    """Measured / analytic ratios for one calibration group (1.0 everywhere when uncalibrated)."""

    forward: float = 1.0
    backward: float = 1.0
    recompute: float = 1.0
    saved: float = 1.0
    forward_transient: float = 1.0
    backward_transient: float = 1.0


TRANSIENTS = ("forward_transient", "backward_transient")


@dataclass(frozen=True, kw_only=True)
class BackwardStep:
    """One op's backward within its segment: what it holds beyond the segment's saved bytes (its
    transient, less what the segment's later ops have already released; negative where they
    have released more than it makes), its transient's tensors, and the
    trainable parameters (their element counts) of the segment's later ops, whose gradients the
    backward has already made and the system still holds (FSDP1's view gradients until the split
    backward concatenates them, FSDP2's and DDP's until the unit's reduction)."""

    beyond_saved_bytes: int
    pieces: tuple[int, ...] = ()  # empty: one tensor
    later_grad_numels: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class SegmentFigures:
    """Everything the schedules need to know about one segment's computation."""

    forward_s: float
    backward_s: float
    recompute_s: float
    saved_bytes: int
    forward_transient_bytes: int
    backward_transient_bytes: int
    # the host's eager dispatch of the segment's ops (zero where the host is the device or unmodelled)
    forward_host_s: float = 0.0
    backward_host_s: float = 0.0
    # the kernels the host launches for them: one per Python-level op forward, about twice as many
    # backward (autograd's), as the dispatch times count them
    forward_launches: int = 0
    backward_launches: int = 0
    # of saved_bytes, what ops after the segment's block save (kept where that region is not checkpointed)
    saved_after_block_bytes: int = 0
    # of saved_bytes, its first op's input saved as it is (``LayerOp.saved_input_bytes``): first
    # in a checkpointed block, that tensor is the block's kept input, allocated once
    block_input_saved_bytes: int = 0
    # of saved_bytes, the next block's input (``LayerOp.next_block_input_bytes``): where the segment
    # keeps its saves and that block is checkpointed, the block's kept input is that tensor
    next_block_input_bytes: int = 0
    # op-level selective checkpointing: the outputs it keeps, and what it recomputes
    sac_kept_bytes: int = 0
    sac_recompute_s: float = 0.0
    # a checkpointed block's segment: the most its block holds while the segment runs (measured
    # for described models, ``LayerOp.checkpointed_forward_bytes``); None: saved + transient
    checkpointed_forward_bytes: int | None = None
    # a checkpointed block's segment as its block is recomputed: its transient of what the block's
    # ops make (``LayerOp.recompute_transient_bytes``; what the traced forward held from before the
    # block, a stack's biases and masks, a checkpoint region keeps among its inputs, which the
    # schedule holds as its own buffers); None: the forward transient
    recompute_transient_bytes: int | None = None
    # the tensors of the byte figures, in allocation order, where the ops know them (empty: one
    # block); the caching allocator's replay serves them one by one where no order is known
    saved_pieces: tuple[int, ...] = ()
    forward_transient_pieces: tuple[int, ...] = ()
    backward_transient_pieces: tuple[int, ...] = ()
    checkpointed_forward_pieces: tuple[int, ...] = ()
    recompute_transient_pieces: tuple[int, ...] = ()
    # the order of the forward's requests, its saved tensors and its transient's interleaved as
    # the ops make and free them (``request_order``), and where the block is checkpointed; None:
    # not known, the tensors above then serve
    forward_order: RequestOrder | None = None
    checkpointed_forward_order: RequestOrder | None = None
    # the backward's (``backward_order``): served in place of the backward transient's tensors
    backward_order: RequestOrder | None = None
    # each op's backward, in forward order (``BackwardStep``); empty: the segment's transient only
    backward_steps: tuple[BackwardStep, ...] = ()
    grad_numel: int = 0  # trainable elements of the segment's ops

    def tensors(self, figure: str) -> tuple[int, ...]:
        """One byte figure's tensors (``sim.workload.layer_op.figure_tensors``)."""
        return figure_tensors(self, figure)

    def backward_held(self, grad_bytes: int, *, in_place: bool = False) -> tuple[int, tuple[int, ...]]:
        """The segment's backward transient with the gradients its ops make along the way:
        ``grad_bytes`` is what the system keeps of the segment's gradients once its backward is
        done, spread over its trainable elements; at the op where the transient and the later ops'
        gradients together peak, their bytes and tensors. ``in_place``: the gradients are added
        into kept ones as they are made (``AccumulateGrad`` on an existing ``.grad``), so each op
        holds only its own new gradients, while it runs. Without gradients (or steps), the
        transient alone."""
        alone = (self.backward_transient_bytes, self.tensors("backward_transient"))
        if not grad_bytes or not self.grad_numel or not self.backward_steps:
            return alone
        per_element = grad_bytes / self.grad_numel
        later = [sum(step.later_grad_numels) for step in self.backward_steps]
        own = [before - after for before, after in zip([self.grad_numel, *later], later, strict=False)]

        def grads_of(j: int) -> tuple[int, ...]:
            if in_place:
                return (round(own[j] * per_element),)
            return tuple(round(n * per_element) for n in self.backward_steps[j].later_grad_numels)

        def held(j: int) -> int:
            return self.backward_steps[j].beyond_saved_bytes + sum(grads_of(j))

        at = max(range(len(self.backward_steps)), key=held)
        best = self.backward_steps[at]
        if held(at) <= alone[0]:
            return alone
        grads = tuple(n for n in grads_of(at) if n)
        if best.beyond_saved_bytes <= 0:  # the saves released by then make room for part of them
            return held(at), _trimmed(grads, held(at))
        return held(at), (*(best.pieces or (best.beyond_saved_bytes,)), *grads)


# the LayerOp fields ``ComputeCosts.figures`` reads as they are (``_cost_key`` adds block and params)
_COST_FIELDS = attrgetter(
    *(f.name for f in fields(LayerOp) if f.name not in {"name", "module", "block", "params", "reuses"})
)


@dataclass(frozen=True, kw_only=True)
class ComputeCosts:
    """The compute cost model for one scenario on one profile."""

    kernels: KernelModel
    attention_kernel: str
    copy_Bps: float
    optimizer_s_per_element: float
    # FSDP2's measured host work around each unit (hooks, DTensor, allocation), per unit and pass;
    # zero unless the host is the device (on a GPU it runs ahead of the kernels)
    fsdp_forward_overhead_s: float = 0.0
    fsdp_backward_overhead_s: float = 0.0
    # DeepSpeed ZeRO's measured engine.step() less its collectives, per partition element (None:
    # not measured for this stage, or the host is not the device); the schedules then charge it
    # in place of their modelled casts, unscale, optimizer and copy-back
    deepspeed_step_s_per_element: float | None = None
    # DeepSpeed's measured host work per decoder layer and pass beyond its collectives and the
    # copies the schedules charge (zero unless measured for the stage and the host is the device)
    deepspeed_layer_forward_s: float = 0.0
    deepspeed_layer_backward_s: float = 0.0
    # on a GPU host: eager dispatch per Python-level op (backward: autograd issues about twice as
    # many), and FSDP2's per-unit hook work, both on the host stream
    host_op_s: float = 0.0
    fsdp_forward_host_s: float = 0.0
    fsdp_backward_host_s: float = 0.0
    scales: Mapping[CalibrationGroup, GroupScale] = field(default_factory=dict)
    # a described model's decoder blocks, each scaled by its own kind's measurement
    block_scales: Mapping[int, GroupScale] = field(default_factory=dict)

    @property
    def calibrated(self) -> bool:
        return bool(self.scales)

    def launches(self, op: LayerOp) -> tuple[int, int]:
        """The kernels one op launches (forward, backward): as measured, with its attention
        kernel's (``ATTENTION_LAUNCHES``); else one per eager call forward, two backward."""
        if op.launches is None:
            return op.host_ops, 2 * op.host_ops
        forward, backward = op.launches
        if op.attention is not None:
            kernel = ATTENTION_LAUNCHES[self.attention_kernel]
            forward, backward = forward + kernel[0], backward + kernel[1]
        return forward, backward

    def op_s(self, op: LayerOp) -> tuple[float, float]:
        """Uncalibrated (forward, backward) time of one op, from the kernel model."""
        return self.kernels.op_s(op, self.attention_kernel)

    def _scale(self, op: LayerOp, quantity: str) -> float:
        if self.block_scales:
            group = op.group or CalibrationGroup.HEAD  # the head was timed as the rest of the model
            block = self.block_scales.get(op.block) if op.block is not None else None
            scale = block if block is not None else self.scales.get(group)
        else:
            scale = self.scales.get(op.group) if op.group else None
        return 1.0 if scale is None else float(getattr(scale, quantity))

    def segment_figures(self, segments: Sequence[Segment]) -> tuple[SegmentFigures, ...]:
        """``figures`` of each segment. Segments whose ops differ only in what the figures never
        read (a model's identical blocks: names, and block indices unless blocks are scaled one
        by one) share one computation: a step of linear wrap has hundreds of segments, and a
        tuner builds hundreds of steps."""
        memo: dict[tuple[object, ...], SegmentFigures] = {}
        out = []
        for seg in segments:
            key = tuple(self._cost_key(op) for op in seg.ops)
            if key not in memo:
                memo[key] = self.figures(seg)
            out.append(memo[key])
        return tuple(out)

    def _cost_key(self, op: LayerOp) -> tuple[object, ...]:
        """``op`` less what ``figures`` does not read: its and its parameters' names, its module,
        the modules it reuses, and (without per-block scales) its block's index beyond whether
        it has one (``LayerOp.group``)."""
        block = op.block if self.block_scales or op.block is None else 0
        params = tuple((p.shape, p.trainable, p.dtype, p.quantized_numel) for p in op.params)
        return (block, params, *_COST_FIELDS(op))

    def figures(self, seg: Segment) -> SegmentFigures:
        """A segment's times and bytes (the step computes them once per segment)."""

        times = [self.op_s(op) for op in seg.ops]

        def total(quantity: str, which: int = 0) -> float:
            return sum(t[which] * self._scale(op, quantity) for op, t in zip(seg.ops, times, strict=True))

        saved = [op.saved_bytes * self._scale(op, "saved") for op in seg.ops]
        saved_total = round(sum(saved))
        measured = all(self._scale(op, q) == 1.0 for op in seg.ops for q in ("saved", *TRANSIENTS))

        forward_transient, forward_pieces = self._beyond_saved(seg, saved, "forward_transient", measured)
        recompute_transient: int | None = None
        recompute_pieces: tuple[int, ...] = ()
        if all(op.recompute_transient_bytes is not None for op in seg.ops):
            recompute_transient, recompute_pieces = self._beyond_saved(
                seg, saved, "recompute_transient", measured, scale_as="forward_transient"
            )
        trainable = [tuple(p.numel for p in op.params if p.trainable) for op in seg.ops]
        steps = self._backward_steps(seg, saved, trainable, measured)
        backward_transient = 0
        backward_pieces: tuple[int, ...] = ()
        if steps:
            at = max(range(len(steps)), key=lambda j: steps[j].beyond_saved_bytes)
            # a calibrated group's measured backward peak is its unit's, net of what its backward
            # frees: the segment's net figure is scaled, not each op's before the frees
            scale = self._scale(seg.ops[at], "backward_transient")
            backward_transient = round(max(0, steps[at].beyond_saved_bytes) * scale)
            backward_pieces = steps[at].pieces
        checkpointed = _checkpointed_forward_op(seg.ops)

        return SegmentFigures(
            forward_s=total("forward"),
            backward_s=total("backward", 1),
            recompute_s=total("recompute"),
            saved_bytes=saved_total,
            saved_after_block_bytes=round(
                sum(op.saved_after_block_bytes * self._scale(op, "saved") for op in seg.ops)
            ),
            block_input_saved_bytes=round(seg.ops[0].saved_input_bytes * self._scale(seg.ops[0], "saved")),
            next_block_input_bytes=round(
                sum(op.next_block_input_bytes * self._scale(op, "saved") for op in seg.ops)
            ),
            forward_transient_bytes=forward_transient,
            backward_transient_bytes=backward_transient,
            sac_kept_bytes=sum(op.sac_kept_bytes for op in seg.ops),
            sac_recompute_s=sum(
                self.kernels.sac_recompute_s(op, self.attention_kernel) * self._scale(op, "recompute")
                for op in seg.ops
            ),
            forward_host_s=sum(op.host_ops for op in seg.ops) * self.host_op_s,
            backward_host_s=2 * sum(op.host_ops for op in seg.ops) * self.host_op_s,
            forward_launches=sum(self.launches(op)[0] for op in seg.ops),
            backward_launches=sum(self.launches(op)[1] for op in seg.ops),
            checkpointed_forward_bytes=None
            if checkpointed is None
            else checkpointed.checkpointed_forward_bytes,
            saved_pieces=tuple(n for op in seg.ops for n in op.tensors("saved")) if measured else (),
            forward_transient_pieces=forward_pieces,
            recompute_transient_bytes=recompute_transient,
            recompute_transient_pieces=recompute_pieces,
            backward_transient_pieces=backward_pieces,
            # not under a calibrated group scale: its CPU measurement counts a backward's frees at
            # its end (``calibrate.memtrack.peak_above_start``), an upper bound whose slack already
            # covers the gradients (tiny, FSDP2, checkpointed, on profiles/cpu-2x-gloo.json against
            # its real 2-rank run: +1.6 % without them, +3.2 % with)
            backward_steps=tuple(steps) if measured else (),
            grad_numel=sum(map(sum, trainable)),
            checkpointed_forward_pieces=()
            if checkpointed is None or not measured
            else checkpointed.tensors("checkpointed_forward"),
            forward_order=request_order(seg.ops, "forward") if measured else None,
            checkpointed_forward_order=request_order(seg.ops, "checkpointed_forward", all_kept=True)
            if measured
            else None,
            backward_order=backward_order(seg.ops) if measured else None,
        )

    def _beyond_saved(
        self, seg: Segment, saved: list[float], quantity: str, measured: bool, *, scale_as: str = ""
    ) -> tuple[int, tuple[int, ...]]:
        """The segment's transient, on top of all its saved bytes (which the schedule holds for
        the whole op): ops run one after another, and while op i runs the segment holds what ops
        up to i saved and op i's transient; the largest such sum, less the segment's saved total.
        Its tensors: those of the op where it peaks, less what later ops' saves already hold."""
        kept, peak, at = 0.0, 0.0, None
        for op, nbytes in zip(seg.ops, saved, strict=True):
            kept += nbytes
            here = kept + getattr(op, f"{quantity}_bytes") * self._scale(op, scale_as or quantity)
            if here > peak:
                peak, at = here, op
        nbytes = max(0, round(peak) - round(sum(saved)))
        return nbytes, _trimmed(at.tensors(quantity), nbytes) if measured and at is not None else ()

    def _backward_steps(
        self, seg: Segment, saved: list[float], trainable: list[tuple[int, ...]], measured: bool
    ) -> list[BackwardStep]:
        """Each op's backward beyond the segment's saved bytes. In backward a saved storage is
        alive until its first saver's backward has run (``LayerOp.saved_released_ahead``). The
        schedule holds the segment's saved bytes through its whole backward: beyond them, op j
        holds its transient less what the backwards after it (this segment's later ops', and
        later segments' for saves whose first saver is there) have already freed of those saves."""
        count = len(seg.ops)
        freed_at = [0.0] * count
        freed_before = 0.0  # by a later segment's backward, before this one starts
        for i, (op, nbytes) in enumerate(zip(seg.ops, saved, strict=True)):
            scale = self._scale(op, "saved")
            ahead = 0.0
            for d, b in op.saved_released_ahead:
                ahead += b * scale
                if i + d < count:
                    freed_at[i + d] += b * scale
                else:
                    freed_before += b * scale
            freed_at[i] += nbytes - ahead
        steps, freed_after = [], freed_before + sum(freed_at)
        for j, op in enumerate(seg.ops):
            freed_after -= freed_at[j]
            beyond = round(op.backward_transient_bytes - freed_after)
            steps.append(
                BackwardStep(
                    beyond_saved_bytes=beyond,
                    pieces=_trimmed(op.tensors("backward_transient"), beyond)
                    if measured and beyond > 0
                    else (),
                    later_grad_numels=tuple(n for later in trainable[j + 1 :] for n in later),
                )
            )
        return steps

    def copy_s(self, nbytes: float) -> float:
        """A device-to-device copy of ``nbytes`` (FSDP2 all-gather copy-out, reduce-scatter copy-in)."""
        return nbytes / self.copy_Bps

    def optimizer_s(self, numel: int, state_bytes: int = 4) -> float:
        """Stepping ``numel`` elements whose parameter, gradient and states are ``state_bytes``
        each: the per-element figure is fp32's, and the step is bandwidth-bound, so bf16 states
        (``StepConfig.master_dtype``) move, and take, half of it."""
        return numel * self.optimizer_s_per_element * state_bytes / 4


def _checkpointed_forward_op(ops: Sequence[LayerOp]) -> LayerOp | None:
    """The op during which a checkpointed segment's block holds the most, where every op has the
    measured figure (each already counts what earlier ops of the block still hold)."""
    if not ops or any(op.checkpointed_forward_bytes is None for op in ops):
        return None
    return max(ops, key=lambda op: op.checkpointed_forward_bytes or 0)


def _trimmed(pieces: tuple[int, ...], nbytes: int) -> tuple[int, ...]:
    """``pieces`` made to sum to ``nbytes``: the latest made cut first, or the shortfall added as
    one tensor more."""
    out, excess = list(pieces), sum(pieces) - nbytes
    if excess < 0:
        return (*out, -excess)
    while excess > 0 and out:
        last = out.pop()
        if last > excess:
            out.append(last - excess)
        excess -= min(last, excess)
    return tuple(out)
