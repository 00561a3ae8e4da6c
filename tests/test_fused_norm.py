"""``training.norm = "fused"``: RMSNorm as torchtitan's Triton kernel (``TritonFusedRMSNorm``)
instead of HF's eager ops: what it keeps, the kernels it launches, its time at the share of the
streaming rate Liger's fused RMSNorm reaches, and where it is refused."""

import dataclasses
import json

import pytest
from simtest import make_scenario, synthetic_compute_section

from sim.costs.gpu import FUSED_NORM_EFFICIENCY, kernel_model
from sim.errors import UserError
from sim.hardware.compute_section import parse_compute_section
from sim.hardware.registry import builtin_devices, load_profile
from sim.outputs.report import build_report
from sim.simulate import simulate
from sim.workload.layer_op import LayerKind
from sim.workload.layers import llama_layer_ops
from sim.workload.model import preset
from sim.workload.options import NormKernel
from sim.workload.shapes import Workload
from validation.fused_bandwidth import DATA, fused_norm_efficiency, passes

LLAMA2_13B = preset("llama2-13b")
T, H, A = 2 * 4096, 5120, 2


def _ops(norm: NormKernel):  # type: ignore[no-untyped-def]
    w = Workload(micro_batch=2, seq_len=4096, act_bytes=A, attention_kernel="flash", norm=norm)
    return llama_layer_ops(LLAMA2_13B, w)


def test_a_fused_norm_keeps_its_input_rstd_and_output() -> None:
    """``save_for_backward(x, weight, rstd)``: x in the activation dtype, rstd fp32 per row; its
    output, which the next matmuls keep, is the op's as the eager norm's is. The eager norm keeps
    an fp32 copy instead of x, and the normalized input the weight multiply reads."""
    fused = [o for o in _ops(NormKernel.FUSED) if o.kind is LayerKind.NORM]
    eager = [o for o in _ops(NormKernel.EAGER) if o.kind is LayerKind.NORM]
    assert len(fused) == len(eager) == 2 * LLAMA2_13B.n_layers + 1
    assert {o.saved_bytes for o in fused} == {T * H * A + T * 4 + T * H * A}
    assert {o.saved_bytes for o in eager} == {T * H * 4 + T * 4 + 2 * T * H * A}
    assert all(o.fused_kernel and o.memory_bytes == 2 * T * H * A for o in fused)


def test_the_residual_add_a_fused_norm_leaves_is_its_own_eager_op() -> None:
    """Forward bytes of a block's memory-bound work: the eager post-attention norm counts the add
    before it; with fused norms the add is an op of its own with the same bytes, and the block
    launches its kernels as the eager one does less the norms' own (eight each, one fused)."""
    eager, fused = _ops(NormKernel.EAGER), _ops(NormKernel.FUSED)
    block = [o for o in fused if o.block == 0]
    adds = [o for o in block if o.kind is LayerKind.ELEMENTWISE]
    assert [o.name for o in adds] == ["model.layers.0.residual_add"]
    assert adds[0].memory_bytes == 3 * T * H * A

    def forward_launches(ops, block):  # type: ignore[no-untyped-def]
        return sum(o.launches[0] for o in ops if o.block == block and o.launches)

    assert forward_launches(eager, 0) - forward_launches(fused, 0) == 2 * (8 - 1)


def test_a_fused_norm_runs_at_liger_kernels_measured_share_of_streaming() -> None:
    device = builtin_devices()["a100-sxm-80g"]
    model = kernel_model(device, "bf16", builtin_devices())
    norm = next(o for o in _ops(NormKernel.FUSED) if o.kind is LayerKind.NORM)
    forward, backward = model.op_s(norm, "flash")
    assert forward == pytest.approx(2 * T * H * A / (model.hbm_Bps * FUSED_NORM_EFFICIENCY[0]))
    assert backward == pytest.approx(3 * T * H * A / (model.hbm_Bps * FUSED_NORM_EFFICIENCY[1]))
    eager = next(o for o in _ops(NormKernel.EAGER) if o.kind is LayerKind.NORM)
    assert sum(model.op_s(eager, "flash")) > 5 * (forward + backward)


def test_the_fractions_are_the_medians_of_the_published_timings() -> None:
    assert fused_norm_efficiency() == FUSED_NORM_EFFICIENCY
    data = json.loads(DATA.read_text())
    counted = [p for p in passes() if p.counted]
    assert {p.gpu for p in counted} == {g["gpu_name"] for g in data["gpus"]}
    assert {p.direction for p in counted} == {"forward", "backward"}
    assert all(0 < p.efficiency < 1 for p in passes())  # no pass beats the streaming rate


def test_fused_norms_lower_the_peak_and_the_step() -> None:
    common = {
        "model": {"preset": "llama2-13b", "n_layers": 4},
        "training": {"micro_batch": 2, "seq_len": 4096},
        "parallel": {"world_size": 8},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        "cluster": {"profile": "a100-sxm-80g"},
    }
    reports = {
        norm: build_report(
            simulate(make_scenario(**{**common, "training": {**common["training"], "norm": norm}}))
        )
        for norm in ("eager", "fused")
    }
    # per norm the eager one keeps 4 bytes an element more (its fp32 copy against x in bf16)
    saved = 4 * T * H * (2 * 4)  # two norms in each of the four blocks
    assert reports["eager"].peak_memory_bytes - reports["fused"].peak_memory_bytes >= saved
    assert reports["fused"].step_time_s < reports["eager"].step_time_s


def test_a_fused_norm_is_refused_where_it_is_not_modelled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    profile = load_profile("h100-sxm")
    section = synthetic_compute_section(make_scenario(), profile, 1.0)
    calibrated = dataclasses.replace(profile, compute=parse_compute_section(section, "p"), calibrated=True)
    with pytest.raises(UserError, match="eager RMSNorm"):
        simulate(make_scenario(training={"norm": "fused"}), calibrated)
    with pytest.raises(UserError, match="training.norm"):
        make_scenario(training={"norm": "apex"})
