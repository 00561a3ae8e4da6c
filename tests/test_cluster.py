"""The cluster graph (``sim.hardware.cluster``): the built-in clusters load and cite every figure,
the graph has exactly the vertices and links the layout promises, a process group sees the NICs
its GPUs can drive and the oversubscription of the leaves it crosses, the what-ifs change only
what they say, mistakes are one line naming the file and field, and ``fsdpsim cluster show``
writes a drawing."""

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from sim.cli import cluster as cli
from sim.errors import UserError
from sim.hardware.cluster import cluster_graph, group_fabric
from sim.hardware.cluster_spec import (
    BUILTIN_CLUSTERS,
    ClusterSpec,
    builtin_cluster_document,
    degraded,
    load_cluster,
)
from sim.hardware.registry import load_profile

CLUSTERS_DIR = Path(__file__).resolve().parent.parent / "sim" / "hardware" / "clusters"
CATALOG = {
    "dgx-a100",
    "dgx-h100",
    "hgx-h200",
    "hgx-b200",
    "gb200-nvl72",
    "aws-p4d",
    "aws-p5",
    "aws-p5en",
    "gcp-a3",
    "gcp-a3-mega",
    "azure-nd-h100-v5",
}


def _kinds(graph: Any, what: str) -> dict[str, int]:
    """Vertices (``what="nodes"``) or links (``"edges"``) counted by kind."""
    counts: dict[str, int] = {}
    items = graph.nodes(data="kind") if what == "nodes" else ((a, k) for _, a, k in graph.edges(data="kind"))
    for _, kind in items:
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# -- the catalog ---------------------------------------------------------------------------------


def test_the_catalog_is_complete_and_each_file_is_named_after_its_cluster() -> None:
    assert set(BUILTIN_CLUSTERS) == CATALOG
    for path in CLUSTERS_DIR.glob("*.json"):
        assert json.loads(path.read_text())["name"] == path.stem


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_builtin_loads_and_cites_each_field(name: str) -> None:
    spec = load_cluster(name)
    load_profile(spec.device_profile)  # the GPUs are a built-in profile
    cited = [f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) is not None]
    cited = [f for f in cited if f not in ("name", "sources")]
    numeric = [f for f in cited if isinstance(getattr(spec, f), int | float)]
    assert len(numeric) >= 9  # the counts, bandwidths, ratios and sizes are all there
    for field_name in cited:
        assert len(spec.sources.get(field_name, "")) >= 15, f"{name}: no source for {field_name}"


def test_a_cluster_file_of_your_own_loads_like_the_builtin_it_copies(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(builtin_cluster_document("aws-p5")))
    assert load_cluster(str(path)) == load_cluster("aws-p5")


def test_gpus_per_nic_is_derived_when_not_given(tmp_path: Path) -> None:
    doc = builtin_cluster_document("aws-p5")
    del doc["gpus_per_nic"], doc["sources"]
    path = tmp_path / "p5.json"
    path.write_text(json.dumps(doc))
    assert load_cluster(str(path)).gpus_per_nic == 0.25  # 8 GPUs over 32 EFA: 4 NICs per GPU


# -- the graph -----------------------------------------------------------------------------------


def test_dgx_h100_graph_of_4_nodes_has_exactly_the_promised_vertices_and_links() -> None:
    spec = load_cluster("dgx-h100")  # 8 GPUs, 8 NICs, NVSwitch, rail-optimized, 32 nodes per leaf group
    graph = cluster_graph(spec, 4)
    # vertices: 4 nodes x 8 GPUs = 32; one NVSwitch per 8-GPU domain = 4; PCIe switches per node =
    # min(8 GPUs, 8 NICs) = 8, so 32; NICs 4 x 8 = 32; the 4 nodes sit in one leaf group of 32 and,
    # rail-optimized, NIC k of each node is on leaf k: 8 leaves; spines ceil(8 / (2 x 1)) = 4.
    assert _kinds(graph, "nodes") == {"gpu": 32, "nvswitch": 4, "pcie": 32, "nic": 32, "leaf": 8, "spine": 4}
    assert graph.number_of_nodes() == 32 + 4 + 32 + 32 + 8 + 4 == 112
    # links: GPU-NVSwitch 32; GPU-PCIe 32; PCIe-NIC 32; NIC-leaf 32; every leaf to every spine 8 x 4 = 32.
    assert _kinds(graph, "edges") == {"nvlink": 32, "pcie": 32, "nic": 32, "leaf": 32, "spine": 32}
    assert graph.number_of_edges() == 160
    capacity = {k: d["capacity_Bps"] for _, _, d in graph.edges(data=True) for k in [d["kind"]]}
    # NVLink 450 GB/s; PCIe Gen5 63 GB/s; NDR 400 Gb/s = 50 GB/s; a full leaf serves 32 NICs of
    # 50 GB/s non-blocking, spread over 4 spines: 32 x 50 / 4 = 400 GB/s per leaf-spine link.
    assert capacity == {"nvlink": 450e9, "pcie": 63e9, "nic": 50e9, "leaf": 50e9, "spine": 400e9}


