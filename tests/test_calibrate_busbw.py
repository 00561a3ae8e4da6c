"""algbw / busbw against nccl-tests' definitions (doc/PERFORMANCE.md) and published rows."""

import pytest

from calibrate.busbw import algbw_Bps, bus_factor, busbw_Bps, wire_bytes
from calibrate.records import CurveKey, Point


@pytest.mark.parametrize(
    ("collective", "n", "factor"),
    [
        ("all_gather", 2, 1 / 2),
        ("all_gather", 8, 7 / 8),
        ("reduce_scatter", 8, 7 / 8),
        ("reduce_scatter", 16, 15 / 16),
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 14 / 8),
        ("all_reduce", 16, 30 / 16),
    ],
)
def test_bus_factor_is_the_nccl_tests_correction(collective: str, n: int, factor: float) -> None:
    assert bus_factor(collective, n) == pytest.approx(factor, rel=1e-15)


def test_algbw_is_size_over_time() -> None:
    assert algbw_Bps(1 << 30, 0.5) == 2 * (1 << 30)


@pytest.mark.parametrize(
    ("collective", "n", "size", "time_us", "algbw_GBps", "busbw_GBps"),
    [
        # all_reduce_perf, 16 x H100 over 2 nodes, one row of a published run (8 GiB).
        ("all_reduce", 16, 8589934592, 47535, 180.71, 338.82),
        ("all_reduce", 16, 1073741824, 6759.0, 158.86, 297.86),
        # all_gather_perf, 2 x GB10 over two hosts (16 GiB).
        ("all_gather", 2, 17179869184, 374425, 45.88, 22.94),
    ],
)
def test_published_nccl_tests_rows_are_reproduced(
    collective: str, n: int, size: int, time_us: float, algbw_GBps: float, busbw_GBps: float
) -> None:
    """nccl-tests prints GB/s (1e9 B/s) to 2 decimals, from a time it prints rounded to its last digit."""
    t = time_us * 1e-6
    time_rounding = 0.5 / time_us  # relative error of the printed time (last digit is 1 us here)
    assert algbw_Bps(size, t) / 1e9 == pytest.approx(algbw_GBps, abs=0.005 + algbw_GBps * time_rounding)
    assert busbw_Bps(collective, n, size, t) / 1e9 == pytest.approx(
        busbw_GBps, abs=0.005 + busbw_GBps * time_rounding
    )


def test_wire_bytes_turn_busbw_back_into_time() -> None:
    size, t = 64 << 20, 0.0123
    bw = busbw_Bps("reduce_scatter", 4, size, t)
    assert wire_bytes("reduce_scatter", 4, size) / bw == pytest.approx(t, rel=1e-12)


def test_point_json_carries_both_bandwidths_and_the_spread() -> None:
    key = CurveKey(collective="all_gather", group_size=4, dtype="bf16", spans_nodes=False)
    p = Point(bytes=4096, time_s=2e-5, median_s=2e-5, min_s=1e-5, max_s=4e-5, iters=7, wrong=0).to_dict(key)
    assert p["algbw_Bps"] == pytest.approx(4096 / 2e-5)
    assert p["busbw_Bps"] == pytest.approx(4096 / 2e-5 * 3 / 4)
    assert p["spread"] == pytest.approx(1.5)
    assert (p["time_s"], p["min_s"], p["max_s"], p["wrong"], p["iters"]) == (2e-5, 1e-5, 4e-5, 0, 7)


@pytest.mark.parametrize("bad", [("broadcast", 4), ("all_gather", 0)])
def test_unknown_collective_or_empty_group_is_refused(bad: tuple[str, int]) -> None:
    with pytest.raises(ValueError):
        bus_factor(*bad)


def test_all_to_all_sends_the_share_of_its_buffer_that_leaves_the_rank() -> None:
    """nccl-tests alltoall.cu ``AlltoAllGetBw``: busbw = algbw · (n−1)/n."""
    assert bus_factor("all_to_all", 8) == pytest.approx(7 / 8)


def test_a_point_keeps_the_mean_because_a_step_pays_every_tail() -> None:
    from calibrate.records import point_from_times

    # nine quick calls and one descheduled for a 10 ms time slice
    p = point_from_times(1024, [1e-3] * 9 + [11e-3], wrong=0)
    assert p.time_s == pytest.approx(2e-3)
    assert p.median_s == pytest.approx(1e-3)
    assert (p.min_s, p.max_s, p.iters) == (1e-3, 11e-3, 10)
    assert p.to_dict(CurveKey(collective="all_gather", group_size=2, dtype="fp32", spans_nodes=False))[
        "median_s"
    ] == pytest.approx(1e-3)
