"""Collective cost model: nccl-tests bus-bandwidth factors, the α–β ring model, measured curves.

Reference: nccl-tests doc/PERFORMANCE.md, busbw = algbw * (n-1)/n for all-gather and
reduce-scatter, * 2(n-1)/n for all-reduce.
"""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.topology import GroupShape
from sim.costs.collectives import alpha_beta_time_s, bus_factor, collective_time_s, wire_bytes_per_rank
from sim.hardware.registry import load_profile
from sim.hardware.schema import CollectiveCurve, HardwareProfile, LinkModel

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
MiB = 1 << 20
H100 = load_profile("h100-sxm")
A100 = load_profile("a100-sxm-80g")


def no_launch(profile: HardwareProfile, curves: tuple[CollectiveCurve, ...] = ()) -> HardwareProfile:
    return replace(profile, backend=replace(profile.backend, collective_launch_s=0.0), collectives=curves)


DEFAULT_FIT = LinkModel(latency_s=50e-6, bus_bw_Bps=100e9)


def curve(sizes, times, *, fit=DEFAULT_FIT, group=8, spans=False, kind="all_gather") -> CollectiveCurve:
    return CollectiveCurve(
        collective=kind,
        group_size=group,
        dtype="bf16",
        spans_nodes=spans,
        sizes_bytes=tuple(sizes),
        times_s=tuple(times),
        fit=fit,
    )


SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
TIMES = (40e-6, 70e-6, 150e-6, 420e-6)
INTRA8 = GroupShape(size=8, spans_nodes=False)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16, 64, 1000, 1024])
def test_bus_factor_is_nccl_tests(n: int) -> None:
    assert bus_factor("all_gather", n) == (n - 1) / n
    assert bus_factor("reduce_scatter", n) == (n - 1) / n
    assert bus_factor("all_reduce", n) == 2 * (n - 1) / n


def test_bus_factor_literals() -> None:
    assert bus_factor("all_gather", 8) == 0.875
    assert bus_factor("all_reduce", 8) == 1.75
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_gather", 1) == 0.0
    with pytest.raises(ValueError, match="broadcast"):
        bus_factor("broadcast", 8)


@pytest.mark.parametrize("k", [2, 4, 8, 32, 512])
def test_ring_all_gather_moves_k_minus_1_shards(k: int) -> None:
    shard = 3 * 1024 * 1024  # bytes each rank contributes
    size = shard * k  # nccl-tests' size is the all-gather output
    assert wire_bytes_per_rank("all_gather", size, k) == pytest.approx(shard * (k - 1), rel=1e-15)
    assert wire_bytes_per_rank("reduce_scatter", size, k) == pytest.approx(shard * (k - 1), rel=1e-15)
    # An all-reduce is a reduce-scatter followed by an all-gather: twice the bytes.
    assert wire_bytes_per_rank("all_reduce", size, k) == pytest.approx(2 * shard * (k - 1), rel=1e-15)


def test_intra_node_alpha_beta_time() -> None:
    size = 256 * MiB
    expected = 10e-6 + 15e-6 + size * 7 / 8 / 360e9  # launch + NVLink latency + wire / busbw
    assert collective_time_s("all_gather", size, INTRA8, "bf16", H100) == pytest.approx(expected, rel=1e-12)
    expected_ar = 10e-6 + 15e-6 + size * 2 * 7 / 8 / 360e9
    assert collective_time_s("all_reduce", size, INTRA8, "bf16", H100) == pytest.approx(
        expected_ar, rel=1e-12
    )


def test_spanning_nodes_uses_the_inter_node_link() -> None:
    size = 256 * MiB
    slow_network = replace(H100, inter_node=LinkModel(latency_s=30e-6, bus_bw_Bps=40e9))
    across = GroupShape(size=16, spans_nodes=True)
    expected = 10e-6 + 30e-6 + size * 15 / 16 / 40e9
    assert collective_time_s("reduce_scatter", size, across, "bf16", slow_network) == pytest.approx(
        expected, rel=1e-12
    )
    within = GroupShape(size=16, spans_nodes=False)  # e.g. one NVLink domain of 16
    assert collective_time_s("reduce_scatter", size, within, "bf16", slow_network) < expected / 5


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_group_of_one_and_empty_message_cost_nothing(collective: str) -> None:
    one = GroupShape(size=1, spans_nodes=False)
    assert collective_time_s(collective, 1 << 30, one, "bf16", H100) == 0.0
    assert collective_time_s(collective, 0, INTRA8, "bf16", H100) == 0.0


@settings(max_examples=300, deadline=None)
@given(
    collective=st.sampled_from(COLLECTIVES),
    size=st.integers(1, 1 << 40),
    group=st.integers(2, 4096),
    spans=st.booleans(),
    profile=st.sampled_from([H100, A100]),
)
def test_never_faster_than_the_link(collective: str, size: int, group: int, spans: bool, profile) -> None:
    shape = GroupShape(size=group, spans_nodes=spans)
    link = profile.inter_node if spans else profile.intra_node
    t = collective_time_s(collective, size, shape, "bf16", profile)
    wire = size * bus_factor(collective, group)
    assert t >= wire / link.bus_bw_Bps
    assert t >= link.latency_s + profile.backend.collective_launch_s
    # more bytes never take less time
    assert collective_time_s(collective, size + 1, shape, "bf16", profile) >= t