def test_leaves_and_spines_match_the_superpod_table() -> None:
    """DGX SuperPOD B200 RA: 4 SUs, 128 nodes, 32 leaf and 16 spine switches, as much capacity
    up from the leaves as down to the NICs (non-blocking)."""
    graph = cluster_graph(load_cluster("hgx-b200"), 128)
    kinds = _kinds(graph, "nodes")
    assert (kinds["leaf"], kinds["spine"]) == (32, 16)
    up = sum(d["capacity_Bps"] for _, _, d in graph.edges(data=True) if d["kind"] == "spine")
    down = sum(d["capacity_Bps"] for _, _, d in graph.edges(data=True) if d["kind"] == "leaf")
    assert up == pytest.approx(down)


def test_a_single_top_of_rack_leaf_has_no_spine() -> None:
    graph = cluster_graph(load_cluster("aws-p4d"), 2)
    assert _kinds(graph, "nodes")["leaf"] == 1 and "spine" not in _kinds(graph, "nodes")


def test_an_nvl72_domain_spans_18_trays_of_4_gpus() -> None:
    graph = cluster_graph(load_cluster("gb200-nvl72"), 36)
    switches = sorted(n for n, k in graph.nodes(data="kind") if k == "nvswitch")
    assert switches == [("nvswitch", 0), ("nvswitch", 1)]
    assert {n[1] for n in graph[("nvswitch", 1)]} == set(range(18, 36))  # trays 18..35
    assert graph.degree(("nvswitch", 0)) == 72


def test_gpus_share_a_nic_through_their_pcie_switch() -> None:
    graph = cluster_graph(load_cluster("aws-p4d"), 1)  # 8 GPUs, 4 NICs: 2 GPUs per NIC
    switch = next(n for n in graph[("gpu", 0, 3)] if n[0] == "pcie")
    under = sorted(n for n in graph[switch] if n[0] in ("gpu", "nic"))
    assert under == [("gpu", 0, 2), ("gpu", 0, 3), ("nic", 0, 1)]


# -- what one process group sees -------------------------------------------------------------------


def _fabric(name: str, n_nodes: int, members: list[int], spec: ClusterSpec | None = None) -> Any:
    spec = spec or load_cluster(name)
    return group_fabric(spec, cluster_graph(spec, n_nodes), members, spec.gpus_per_node)


def test_all_8_gpus_of_2_nodes_drive_all_8_nics() -> None:
    f = _fabric("dgx-h100", 2, list(range(16)))
    assert (f.n_ranks, f.n_nodes, f.ranks_per_node, f.nics_per_node) == (16, 2, 8, 8)
    assert (f.nic_bw_Bps, f.nvlink_bw_Bps, f.pcie_bw_Bps, f.network_share) == (50e9, 450e9, 63e9, 1.0)
    assert (f.arch, f.nvswitch, f.nvlink_domain) == ("sm90", True, 8)


def test_the_hsdp_replicate_group_of_one_gpu_per_node_drives_its_own_nic_only() -> None:
    members = [8 * node for node in range(16)]  # GPU 0 of each of 16 nodes
    f = _fabric("dgx-h100", 16, members)
    assert (f.n_nodes, f.ranks_per_node, f.nics_per_node, f.nic_bw_Bps) == (16, 1, 1, 50e9)
    assert _fabric("aws-p4d", 16, members).nics_per_node == 1  # two GPUs share each 100 Gb/s EFA
    assert _fabric("aws-p5", 16, members).nics_per_node == 4  # each GPU owns four 100 Gb/s EFA


def test_a_group_inside_one_node_uses_no_nic() -> None:
    f = _fabric("dgx-h100", 2, list(range(8, 16)))
    assert (f.n_nodes, f.ranks_per_node, f.nics_per_node, f.network_share) == (1, 8, 0, 1.0)
    assert _fabric("dgx-h100", 2, [8, 9]).nics_per_node == 0


def test_fewer_ranks_per_node_than_gpus_place_ranks_node_major() -> None:
    spec = load_cluster("dgx-h100")
    f = group_fabric(spec, cluster_graph(spec, 4), list(range(16)), gpus_per_node=4)
    assert (f.n_nodes, f.ranks_per_node, f.nics_per_node) == (4, 4, 4)


@pytest.mark.parametrize(
    "name, members, crosses",
    [
        ("dgx-h100", [0, 8 * 31], False),  # rail 0 of nodes 0 and 31: one leaf group of 32
        ("dgx-h100", [0, 8 * 32], True),  # nodes 0 and 32: two leaf groups, through the spine
        ("dgx-h100", list(range(8)) + list(range(8 * 40, 8 * 41)), True),
        ("dgx-h100", [0, 8 + 1], True),  # GPU 0 of node 0 and GPU 1 of node 1: different rails
        ("aws-p5", [0, 8 * 31], False),  # one top-of-rack leaf of 32 nodes
        ("aws-p5", [0, 8 * 40], True),
    ],
)
def test_oversubscription_lowers_the_share_only_when_a_group_crosses_leaves(
    name: str, members: list[int], crosses: bool
) -> None:
    spec = load_cluster(name)
    assert _fabric(name, 64, members).network_share == 1.0  # non-blocking as built
    share = _fabric(name, 64, members, degraded(spec, spine_oversubscription=4)).network_share
    assert share == (0.25 if crosses else 1.0)


