"""Least-squares α–β fit of a collective's time against its size.

Model (nccl-tests, ``doc/PERFORMANCE.md``: "roughly equal to overhead + size / bw"):
``t = α + S * f / B`` with S the nccl-tests size in bytes, f the bus factor of
``calibrate.busbw.bus_factor`` and B the bus bandwidth in bytes/s. The model is linear in
(α, 1/B); we solve it by least squares on *relative* residuals ``(t_fit - t) / t`` (weights
1/t), so the latency-bound small messages count as much as the bandwidth-bound large ones.
Constraints α >= 0 and B > 0 are enforced by refitting with the violating parameter pinned.
"""

from collections.abc import Sequence

import numpy as np

from calibrate.busbw import bus_factor
from calibrate.records import CurveKey, LinkFit, Point


def _residuals(x: np.ndarray, t: np.ndarray, alpha: float, inv_bw: float) -> np.ndarray:
    return (alpha + x * inv_bw - t) / t


def _fit_linear(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """Weighted least squares of t ≈ α + x·s with weights 1/t; returns (α, s)."""
    a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (alpha, slope), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(alpha), float(slope)


def fit_alpha_beta(wire: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Fit ``t = α + wire / B`` to (wire bytes, seconds); returns (α seconds, B bytes/s).

    ``wire`` is ``S * bus_factor``. Needs at least one point with wire > 0.
    """
    x, t = np.asarray(wire, dtype=float), np.asarray(times_s, dtype=float)
    if x.size == 0 or np.any(t <= 0) or not np.any(x > 0):
        raise ValueError("need positive times and at least one point with wire bytes > 0")
    alpha, slope = _fit_linear(x, t) if x.size >= 2 else (0.0, -1.0)
    if alpha < 0 or slope <= 0:
        candidates = []
        # α pinned to 0: slope = argmin Σ((x s - t)/t)^2
        xs = x / t
        s0 = float(np.dot(xs, np.ones_like(t)) / np.dot(xs, xs))
        candidates.append((0.0, s0))
        # slope pinned to the fastest observed rate: α = weighted mean of what remains
        s1 = float(np.min(t[x > 0] / x[x > 0]))
        rest = t - x * s1
        a1 = max(0.0, float(np.sum(rest / t**2) / np.sum(1 / t**2)))
        candidates.append((a1, s1))
        alpha, slope = min(candidates, key=lambda c: float(np.sum(_residuals(x, t, *c) ** 2)))
    return alpha, 1.0 / slope


def fit_curve(key: CurveKey, points: Sequence[Point]) -> LinkFit:
    """α–β fit of one curve's mean times, with its relative residuals against the raw points."""
    if key.group_size < 2:
        raise ValueError("a group of one rank moves no data; there is no bandwidth to fit")
    f = bus_factor(key.collective, key.group_size)
    wire = [p.bytes * f for p in points]
    times = [p.time_s for p in points]
    alpha, bw = fit_alpha_beta(wire, times)
    res = _residuals(np.asarray(wire), np.asarray(times), alpha, 1 / bw)
    return LinkFit(
        latency_s=alpha,
        bus_bw_Bps=bw,
        rms_rel_residual=float(np.sqrt(np.mean(res**2))),
        max_rel_residual=float(np.max(np.abs(res))),
    )
