"""``training.loss = "fused"``: the head and the loss as Liger-Kernel's fused linear
cross-entropy (chunked logits, gradients computed in forward) instead of HF's eager loss."""

import dataclasses

import pytest
from simtest import make_scenario, synthetic_compute_section

from sim.errors import UserError
from sim.hardware.compute_section import parse_compute_section
from sim.hardware.registry import load_profile
from sim.outputs.report import build_report
from sim.simulate import simulate
from sim.workload.layer_op import LayerKind
from sim.workload.layers import llama_layer_ops
from sim.workload.model import preset
from sim.workload.options import LossKernel
from sim.workload.shapes import Workload

LLAMA3_8B = preset("llama3-8b")


def _head(loss: LossKernel):  # type: ignore[no-untyped-def]
    w = Workload(micro_batch=1, seq_len=8192, act_bytes=2, attention_kernel="flash", loss=loss)
    return llama_layer_ops(LLAMA3_8B, w)


def test_the_fused_op_holds_liger_kernels_buffers() -> None:
    ops = _head(LossKernel.FUSED)
    assert [o.kind for o in ops[-2:]] == [LayerKind.NORM, LayerKind.LOSS]  # no separate lm_head, no loss
    fused = ops[-1]
    t, h, v = 8192, 4096, 128256
    chunk = 256  # next power of two of ceil(8192 / ceil(128256 / 4096) = 32)
    grads = t * h * 2 + v * h * 2  # grad_input, grad_weight in bf16
    assert fused.saved_bytes == grads + t * 8  # and the int64 labels
    assert fused.forward_transient_bytes == grads + chunk * v * 2 + t * 4
    assert fused.gemm == (t, v, h) and fused.gradients_in_forward
    eager_loss = _head(LossKernel.EAGER)[-1]
    # the eager loss keeps the fp32 log-softmax of every token: 32 times more than the fused one's logits
    assert eager_loss.saved_bytes > 30 * chunk * v * 2


def test_fused_loss_lowers_the_peak_and_runs_its_matmuls_in_forward() -> None:
    common = {
        "model": {"preset": "llama3-8b", "n_layers": 4},
        "training": {"micro_batch": 1, "seq_len": 8192},
        "parallel": {"world_size": 8},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
    }
    results = {
        loss: simulate(make_scenario(**{**common, "training": {**common["training"], "loss": loss}}))
        for loss in ("eager", "fused")
    }
    peaks = {k: build_report(r).peak_memory_bytes for k, r in results.items()}
    assert peaks["eager"] - peaks["fused"] > 5 * 2**30  # the logits' fp32 copies and gradients

    def head_ops(result, kind):  # type: ignore[no-untyped-def]
        return [o for o in result.events.ops_of(0) if o.kind.value == kind and o.unit == "root"]

    fwd = sum(o.duration_s for o in head_ops(results["fused"], "forward"))
    bwd = sum(o.duration_s for o in head_ops(results["fused"], "backward"))
    assert bwd < 0.1 * fwd  # backward only scales the gradients computed in forward


def test_fused_loss_is_refused_where_it_is_not_modelled() -> None:
    s = make_scenario(training={"loss": "fused"})
    profile = load_profile("h100-sxm")
    section = synthetic_compute_section(make_scenario(), profile, 1.0)
    calibrated = dataclasses.replace(profile, compute=parse_compute_section(section, "p"), calibrated=True)
    with pytest.raises(UserError, match="eager loss"):
        simulate(s, calibrated)
    with pytest.raises(UserError, match="training.loss"):
        make_scenario(training={"loss": "chunked"})
