"""NCCL's cost model on the cluster graph (``sim.costs.nccl``): the channel search gives the graphs
NCCL's own search gives (derived by hand from search.cc's speed tables for each cluster), the
tuner picks what NCCL picks, latency grows with the ring's steps, no ring beats its links, and
large- and small-message figures land within the issue's tolerances of published nccl-tests runs
(``shared/published-dev.md`` §4)."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.costs.collectives import bus_factor
from sim.costs.nccl import nccl_choice
from sim.costs.nccl_graph import ChannelGraph, nvls_graph, ring_graph
from sim.hardware.cluster_spec import load_cluster
from sim.hardware.network import job_network
from sim.hardware.registry import load_profile
from validation.published_network import CHECKS, CollectiveCheck, predicted_value

GiB, MiB = 1 << 30, 1 << 20


def network(cluster: str, nodes: int, ranks_per_node: int | None = None, **what_ifs: object):
    spec = load_cluster(cluster)
    if what_ifs:
        spec = dataclasses.replace(spec, **what_ifs)
    rpn = ranks_per_node or spec.gpus_per_node
    arch = load_profile(spec.device_profile).device.architecture
    return job_network(spec, world_size=nodes * rpn, ranks_per_node=rpn, arch=arch)


def world(cluster: str, nodes: int, **what_ifs: object):
    net = network(cluster, nodes, **what_ifs)
    return net.fabric(tuple(range(net.n_nodes * net.ranks_per_node)))


def busbw(collective: str, size: int, cluster: str, nodes: int, **what_ifs: object) -> float:
    """nccl-tests' bus bandwidth of the model's time (NCCL's estimate, no host launch)."""
    fabric = world(cluster, nodes, **what_ifs)
    t = nccl_choice(collective, size, fabric).time_s
    return size / t * bus_factor(collective, fabric.n_ranks)


# -- the channel search ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "nodes", "what_ifs", "graph"),
    [
        # 8 x H100 in a node: 18 NVLinks x 20.6 = 370.8 GB/s; 6 channels of 60, doubled to 12 of 30
        ("dgx-h100", 1, {}, ChannelGraph(n_channels=12, bw_intra=30.0, bw_inter=30.0)),
        # 8 x A100: 12 x 20 = 240; 6 of 40 fill it, doubled (sm80) to 12 of 20
        ("dgx-a100", 1, {}, ChannelGraph(n_channels=12, bw_intra=20.0, bw_inter=20.0)),
        # across DGX A100s: one channel per HDR NIC at 24 (its Gen4 PCIe path), 8 x 24 = 192
        ("dgx-a100", 4, {}, ChannelGraph(n_channels=8, bw_intra=24.0, bw_inter=24.0)),
        # across DGX H100s: 8 x 48 overruns NVLink, 8 x 45 = 360 fits; no doubling on sm90 below 50
        ("dgx-h100", 4, {}, ChannelGraph(n_channels=8, bw_intra=45.0, bw_inter=45.0)),
        # 4 x 400 Gb/s per node: 4 channels of 48, doubled to 8 of 24 (4 channels is not > 4)
        (
            "dgx-h100",
            5,
            {"nics_per_node": 4, "gpus_per_nic": 2},
            ChannelGraph(n_channels=8, bw_intra=24.0, bw_inter=24.0),
        ),
    ],
)
def test_ring_channels_are_those_nccls_search_finds(cluster, nodes, what_ifs, graph) -> None:
    assert ring_graph(world(cluster, nodes, **what_ifs)) == graph


def test_nvls_uses_one_channel_per_gpu_with_the_head_pulling_twice() -> None:
    # (8 + 1) x 40 <= 370.8 < 9 x 50; the network-side speed then rises to 60 (< 2 x 40)
    assert nvls_graph(world("dgx-h100", 1)) == ChannelGraph(n_channels=8, bw_intra=40.0, bw_inter=60.0)
    assert nvls_graph(world("dgx-a100", 1)) is None  # NVLS needs sm90 and an NVSwitch


# -- what NCCL picks ---------------------------------------------------------------------------------


