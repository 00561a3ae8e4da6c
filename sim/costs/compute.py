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
``head``, which was timed as the rest of the model; its bytes stay the description's.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Protocol

from sim.core.events import RequestOrder
from sim.costs.gpu import has_gpu_figures, kernel_model
from sim.dtypes import dtype_bytes
from sim.errors import UserError
from sim.hardware.compute_section import MODEL_FIELDS, ComputeSection, UnitMeasurement
from sim.hardware.schema import DeviceSpec, HardwareProfile
from sim.workload.description import finetune_fingerprint
from sim.workload.forward import layer_ops
from sim.workload.layers import ATTENTION_LAUNCHES, CalibrationGroup, LayerOp, Workload, figure_tensors
from sim.workload.model import ModelConfig
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
    # op-level selective checkpointing: the outputs it keeps, and what it recomputes
    sac_kept_bytes: int = 0
    sac_recompute_s: float = 0.0
    # a checkpointed block's segment: the most its block holds while the segment runs (measured
    # for described models, ``LayerOp.checkpointed_forward_bytes``); None: saved + transient
    checkpointed_forward_bytes: int | None = None
    # the tensors of the byte figures, in allocation order, where the ops know them (empty: one
    # block); the caching allocator's replay serves them one by one where no order is known
    saved_pieces: tuple[int, ...] = ()
    forward_transient_pieces: tuple[int, ...] = ()
    backward_transient_pieces: tuple[int, ...] = ()
    checkpointed_forward_pieces: tuple[int, ...] = ()
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
        """One byte figure's tensors (``sim.workload.layers.figure_tensors``)."""
        return figure_tensors(self, figure)

    def backward_held(self, grad_bytes: int) -> tuple[int, tuple[int, ...]]:
        """The segment's backward transient with the gradients its ops make along the way:
        ``grad_bytes`` is what the system keeps of the segment's gradients once its backward is
        done, spread over its trainable elements; at the op where the transient and the later ops'
        gradients together peak, their bytes and tensors. Without gradients (or steps), the
        transient alone."""
        alone = (self.backward_transient_bytes, self.tensors("backward_transient"))
        if not grad_bytes or not self.grad_numel or not self.backward_steps:
            return alone
        per_element = grad_bytes / self.grad_numel

        def held(step: BackwardStep) -> int:
            return step.beyond_saved_bytes + sum(round(n * per_element) for n in step.later_grad_numels)

        best = max(self.backward_steps, key=held)
        if held(best) <= alone[0]:
            return alone
        grads = tuple(round(n * per_element) for n in best.later_grad_numels if n)
        if best.beyond_saved_bytes <= 0:  # the saves released by then make room for part of them
            return held(best), _trimmed(grads, held(best))
        own = best.pieces or (best.beyond_saved_bytes,)
        return held(best), (*own, *grads)


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

        def beyond_saved(quantity: str) -> tuple[int, tuple[int, ...]]:
            """The segment's transient, on top of all its saved bytes (which the schedule holds
            for the whole op): ops run one after another, and while op i runs the segment holds
            what ops up to i saved (in backward, what ops after it have not yet released) and
            op i's transient; the largest such sum, less the segment's saved total. Its tensors:
            those of the op where it peaks, less what later ops' saves already hold."""
            kept, peak, at = 0.0, 0.0, None
            for op, nbytes in zip(seg.ops, saved, strict=True):
                kept += nbytes
                here = kept + getattr(op, f"{quantity}_bytes") * self._scale(op, quantity)
                if here > peak:
                    peak, at = here, op
            nbytes = max(0, round(peak) - saved_total)
            return nbytes, _trimmed(at.tensors(quantity), nbytes) if measured and at is not None else ()

        forward_transient, forward_pieces = beyond_saved("forward_transient")
        trainable = [tuple(p.numel for p in op.params if p.trainable) for op in seg.ops]
        # in backward, a saved storage is alive until its first saver's backward has run
        # (``LayerOp.saved_released_ahead``). The schedule holds the segment's saved bytes through
        # its whole backward: beyond them, op j holds its transient less what the backwards after
        # it (this segment's later ops', and later segments' for saves whose first saver is
        # there) have already freed of those saves
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
            beyond = round(op.backward_transient_bytes * self._scale(op, "backward_transient") - freed_after)
            steps.append(
                BackwardStep(
                    beyond_saved_bytes=beyond,
                    pieces=_trimmed(op.tensors("backward_transient"), beyond)
                    if measured and beyond > 0
                    else (),
                    later_grad_numels=tuple(n for later in trainable[j + 1 :] for n in later),
                )
            )
        peak_step = max(steps, key=lambda st: st.beyond_saved_bytes, default=None)
        backward_transient = max(0, peak_step.beyond_saved_bytes) if peak_step else 0
        backward_pieces = peak_step.pieces if peak_step else ()
        checkpointed = _checkpointed_forward_op(seg.ops)

        return SegmentFigures(
            forward_s=total("forward"),
            backward_s=total("backward", 1),
            recompute_s=total("recompute"),
            saved_bytes=saved_total,
            saved_after_block_bytes=round(
                sum(op.saved_after_block_bytes * self._scale(op, "saved") for op in seg.ops)
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

    def copy_s(self, nbytes: float) -> float:
        """A device-to-device copy of ``nbytes`` (FSDP2 all-gather copy-out, reduce-scatter copy-in)."""
        return nbytes / self.copy_Bps

    def optimizer_s(self, numel: int, state_bytes: int = 4) -> float:
        """Stepping ``numel`` elements whose parameter, gradient and states are ``state_bytes``
        each: the per-element figure is fp32's, and the step is bandwidth-bound, so bf16 states
        (``StepConfig.master_dtype``) move, and take, half of it."""
        return numel * self.optimizer_s_per_element * state_bytes / 4


def request_order(ops: Sequence[LayerOp], figure: str, *, all_kept: bool = False) -> RequestOrder | None:
    """The ops' ``<figure>_requests`` one after another, as the caching allocator is asked for
    them: each tensor made a request, its free (where it was made in these ops; a storage of an
    earlier segment is freed with that segment's buffers) the free of that request. A kept tensor
    (bytes < 0) is the saved buffer's, any other still live at the end the transient's (its
    consumer is a later segment's op); ``all_kept``: all are the buffer's (a checkpointed block
    saves nothing, and its segment's one buffer holds everything it leaves live). None where an
    op's order is not known. A model's storages are numbered alike in every block (the traced
    representative's), a kernel's own tensors (negative numbers) per op."""
    joined = _joined_order(ops, figure, all_kept=all_kept)
    return None if joined is None else joined[0]


def _tensor_key(position: int, tensor: int) -> object:
    """A tensor of a segment's requests: a model's storage by its number, a kernel's own (< 0)
    with its op's position."""
    return (position, tensor) if tensor < 0 else tensor


def _joined_order(
    ops: Sequence[LayerOp], figure: str, *, all_kept: bool = False
) -> tuple[RequestOrder, dict[object, int]] | None:
    """``request_order``, and where each kept tensor is among those the buffer keeps (in order)."""
    requests = [getattr(op, f"{figure}_requests") for op in ops]
    if not ops or any(r is None for r in requests):
        return None
    index: dict[object, int] = {}  # tensor -> its request's number
    kept_at: dict[object, int] = {}
    events: list[int] = []
    kept: list[bool] = []
    for position, op_requests in enumerate(requests):
        for tensor, nbytes in op_requests:
            key = _tensor_key(position, tensor)
            if nbytes:
                index[key] = len(kept)
                events.append(abs(nbytes))
                if nbytes < 0:  # its place among those the buffer keeps (none is freed here)
                    kept_at[key] = len(kept_at)
                kept.append(all_kept or nbytes < 0)
            elif key in index:
                events.append(-index.pop(key))
    return RequestOrder(events=tuple(events), kept=tuple(kept)), kept_at


def backward_order(ops: Sequence[LayerOp]) -> RequestOrder | None:
    """The segment's backward as the caching allocator is asked for it: its ops' backwards in
    reverse order, each its ``backward_requests`` (what it makes, freed where it dies, live to the
    segment's end otherwise: the input's gradient for the segment before, the parameters'), with
    the tensors the forward kept released where the backward drops them (their positions in the
    forward's order, ``_joined_order``; a kept storage of another segment goes with that one's
    buffer). None where an op's orders are not known."""
    joined = _joined_order(ops, "forward")
    if joined is None or any(op.backward_requests is None for op in ops):
        return None
    kept_at = joined[1]
    events: list[int] = []
    index: dict[object, int] = {}
    releases: list[tuple[int, int]] = []
    made = 0
    for position in reversed(range(len(ops))):
        for tensor, nbytes in ops[position].backward_requests or ():
            key = _tensor_key(position, tensor)
            if nbytes:
                index[key], made = made, made + 1
                events.append(nbytes)
            elif key in index:
                events.append(-index.pop(key))
            elif key in kept_at:
                releases.append((len(events), kept_at.pop(key)))
    return RequestOrder(events=tuple(events), kept=(True,) * made, releases=tuple(releases))


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


def _deepspeed_layer(compute: ComputeSection, stage: int | None) -> dict[str, float]:
    layer = compute.deepspeed_layer_overhead_s.get(str(stage)) if stage is not None else None
    if layer is None:
        return {}
    return {"deepspeed_layer_forward_s": layer["forward"], "deepspeed_layer_backward_s": layer["backward"]}


def _group_ops(ops: Sequence[LayerOp], group: CalibrationGroup) -> list[LayerOp]:
    """One instance of ``group``: the embedding, the first decoder block, or the head."""
    return [op for op in ops if op.group is group and op.block in (None, 0)]


def _ratio(measured: float, analytic: float) -> float:
    return measured / analytic if analytic > 0 else 1.0


def _group_scale(
    costs: ComputeCosts, members: list[LayerOp], measured: UnitMeasurement, *, bytes_measured: bool = True
) -> GroupScale:
    fwd = sum(costs.op_s(op)[0] for op in members)
    bwd = sum(costs.op_s(op)[1] for op in members)
    recompute = measured.recompute_s if measured.recompute_s > 0 else measured.forward_s
    if not bytes_measured:  # a described model's bytes are its description's
        return GroupScale(
            forward=_ratio(measured.forward_s, fwd),
            backward=_ratio(measured.backward_s, bwd),
            recompute=_ratio(recompute, fwd),
        )
    return GroupScale(
        forward=_ratio(measured.forward_s, fwd),
        backward=_ratio(measured.backward_s, bwd),
        recompute=_ratio(recompute, fwd),
        saved=_ratio(measured.saved_activation_bytes, sum(op.saved_bytes for op in members)),
        forward_transient=_ratio(
            measured.forward_transient_bytes, max(op.forward_transient_bytes for op in members)
        ),
        backward_transient=_ratio(
            measured.backward_transient_bytes, max(op.backward_transient_bytes for op in members)
        ),
    )


def streaming_Bps(device: DeviceSpec) -> float:
    """The rate memory-bound kernels move bytes at: measured where published, else the datasheet's."""
    return device.achievable_hbm_bandwidth_Bps or device.hbm_bandwidth_Bps


def _kernels(profile: HardwareProfile, dtype: str, lenders: Mapping[str, DeviceSpec]) -> KernelModel:
    device = profile.device
    if has_gpu_figures(device, dtype) and profile.compute is None:
        return kernel_model(device, dtype, dict(lenders))
    return Roofline(
        flops_per_s=device.peak_flops[dtype] * device.compute_efficiency, hbm_Bps=device.hbm_bandwidth_Bps
    )


def _analytic_costs(
    profile: HardwareProfile,
    dtype: str,
    optimizer: OptimizerName,
    where: str,
    lenders: Mapping[str, DeviceSpec] | None = None,
) -> ComputeCosts:
    device = profile.device
    if dtype not in device.peak_flops:
        raise UserError(
            f"{where}: device.peak_flops has no {dtype} entry; has: {', '.join(device.peak_flops)}"
        )
    bandwidth = streaming_Bps(device) if profile.compute is None else device.hbm_bandwidth_Bps
    gpu_host = profile.compute is None and profile.backend.overlaps_comm_compute
    return ComputeCosts(
        kernels=_kernels(profile, dtype, lenders or {}),
        attention_kernel=profile.attention_kernel,
        copy_Bps=bandwidth / 2.0,  # a copy reads and writes every byte
        optimizer_s_per_element=OPTIMIZER_BYTES_PER_ELEMENT[optimizer] / bandwidth,
        host_op_s=device.host_op_overhead_s if gpu_host else 0.0,
        fsdp_forward_host_s=profile.backend.fsdp_unit_host_forward_s if gpu_host else 0.0,
        fsdp_backward_host_s=profile.backend.fsdp_unit_host_backward_s if gpu_host else 0.0,
    )


def check_compute_matches(
    compute: ComputeSection,
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    param_dtype: str,
    where: str,
    *,
    scalable: bool = True,
) -> None:
    """Refuse a compute section measured at other dimensions than the scenario's.

    Compares every model dimension (tie_embeddings included), the micro-batch, the sequence
    length and the compute dtype, and names each mismatch.
    """
    wrong = [
        f"model.{f}={getattr(compute.dims, f)!r} (scenario: {getattr(model, f)!r})"
        for f in MODEL_FIELDS
        if getattr(compute.dims, f) != getattr(model, f)
    ]
    for key, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("param_dtype", param_dtype)):
        if getattr(compute, key) != value:
            wrong.append(f"{key}={getattr(compute, key)!r} (scenario: {value!r})")
    if wrong:
        raise UserError(
            f"{where}: its compute section was measured at other dimensions: {'; '.join(wrong)}. "
            "Run `fsdpsim calibrate compute SCENARIO --profile PROFILE` for this scenario"
            + (
                ", or set cluster.compute_scaling = true to scale the measurements by the analytic model"
                if scalable
                else " (a described model's measurements are not scaled to other dimensions)"
            )
        )


def _measured_workload(
    compute: ComputeSection, profile: HardwareProfile, optimizer: OptimizerName, where: str
) -> tuple[Sequence[LayerOp], ComputeCosts]:
    """The layer ops and analytic costs at the dimensions the compute section was measured at."""
    d = compute.dims
    model = ModelConfig(name="measured", **{f: getattr(d, f) for f in MODEL_FIELDS})
    workload = Workload(
        micro_batch=compute.micro_batch,
        seq_len=compute.seq_len,
        act_bytes=dtype_bytes(compute.param_dtype),
        attention_kernel=profile.attention_kernel,
    )
    return layer_ops(model, workload), _analytic_costs(profile, compute.param_dtype, optimizer, where)


def check_same_model(compute: ComputeSection, model: ModelConfig, where: str) -> None:
    """Refuse a compute section measured on another model than the scenario's: Llama units for a
    described model, or a described model's units (compared by config hash) for any other."""
    measured = compute.described_model
    d = model.description
    if measured is None and d is None:
        return
    if measured is not None and d is not None and measured.config_sha256 == d.config_sha256:
        trained = finetune_fingerprint(d.finetune)
        if measured.finetune == trained and measured.decoder_seq_len == d.decoder_seq_len:
            return
        if measured.decoder_seq_len != d.decoder_seq_len:
            raise UserError(
                f"{where}: its compute section was measured on model {measured.name} with a decoder of "
                f"{measured.decoder_seq_len} tokens, not the scenario's {d.decoder_seq_len} "
                "(training.decoder_seq_len): run `fsdpsim calibrate compute SCENARIO --profile PROFILE` for "
                "this scenario, or use a profile without a compute section"
            )
        raise UserError(
            f"{where}: its compute section was measured on model {measured.name} trained {measured.finetune!r}, "
            f"not as the scenario trains it ({trained!r}): run `fsdpsim calibrate compute SCENARIO --profile "
            "PROFILE` for this scenario, or use a profile without a compute section"
        )
    was = "Llama units" if measured is None else f"model {measured.name} ({measured.architecture})"
    now = f"model {model.name}" + (f" ({d.architecture})" if d is not None else " (Llama)")
    raise UserError(
        f"{where}: its compute section was measured on {was}, not on the scenario's {now}: run "
        "`fsdpsim calibrate compute SCENARIO --profile PROFILE` for this scenario, or use a profile "
        "without a compute section"
    )


def _llama_scales(
    profile: HardwareProfile,
    costs: ComputeCosts,
    ops: Sequence[LayerOp],
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    param_dtype: str,
    optimizer: OptimizerName,
    allow_scaling: bool,
) -> dict[CalibrationGroup, GroupScale]:
    compute = profile.compute
    assert compute is not None
    where = f"profile {profile.name}"
    measured_ops, measured_costs = ops, costs
    try:
        check_compute_matches(compute, model, micro_batch, seq_len, param_dtype, where)
    except UserError:
        if not allow_scaling:
            raise
        measured_ops, measured_costs = _measured_workload(compute, profile, optimizer, where)
    return {
        group: _group_scale(measured_costs, _group_ops(measured_ops, group), compute.units[group.value])
        for group in CalibrationGroup
    }


def _described_scales(
    costs: ComputeCosts, ops: Sequence[LayerOp], compute: ComputeSection
) -> tuple[dict[CalibrationGroup, GroupScale], dict[int, GroupScale]]:
    """A described model's scales: the embedding's, the head's (every other op outside the blocks)
    and each block's, from its kind's unit measured on the kind's first block."""
    outside = [op for op in ops if op.block is None]
    groups = {
        CalibrationGroup.EMBED: [op for op in outside if op.group is CalibrationGroup.EMBED],
        CalibrationGroup.HEAD: [op for op in outside if op.group is not CalibrationGroup.EMBED],
    }
    scales = {
        g: _group_scale(costs, members, compute.units[g.value], bytes_measured=False)
        for g, members in groups.items()
    }
    blocks = sorted({op.block for op in ops if op.block is not None})
    by_unit: dict[str, GroupScale] = {}
    for name in dict.fromkeys(compute.block_unit(b) for b in blocks):
        first = int(name.removeprefix("block."))
        members = [op for op in ops if op.block == first]
        by_unit[name] = _group_scale(costs, members, compute.units[name], bytes_measured=False)
    scales[CalibrationGroup.BLOCK] = by_unit[compute.block_unit(blocks[0])]
    return scales, {b: by_unit[compute.block_unit(b)] for b in blocks}


def build_compute_costs(
    profile: HardwareProfile,
    ops: Sequence[LayerOp],
    *,
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    param_dtype: str,
    optimizer: OptimizerName,
    allow_scaling: bool = False,
    fsdp: bool = True,
    fsdp_version: int = 2,
    lenders: Mapping[str, DeviceSpec] | None = None,
    deepspeed_stage: int | None = None,
) -> ComputeCosts:
    """The cost model for ``param_dtype`` work on ``profile``, calibrated when the profile has a
    compute section. A section measured at other dimensions is refused, unless ``allow_scaling``:
    then each group's measured/analytic ratios, taken at the measured dimensions, scale the
    analytic model at the scenario's. ``fsdp`` picks the optimizer measured on FSDP2's DTensor
    shards (else on plain tensors, as DDP and FSDP1 hold them); ``fsdp_version`` 1 takes FSDP1's
    measured per-unit host work where the section has it (else FSDP2's). ``lenders`` are profiles a part without
    a published attention curve may borrow one from (``sim.costs.gpu.borrowed_attention``).
    ``deepspeed_stage`` (a DeepSpeed ZeRO scenario's) takes the section's measured step for it."""
    where = f"profile {profile.name}"
    costs = _analytic_costs(profile, param_dtype, optimizer, where, lenders)
    compute = profile.compute
    if compute is None:
        return costs
    if any(op.gradients_in_forward for op in ops):
        raise UserError(
            f'{where}: its compute section measured HF\'s eager loss; training.loss = "fused" is timed by '
            "the analytic model only (use a profile without a compute section)"
        )
    if any(op.fused_kernel for op in ops):
        raise UserError(
            f'{where}: its compute section measured HF\'s eager RMSNorm; training.norm = "fused" is timed by '
            "the analytic model only (use a profile without a compute section)"
        )
    check_same_model(compute, model, where)
    block_scales: dict[int, GroupScale] = {}
    if model.description is not None:
        check_compute_matches(compute, model, micro_batch, seq_len, param_dtype, where, scalable=False)
        scales, block_scales = _described_scales(costs, ops, compute)
    else:
        scales = _llama_scales(
            profile, costs, ops, model, micro_batch, seq_len, param_dtype, optimizer, allow_scaling
        )
    per_param = compute.fsdp_optimizer_s_per_param if fsdp else compute.optimizer_s_per_param
    optimizer_s = (
        per_param.get(optimizer.value, costs.optimizer_s_per_element) if optimizer.value != "none" else 0.0
    )
    in_step = compute.host_overhead_in_step
    forward_overhead, backward_overhead = compute.fsdp_forward_overhead_s, compute.fsdp_backward_overhead_s
    if fsdp_version == 1 and compute.fsdp1_forward_overhead_s is not None:
        forward_overhead = compute.fsdp1_forward_overhead_s
        backward_overhead = compute.fsdp1_backward_overhead_s or 0.0
    return ComputeCosts(
        kernels=costs.kernels,
        attention_kernel=costs.attention_kernel,
        copy_Bps=compute.copy_Bps,
        optimizer_s_per_element=optimizer_s,
        fsdp_forward_overhead_s=forward_overhead if in_step else 0.0,
        fsdp_backward_overhead_s=backward_overhead if in_step else 0.0,
        deepspeed_step_s_per_element=(
            compute.deepspeed_step_s_per_param.get(str(deepspeed_stage))
            if in_step and deepspeed_stage is not None
            else None
        ),
        **_deepspeed_layer(compute, deepspeed_stage if in_step else None),
        scales=scales,
        block_scales=block_scales,
    )