def test_measured_sizes_are_reproduced_exactly() -> None:
    p = no_launch(H100, (curve(SIZES, TIMES),))
    for size, t in zip(SIZES, TIMES, strict=True):
        assert collective_time_s("all_gather", size, INTRA8, "bf16", p) == t


def test_launch_overhead_is_not_added_to_a_measured_curve() -> None:
    """Measured times are wall clock: they already contain the launch cost."""
    p = replace(no_launch(H100, (curve(SIZES, TIMES),)), backend=H100.backend)
    assert H100.backend.collective_launch_s > 0
    assert collective_time_s("all_gather", SIZES[1], INTRA8, "bf16", p) == TIMES[1]


def test_launch_overhead_is_added_to_a_datasheet_link_model_only() -> None:
    size = 1 << 20
    datasheet = collective_time_s("all_gather", size, INTRA8, "bf16", H100)
    calibrated = collective_time_s("all_gather", size, INTRA8, "bf16", replace(H100, calibrated=True))
    assert datasheet - calibrated == pytest.approx(H100.backend.collective_launch_s, rel=1e-9)


def test_single_point_curve_reproduces_its_point() -> None:
    p = no_launch(H100, (curve(SIZES[:1], TIMES[:1]),))
    assert collective_time_s("all_gather", SIZES[0], INTRA8, "bf16", p) == pytest.approx(TIMES[0], rel=1e-14)


def test_interpolation_is_log_log() -> None:
    p = no_launch(H100, (curve(SIZES, TIMES),))
    # geometric mean of two neighbouring sizes -> geometric mean of their times
    mid = 8 * MiB  # sqrt(4 MiB * 16 MiB)
    expected = math.sqrt(TIMES[1] * TIMES[2])
    assert collective_time_s("all_gather", mid, INTRA8, "bf16", p) == pytest.approx(expected, rel=1e-12)
    # a quarter of the way in log-size is a quarter of the way in log-time
    quarter = int(round(2 ** (20 + 0.5)))  # 1 MiB * 4**0.25
    expected_q = math.exp(math.log(TIMES[0]) + 0.25 * (math.log(TIMES[1]) - math.log(TIMES[0])))
    got = collective_time_s("all_gather", quarter, INTRA8, "bf16", p)
    log_frac = (math.log(quarter) - math.log(SIZES[0])) / (math.log(SIZES[1]) - math.log(SIZES[0]))
    assert log_frac == pytest.approx(0.25, rel=1e-6)
    assert got == pytest.approx(expected_q, rel=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_between_points_lies_between_neighbours(data) -> None:
    p = no_launch(H100, (curve(SIZES, TIMES),))
    i = data.draw(st.integers(0, len(SIZES) - 2))
    size = data.draw(st.integers(SIZES[i], SIZES[i + 1]))
    t = collective_time_s("all_gather", size, INTRA8, "bf16", p)
    assert TIMES[i] * (1 - 1e-12) <= t <= TIMES[i + 1] * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(
    size=st.one_of(st.integers(1, SIZES[0] - 1), st.integers(SIZES[-1] + 1, 1 << 40)),
    latency=st.floats(0, 1e-3),
    bw=st.floats(1e9, 1e12),
)
def test_outside_the_range_uses_the_fit(size: int, latency: float, bw: float) -> None:
    fit = LinkModel(latency_s=latency, bus_bw_Bps=bw)
    p = no_launch(H100, (curve(SIZES, TIMES, fit=fit),))
    expected = latency + size * 7 / 8 / bw
    assert collective_time_s("all_gather", size, INTRA8, "bf16", p) == pytest.approx(expected, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1 << 36), min_size=1, max_size=8, unique=True).map(sorted),
    slack=st.lists(st.floats(1.0, 10.0), min_size=8, max_size=8),
    query=st.integers(1, 1 << 38),
    latency=st.floats(0, 1e-4),
    bw=st.floats(1e9, 1e12),
)
def test_curves_of_real_points_never_beat_the_fit_link(sizes, slack, query, latency, bw) -> None:
    # Points that respect a link (t >= wire / bw) stay above it when interpolated in log-log space.
    fit = LinkModel(latency_s=latency, bus_bw_Bps=bw)
    times = [s * 7 / 8 / bw * k + 1e-9 for s, k in zip(sizes, slack, strict=False)]
    p = no_launch(H100, (curve(sizes, times, fit=fit),))
    t = collective_time_s("all_gather", query, INTRA8, "bf16", p)
    assert t >= query * 7 / 8 / bw * (1 - 1e-12)


def test_curve_chosen_by_group_and_node_span() -> None:
    fit = LinkModel(latency_s=0.0, bus_bw_Bps=1e9)
    p = no_launch(H100, (curve(SIZES, TIMES, fit=fit, group=16, spans=True),))
    across = GroupShape(size=16, spans_nodes=True)
    assert collective_time_s("all_gather", SIZES[2], across, "bf16", p) == pytest.approx(TIMES[2], rel=1e-14)
    # no curve for a 16-rank group inside one node: the α–β model of the intra-node link
    within = GroupShape(size=16, spans_nodes=False)
    expected = alpha_beta_time_s("all_gather", SIZES[2], 16, H100.intra_node)
    assert collective_time_s("all_gather", SIZES[2], within, "bf16", p) == pytest.approx(expected, rel=1e-14)
    # nor for another collective
    expected_rs = alpha_beta_time_s("reduce_scatter", SIZES[2], 16, H100.inter_node)
    assert collective_time_s("reduce_scatter", SIZES[2], across, "bf16", p) == pytest.approx(
        expected_rs, rel=1e-14
    )