def test_the_tuner_picks_by_size_and_shape() -> None:
    h100 = world("dgx-h100", 1)
    assert nccl_choice("all_reduce", 1 << 30, h100).algorithm == "nvls"  # NVLink SHARP in a node
    assert (
        nccl_choice("all_gather", 1 << 30, h100).algorithm,
        nccl_choice("all_gather", 1 << 30, h100).protocol,
    ) == (
        "ring",
        "Simple",
    )
    assert nccl_choice("all_gather", 4096, h100).protocol == "LL"  # small: the low-latency protocol
    assert nccl_choice("all_reduce", 1 << 30, world("dgx-a100", 1)).algorithm == "ring"  # no NVLS on sm80
    across = world("dgx-a100", 32)
    assert nccl_choice("all_reduce", 8, across).algorithm == "tree"  # log2(32) hops, not 62 ring steps
    assert nccl_choice("all_reduce", 1 << 30, across).algorithm == "ring"
    # one GPU per node (an HSDP replicate group's shape): PAT for all-gather
    net = network("dgx-h100", 16)
    replicate = net.fabric(tuple(8 * n for n in range(16)))
    assert (replicate.ranks_per_node, nccl_choice("all_gather", 1 << 20, replicate).algorithm) == (1, "pat")


def test_latency_grows_with_the_rings_steps() -> None:
    times = [nccl_choice("all_gather", MiB, world("dgx-h100", n)).time_s for n in (1, 2, 16, 128, 1024)]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert times[-1] > 50 * times[1]  # 8,191 steps against 15
    small = [nccl_choice("all_reduce", 8, world("dgx-a100", n)).time_s for n in (2, 4, 8, 16, 32)]
    steps = [b - a for a, b in zip(small, small[1:], strict=False)]
    assert all(d == pytest.approx(steps[0], abs=1e-9) for d in steps)  # a tree adds one hop per doubling


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["dgx-a100", "dgx-h100", "aws-p4d", "aws-p5", "hgx-b200", "gcp-a3"]),
    st.integers(1, 64),
    st.sampled_from(["all_gather", "reduce_scatter"]),
    st.integers(10, 34),
)
def test_no_ring_beats_its_links(cluster: str, nodes: int, collective: str, log_size: int) -> None:
    """Each rank sends size·(n-1)/n to its ring neighbour, over NVLink (or PCIe); across nodes as
    many bytes leave every node through its NICs. Neither can go faster than the links."""
    fabric = world(cluster, nodes)
    size = 1 << log_size
    choice = nccl_choice(collective, size, fabric)
    if choice.algorithm != "ring":
        return
    wire = size * bus_factor(collective, fabric.n_ranks)
    link = fabric.nvlink_bw_Bps or fabric.pcie_bw_Bps
    if fabric.n_nodes > 1:
        link = min(link, fabric.nics_per_node * fabric.nic_bw_Bps)
    assert choice.time_s >= wire / link


# -- against published nccl-tests runs ------------------------------------------------------------


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
def test_published_collectives_are_within_the_issues_tolerances(check: CollectiveCheck) -> None:
    """Large messages: bus bandwidth within 10 %; small ones: time within 25 %, as a simulated step
    charges it (NCCL's model and the host's launch of the collective)."""
    assert predicted_value(check) == pytest.approx(check.published, rel=check.tolerance), check.source


def test_a_slower_nic_or_an_oversubscribed_spine_slows_only_what_crosses_it() -> None:
    size = GiB
    base = busbw("all_gather", size, "dgx-h100", 4)
    assert busbw("all_gather", size, "dgx-h100", 4, nic_gbps=200.0) < 0.6 * base
    assert busbw("all_gather", size, "dgx-h100", 1, nic_gbps=200.0) == busbw(
        "all_gather", size, "dgx-h100", 1
    )
    spec = load_cluster("dgx-h100")
    arch = load_profile("h100-sxm").device.architecture
    within_leaf = job_network(spec, world_size=8 * 32, ranks_per_node=8, arch=arch, spine_oversubscription=4)
    across = job_network(spec, world_size=8 * 64, ranks_per_node=8, arch=arch, spine_oversubscription=4)
    t_leaf = nccl_choice("all_gather", size, within_leaf.fabric(tuple(range(256)))).time_s
    t_spine = nccl_choice("all_gather", size, across.fabric(tuple(range(512)))).time_s
    assert t_spine > 3 * t_leaf  # 32 nodes share a leaf; 64 cross the 4:1 spine


def test_groups_sharing_a_nic_split_it() -> None:
    """On p4d two GPUs share each EFA NIC: the HSDP replicate groups of GPU 0 and GPU 1 all-reduce
    at the same time over it."""
    net = network("aws-p4d", 16)
    members = tuple(8 * n for n in range(16))
    assert net.nic_peers(0) == (0, 1) and net.nic_peers(3) == (2, 3)
    alone = nccl_choice("all_reduce", GiB, net.fabric(members)).time_s
    shared = nccl_choice("all_reduce", GiB, net.fabric(members, nic_sharing=2)).time_s
    assert shared == pytest.approx(2 * alone, rel=0.05)