def test_a_rank_beyond_the_graph_or_too_many_ranks_per_node_is_a_user_error() -> None:
    spec = load_cluster("dgx-h100")
    graph = cluster_graph(spec, 2)
    with pytest.raises(UserError, match="rank 16 runs on node 2"):
        group_fabric(spec, graph, [0, 16], 8)
    with pytest.raises(UserError, match="16 ranks per node"):
        group_fabric(spec, graph, [0, 1], 16)


# -- what-ifs -----------------------------------------------------------------------------------------


def test_degraded_changes_exactly_what_it_says() -> None:
    spec = load_cluster("dgx-h100")
    slow = degraded(spec, nic_factor=0.5, nvlink_factor=0.25, spine_oversubscription=2)
    before, after = dataclasses.asdict(spec), dataclasses.asdict(slow)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"nic_gbps", "nvlink_bw_Bps", "spine_oversubscription"}
    assert (slow.nic_gbps, slow.nvlink_bw_Bps, slow.spine_oversubscription) == (200.0, 112.5e9, 2.0)
    assert degraded(spec) == spec
    assert degraded(spec, nic_factor=0.5).nvlink_bw_Bps == spec.nvlink_bw_Bps
    f = _fabric("dgx-h100", 2, list(range(16)), slow)
    assert (f.nic_bw_Bps, f.nvlink_bw_Bps, f.network_share) == (25e9, 112.5e9, 1.0)  # 2 nodes: one leaf group


@pytest.mark.parametrize(
    "kwargs, message",
    [({"nic_factor": 0}, "nic_factor must be > 0"), ({"spine_oversubscription": 0.5}, "must be >= 1")],
)
def test_a_bad_what_if_is_a_user_error(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(UserError, match=message):
        degraded(load_cluster("dgx-h100"), **kwargs)


# -- mistakes ---------------------------------------------------------------------------------------


def _edit(doc: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    if value is _DELETE:
        del doc[key]
    else:
        doc[key] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("nic_gbps", "fast", "nic_gbps"),
        ("nic_gbps", -1, "nic_gbps"),
        ("gpus_per_node", 8.5, "gpus_per_node"),
        ("nics_per_node", _DELETE, "nics_per_node"),
        ("nvswitch", "yes", "nvswitch"),
        ("device_profile", "h900", "device_profile"),
        ("gpus_per_nic", 2, "gpus_per_nic"),
        ("nvlink_domain", 6, "nvlink_domain"),
        ("spine_oversubscription", 0.5, "spine_oversubscription"),
        ("nic_gbs", 400, "nic_gbs"),
        ("sources", {"nic_speed": "x"}, "sources.nic_speed"),
    ],
)
def test_a_bad_field_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, key: str, value: Any, field: str
) -> None:
    path = tmp_path / "bad-cluster.json"
    path.write_text(json.dumps(_edit(builtin_cluster_document("dgx-h100"), key, value)))
    with pytest.raises(UserError) as err:
        load_cluster(str(path))
    message = str(err.value)
    assert str(path) in message and field in message and "\n" not in message


def test_a_malformed_file_or_unknown_name_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{ not json")
    with pytest.raises(UserError, match="broken.json: not a valid JSON cluster"):
        load_cluster(str(path))
    with pytest.raises(UserError, match="neither a built-in cluster"):
        load_cluster("dgx-h900")


# -- the command line --------------------------------------------------------------------------------


def test_cluster_list_names_every_builtin(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argparse.Namespace(action="list", name=None, nodes=2, plot=None)) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in CATALOG)


def test_cluster_show_prints_the_spec_and_the_graph_and_writes_a_drawing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("plotly")
    path = tmp_path / "x.html"
    assert cli.main(argparse.Namespace(action="show", name="dgx-h100", nodes=2, plot=str(path))) == 0
    out = capsys.readouterr().out
    assert "nic_gbps                400 Gb/s" in out and "sources:" in out
    # 16 GPUs, 2 NVSwitches, 16 PCIe switches, 16 NICs, 8 leaves, 4 spines; 16 x 4 + 32 links
    assert "graph of 2 nodes: 62 vertices, 96 links" in out
    assert "spine      32 links: 32 x 400 GB/s per direction" in out  # 8 leaves x 4 spines
    page = path.read_text()
    assert "<title>fsdp-sim cluster: dgx-h100, 2 nodes</title>" in page
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, no temporary left


def test_cluster_show_without_a_name_is_a_user_error() -> None:
    with pytest.raises(UserError, match="needs a cluster name"):
        cli.main(argparse.Namespace(action="show", name=None, nodes=2, plot=None))
