"""The α–β fit recovers latency and bus bandwidth from synthetic points."""

import numpy as np
import pytest

from calibrate.busbw import bus_factor
from calibrate.fit import fit_alpha_beta, fit_curve
from calibrate.records import CurveKey, Point

SIZES = [1 << k for k in range(10, 31, 2)]  # 1 KiB .. 1 GiB


def _points(key: CurveKey, alpha: float, bw: float, noise: float = 0.0, seed: int = 0) -> list[Point]:
    rng = np.random.default_rng(seed)
    f = bus_factor(key.collective, key.group_size)
    out = []
    for s in SIZES:
        t = (alpha + s * f / bw) * (1 + noise * rng.uniform(-1, 1))
        out.append(Point(bytes=s, time_s=t, median_s=t, min_s=t, max_s=t, iters=10, wrong=0))
    return out


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize(("alpha", "bw"), [(15e-6, 360e9), (300e-6, 0.8e9), (2e-3, 40e9)])
def test_exact_points_give_exact_parameters(collective: str, alpha: float, bw: float) -> None:
    key = CurveKey(collective=collective, group_size=8, dtype="bf16", spans_nodes=False)
    fit = fit_curve(key, _points(key, alpha, bw))
    assert fit.latency_s == pytest.approx(alpha, rel=1e-9)
    assert fit.bus_bw_Bps == pytest.approx(bw, rel=1e-9)
    assert fit.rms_rel_residual < 1e-9


def test_noisy_points_give_parameters_within_the_noise() -> None:
    key = CurveKey(collective="all_reduce", group_size=16, dtype="fp32", spans_nodes=True)
    fit = fit_curve(key, _points(key, 45e-6, 42e9, noise=0.03, seed=1))
    assert fit.latency_s == pytest.approx(45e-6, rel=0.05)
    assert fit.bus_bw_Bps == pytest.approx(42e9, rel=0.05)
    assert fit.max_rel_residual < 0.07


def test_flat_times_give_no_negative_latency_and_a_positive_bandwidth() -> None:
    alpha, bw = fit_alpha_beta([1e3, 1e4, 1e5], [1e-3, 1.2e-3, 0.9e-3])
    assert alpha >= 0 and bw > 0


def test_times_through_the_origin_pin_latency_at_zero() -> None:
    # Super-linear small-message behaviour would give a negative intercept; it is pinned to 0.
    alpha, bw = fit_alpha_beta([1e3, 1e6, 1e7], [1e-9, 1e-3, 1.05e-2])
    assert alpha == 0.0 and bw > 0


def test_a_group_of_one_rank_has_no_bandwidth_to_fit() -> None:
    key = CurveKey(collective="all_gather", group_size=1, dtype="fp32", spans_nodes=False)
    with pytest.raises(ValueError):
        fit_curve(key, [Point(bytes=4, time_s=1e-6, median_s=1e-6, min_s=1e-6, max_s=1e-6, iters=1, wrong=0)])
