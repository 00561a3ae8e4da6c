"""The compute cost model: analytic roofline, calibrated scaling, and refusing mismatched sections."""

import dataclasses

import pytest
from simtest import make_profile, make_scenario, synthetic_compute_section

from sim.core.events import OpKind
from sim.errors import UserError
from sim.hardware.compute_section import parse_compute_section
from sim.outputs.report import build_report
from sim.simulate import simulate


def _with_compute(profile, section):
    return dataclasses.replace(
        profile, compute=parse_compute_section(section, "test-profile"), calibrated=True
    )


def _durations(result, kind):
    """Durations of the decoder blocks' ops (the root's first segment also runs the uncalibrated RoPE)."""
    return [
        o.duration_s for o in result.events.ops_of(0) if o.kind is kind and o.unit.startswith("model.layers")
    ]


def test_calibrated_times_and_bytes_replace_the_analytic_ones():
    s = make_scenario(model={"preset": "tiny", "n_layers": 3})
    profile = make_profile(overlap_slowdown=1.0)
    analytic = simulate(s, profile)
    calibrated = simulate(s, _with_compute(profile, synthetic_compute_section(s, profile, 3.0)))
    for kind in (OpKind.FORWARD, OpKind.BACKWARD):
        assert _durations(calibrated, kind) == pytest.approx(
            [3 * d for d in _durations(analytic, kind)], rel=1e-9
        )
    # RoPE tables are not part of any measured unit: they keep their analytic size
    rope = 2 * 64 * 16 * 4
    calibrated_at_peak = build_report(calibrated).to_json()["memory_at_peak_bytes"]
    analytic_at_peak = build_report(analytic).to_json()["memory_at_peak_bytes"]
    assert calibrated_at_peak["activations"] == pytest.approx(
        3 * (analytic_at_peak["activations"] - rope) + rope, rel=1e-6
    )


def test_a_section_measured_at_other_dimensions_is_refused_naming_the_fields():
    measured_at = make_scenario(model={"preset": "tiny"})
    profile = make_profile(overlap_slowdown=1.0)
    other = _with_compute(profile, synthetic_compute_section(measured_at, profile, 2.0))
    with pytest.raises(UserError, match=r"model.n_layers=2 \(scenario: 4\).*seq_len=64 \(scenario: 128\)"):
        simulate(make_scenario(model={"preset": "tiny", "n_layers": 4}, training={"seq_len": 128}), other)


def test_scaling_carries_the_measured_to_analytic_ratio_to_new_dimensions():
    # a calibrated profile scales the roofline (sim.costs.compute._kernels), so the ratio is
    # checked against the roofline at the new dimensions
    measured_at = make_scenario(model={"preset": "tiny"})
    profile = make_profile(overlap_slowdown=1.0, roofline=True)
    calibrated = _with_compute(profile, synthetic_compute_section(measured_at, profile, 2.0))
    target = make_scenario(
        model={"preset": "tiny", "n_layers": 4}, training={"seq_len": 128}, cluster={"compute_scaling": True}
    )
    scaled = simulate(target, calibrated)
    analytic = simulate(target, profile)
    assert _durations(scaled, OpKind.BACKWARD) == pytest.approx(
        [2 * d for d in _durations(analytic, OpKind.BACKWARD)], rel=1e-9
    )


def _copy_ops(result):
    ops = [o for o in result.events.ops_of(0) if o.kind is OpKind.COPY]
    out = [o for o in ops if o.name.startswith("all_gather copy-out")]
    rs_in = [o for o in ops if o.name.startswith("reduce_scatter copy-in")]
    return out, rs_in


@pytest.mark.parametrize("in_step", [True, False])
def test_fsdp_host_overhead_is_charged_once_per_unit_and_pass_only_where_the_host_is_the_device(in_step):
    s = make_scenario(model={"preset": "tiny", "n_layers": 3})
    profile = make_profile(overlap_slowdown=1.0)
    section = synthetic_compute_section(s, profile, 1.0)
    base = simulate(s, _with_compute(profile, section))
    section = section | {
        "fsdp_unit_overhead_s": {"forward": 1e-3, "backward": 3e-3},
        "host_overhead_in_step": in_step,
    }
    loaded = simulate(s, _with_compute(profile, section))
    (out0, rs0), (out1, rs1) = _copy_ops(base), _copy_ops(loaded)
    units = 4  # three blocks and the root
    assert len(rs1) == units
    pairs = sorted(zip(out0, out1, strict=True), key=lambda p: p[0].start_s)
    forward_outs, backward_outs = pairs[:units], pairs[units:]  # forward gathers each unit once, first
    assert len(backward_outs) == units - 1  # backward re-gathers the blocks, not the root
    fwd_extra = sum(b.duration_s - a.duration_s for a, b in forward_outs)
    bwd_extra = sum(b.duration_s - a.duration_s for a, b in zip(rs0, rs1, strict=True))
    assert fwd_extra == pytest.approx(units * 1e-3 if in_step else 0.0, abs=1e-12)
    assert bwd_extra == pytest.approx(units * 3e-3 if in_step else 0.0, abs=1e-12)
    # backward's re-gathers carry no forward overhead
    assert all(b.duration_s == pytest.approx(a.duration_s) for a, b in backward_outs)


