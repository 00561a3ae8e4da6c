"""Calibration meets topology (``sim.costs.nccl_fit``): measurements on a few nodes fix the NCCL
model's bandwidth and latency factors, which then carry to many nodes; a calibrated profile uses
its measured curves where they match a group and the fitted model elsewhere."""

import dataclasses

import pytest

from sim.core.topology import GroupShape
from sim.costs.collectives import collective_cost
from sim.costs.nccl import nccl_choice
from sim.costs.nccl_fit import fit_nccl
from sim.hardware.cluster_spec import load_cluster
from sim.hardware.network import job_network
from sim.hardware.registry import load_profile
from sim.hardware.schema import CollectiveCurve, LinkModel, NcclFit

SPEC = load_cluster("dgx-h100")
BASE = load_profile("h100-sxm")
ARCH = BASE.device.architecture
TRUTH = NcclFit(
    intra_bw_factor=0.92,
    inter_bw_factor=0.78,
    intra_latency_factor=1.4,
    inter_latency_factor=1.6,
    extra_latency_s=12e-6,
)
SIZES = tuple(1 << k for k in range(10, 31, 4))  # 1 KiB .. 1 GiB


def fabric(nodes: int, per_node: int = 8):  # type: ignore[no-untyped-def]
    net = job_network(SPEC, world_size=nodes * per_node, ranks_per_node=per_node, arch=ARCH)
    return net.fabric(tuple(range(nodes * per_node)))


def measured(collective: str, nodes: int, per_node: int = 8) -> CollectiveCurve:
    """What a cluster whose links behave as ``TRUTH`` says would measure."""
    f = fabric(nodes, per_node)
    times = tuple(nccl_choice(collective, s, f, TRUTH).time_s for s in SIZES)
    return CollectiveCurve(
        collective=collective,
        group_size=nodes * per_node,
        dtype="bf16",
        spans_nodes=nodes > 1,
        sizes_bytes=SIZES,
        times_s=times,
        fit=LinkModel(latency_s=1e-5, bus_bw_Bps=1e11),
        ranks_per_node=per_node,
    )


@pytest.fixture(scope="module")
def calibrated():  # type: ignore[no-untyped-def]
    curves = tuple(measured(c, n) for c in ("all_gather", "reduce_scatter", "all_reduce") for n in (1, 2, 4))
    profile = dataclasses.replace(BASE, calibrated=True, collectives=curves)
    return dataclasses.replace(profile, nccl_fit=fit_nccl(profile, SPEC))


def test_the_fit_recovers_the_links_it_was_measured_on(calibrated) -> None:  # type: ignore[no-untyped-def]
    fit = calibrated.nccl_fit
    assert fit.intra_bw_factor == pytest.approx(TRUTH.intra_bw_factor, rel=0.03)
    assert fit.inter_bw_factor == pytest.approx(TRUTH.inter_bw_factor, rel=0.03)
    assert fit.intra_latency_factor == pytest.approx(TRUTH.intra_latency_factor, rel=0.05)
    assert fit.inter_latency_factor == pytest.approx(TRUTH.inter_latency_factor, rel=0.05)
    assert fit.extra_latency_s == pytest.approx(TRUTH.extra_latency_s, abs=3e-6)
    assert "54 measured points" in fit.source and "fitted" in fit.source


@pytest.mark.parametrize("nodes", [16, 128])
@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
def test_a_fit_on_four_nodes_extrapolates_through_the_model(calibrated, collective: str, nodes: int) -> None:  # type: ignore[no-untyped-def]
    f = fabric(nodes)
    for size in (1 << 20, 1 << 28):
        truth = nccl_choice(collective, size, f, TRUTH).time_s
        assert nccl_choice(collective, size, f, calibrated.nccl_fit).time_s == pytest.approx(truth, rel=0.05)


def test_measured_curves_win_where_they_match_the_group_and_the_fit_elsewhere(calibrated) -> None:  # type: ignore[no-untyped-def]
    size = SIZES[3]
    two_nodes = fabric(2)
    shape = GroupShape(size=16, spans_nodes=True)
    cost = collective_cost("all_gather", size, shape, "bf16", calibrated, two_nodes)
    assert (cost.algorithm, cost.time_s) == ("measured", measured("all_gather", 2).times_s[3])
    # 16 ranks as one per node (an HSDP replicate group): no curve of that layout, so the model
    one_per_node = fabric(16, per_node=1)
    other = collective_cost("all_gather", size, shape, "bf16", calibrated, one_per_node)
    assert other.algorithm != "measured"
    assert other.time_s == pytest.approx(
        nccl_choice("all_gather", size, one_per_node, calibrated.nccl_fit).time_s
    )
