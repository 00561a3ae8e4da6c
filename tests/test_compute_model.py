"""The compute cost model: analytic roofline, calibrated scaling, and refusing mismatched sections."""

import dataclasses

import pytest
from simtest import make_profile, make_scenario, synthetic_compute_section

from sim.errors import UserError
from sim.events import OpKind
from sim.simulate import simulate


def _with_compute(profile, section):
    return dataclasses.replace(profile, compute=section, calibrated=True)


def _durations(result, kind):
    """Durations of the decoder blocks' ops (the root's first segment also runs the uncalibrated RoPE)."""
    return [
        o.duration_s for o in result.events.ops_of(0) if o.kind is kind and o.unit.startswith("model.layers")
    ]


def test_calibrated_times_and_bytes_replace_the_analytic_ones():
    s = make_scenario(model={"preset": "tiny", "n_layers": 3})
    profile = make_profile()
    analytic = simulate(s, profile)
    calibrated = simulate(s, _with_compute(profile, synthetic_compute_section(s, profile, 3.0)))
    for kind in (OpKind.FORWARD, OpKind.BACKWARD):
        assert _durations(calibrated, kind) == pytest.approx(
            [3 * d for d in _durations(analytic, kind)], rel=1e-9
        )
    # RoPE tables are not part of any measured unit: they keep their analytic size
    rope = 2 * 64 * 16 * 4
    assert calibrated.report["memory_at_peak_bytes"]["activations"] == pytest.approx(
        3 * (analytic.report["memory_at_peak_bytes"]["activations"] - rope) + rope, rel=1e-6
    )


def test_a_section_measured_at_other_dimensions_is_refused_naming_the_fields():
    measured_at = make_scenario(model={"preset": "tiny"})
    profile = make_profile()
    other = _with_compute(profile, synthetic_compute_section(measured_at, profile, 2.0))
    with pytest.raises(UserError, match=r"model.n_layers=2 \(scenario: 4\).*seq_len=64 \(scenario: 128\)"):
        simulate(make_scenario(model={"preset": "tiny", "n_layers": 4}, training={"seq_len": 128}), other)


def test_scaling_carries_the_measured_to_analytic_ratio_to_new_dimensions():
    measured_at = make_scenario(model={"preset": "tiny"})
    profile = make_profile()
    calibrated = _with_compute(profile, synthetic_compute_section(measured_at, profile, 2.0))
    target = make_scenario(model={"preset": "tiny", "n_layers": 4}, training={"seq_len": 128},
                           cluster={"compute_scaling": True})  # fmt: skip
    scaled = simulate(target, calibrated)
    analytic = simulate(target, profile)
    assert _durations(scaled, OpKind.BACKWARD) == pytest.approx(
        [2 * d for d in _durations(analytic, OpKind.BACKWARD)], rel=1e-9
    )