def test_fsdp_steps_the_optimizer_measured_on_dtensors_and_ddp_the_plain_one():
    profile = make_profile(overlap_slowdown=1.0)
    fsdp_s = make_scenario(model={"preset": "tiny", "n_layers": 3})
    ddp_s = make_scenario(model={"preset": "tiny", "n_layers": 3}, parallel={"strategy": "NO_SHARD"})
    section = synthetic_compute_section(fsdp_s, profile, 1.0) | {
        "optimizer_s_per_param": {"adamw": 1e-9, "sgd": 1e-9},
        "fsdp_optimizer_s_per_param": {"adamw": 3e-9, "sgd": 3e-9},
    }

    def optimizer_op(scenario):
        result = simulate(scenario, _with_compute(profile, section))
        (op,) = [o for o in result.events.ops_of(0) if o.kind is OpKind.OPTIMIZER]
        return op.duration_s

    from sim.workload.model import n_params

    n = n_params(fsdp_s.model)
    assert optimizer_op(ddp_s) == pytest.approx(n * 1e-9)
    assert optimizer_op(fsdp_s) == pytest.approx(3e-9 * n / 2, rel=0.01)  # shards of 2 ranks, padded


def test_every_attention_kernel_a_profile_may_name_has_its_launch_counts() -> None:
    from sim.hardware.schema import ATTENTION_KERNELS
    from sim.workload.op_counts import ATTENTION_LAUNCHES

    assert set(ATTENTION_LAUNCHES) == set(ATTENTION_KERNELS)
    assert all(forward >= 1 and backward >= 1 for forward, backward in ATTENTION_LAUNCHES.values())


def _step_costs(monkeypatch, scenario, profile):
    """The step's figures, and the cost model and segments ``build_step`` made them from."""
    from sim.costs.compute import ComputeCosts
    from sim.simulate import build_step

    seen = {}
    shared = ComputeCosts.segment_figures

    def spy(self, segments):
        seen["costs"], seen["segments"] = self, segments
        return shared(self, segments)

    monkeypatch.setattr(ComputeCosts, "segment_figures", spy)
    step, _, _ = build_step(scenario, profile)
    return step.figures, seen["costs"], seen["segments"]


@pytest.mark.parametrize("wrap", ["linear", "block"])
def test_identical_blocks_share_one_figures_computation_with_the_same_result(monkeypatch, wrap):
    s = make_scenario(model={"preset": "tiny", "n_layers": 4}, parallel={"wrap": wrap})
    profile = make_profile()
    figures, costs, segments = _step_costs(monkeypatch, s, profile)
    computed = []
    one_by_one = type(costs).figures
    monkeypatch.setattr(
        type(costs), "figures", lambda self, seg: computed.append(seg) or one_by_one(self, seg)
    )
    assert costs.segment_figures(segments) == figures == tuple(one_by_one(costs, seg) for seg in segments)
    blocks = [seg for seg in segments if seg.block is not None]
    assert len(computed) == len(segments) - len(blocks) + len(blocks) // 4  # one block's, for all four


def test_blocks_scaled_one_by_one_are_computed_one_by_one(monkeypatch):
    from sim.costs.compute import GroupScale

    s = make_scenario(model={"preset": "tiny", "n_layers": 2})
    _, costs, segments = _step_costs(monkeypatch, s, make_profile())
    scaled = dataclasses.replace(costs, block_scales={0: GroupScale(forward=1.0), 1: GroupScale(forward=3.0)})
    figures = scaled.segment_figures(segments)
    assert figures == tuple(scaled.figures(seg) for seg in segments)
    first, second = (f for f, seg in zip(figures, segments, strict=True) if seg.block is not None)
    assert second.forward_s == pytest.approx(3 * first.forward_s, rel=1e-12)
