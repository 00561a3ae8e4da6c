"""A scenario's compute cost model, built from its hardware profile (``build_compute_costs``): the
kernel model of its device (``sim.costs.gpu`` on a profile with published kernel-level figures,
else ``Roofline``), the measured ``compute`` section's scales where ``calibrate compute`` wrote
one (per group: embedding, decoder block, head; a described model's per unit kind), and the
checks that the measurement is of this scenario's model, dtype and workload.
"""

from collections.abc import Mapping, Sequence

from sim.costs.compute import OPTIMIZER_BYTES_PER_ELEMENT, ComputeCosts, GroupScale, KernelModel, Roofline
from sim.costs.gpu import has_gpu_figures, kernel_model
from sim.dtypes import dtype_bytes
from sim.errors import UserError
from sim.hardware.compute_section import MODEL_FIELDS, ComputeSection, UnitMeasurement
from sim.hardware.schema import DeviceSpec, HardwareProfile
from sim.workload.description import finetune_fingerprint
from sim.workload.forward import layer_ops
from sim.workload.layer_op import CalibrationGroup, LayerOp
from sim.workload.model import ModelConfig
from sim.workload.options import OptimizerName
from sim.workload.shapes import Workload
from sim.workload.units import Segment


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
        # against the unit's analytic backward peak net of what its backward frees, as measured
        backward_transient=_ratio(
            measured.backward_transient_bytes,
            costs.figures(Segment(unit=members[0].module, ops=tuple(members))).backward_transient_bytes,
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
    *,
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    param_dtype: str,
    optimizer: OptimizerName,
    allow_scaling: bool,
) -> dict[CalibrationGroup, GroupScale]:
    """A preset model's scales: each group (embedding, first block, head) against its measured
    unit; where the section was measured at other dimensions and ``allow_scaling`` (a sweep's
    variants), the ratios found at the measured dimensions, applied to these."""
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


def _refuse_unmeasured_kernels(ops: Sequence[LayerOp], where: str) -> None:
    """A compute section measured HF's eager loss and RMSNorm: their fused kernels have no
    measurement in it, so a scenario that names them is refused rather than timed as eager."""
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


def _unit_overheads(compute: ComputeSection, fsdp_version: int) -> tuple[float, float]:
    """The measured per-unit host work of forward and backward: FSDP1's where the section has it
    and the scenario runs FSDP1, else FSDP2's."""
    if fsdp_version == 1 and compute.fsdp1_forward_overhead_s is not None:
        return compute.fsdp1_forward_overhead_s, compute.fsdp1_backward_overhead_s or 0.0
    return compute.fsdp_forward_overhead_s, compute.fsdp_backward_overhead_s


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
    a published attention curve may borrow one from (``sim.costs.attention_curves.attention_curves``).
    ``deepspeed_stage`` (a DeepSpeed ZeRO scenario's) takes the section's measured step for it."""
    where = f"profile {profile.name}"
    costs = _analytic_costs(profile, param_dtype, optimizer, where, lenders)
    compute = profile.compute
    if compute is None:
        return costs
    _refuse_unmeasured_kernels(ops, where)
    check_same_model(compute, model, where)
    block_scales: dict[int, GroupScale] = {}
    if model.description is not None:
        check_compute_matches(compute, model, micro_batch, seq_len, param_dtype, where, scalable=False)
        scales, block_scales = _described_scales(costs, ops, compute)
    else:
        scales = _llama_scales(
            profile,
            costs,
            ops,
            model=model,
            micro_batch=micro_batch,
            seq_len=seq_len,
            param_dtype=param_dtype,
            optimizer=optimizer,
            allow_scaling=allow_scaling,
        )
    per_param = compute.fsdp_optimizer_s_per_param if fsdp else compute.optimizer_s_per_param
    optimizer_s = (
        per_param.get(optimizer.value, costs.optimizer_s_per_element) if optimizer.value != "none" else 0.0
    )
    in_step = compute.host_overhead_in_step
    forward_overhead, backward_overhead = _unit_overheads(compute, fsdp_version)
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
