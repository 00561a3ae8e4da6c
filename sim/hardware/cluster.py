"""The cluster as a graph: the GPUs, switches, NICs, leaves and spines of a set of nodes and the
links between them, built from a ``ClusterSpec`` (a built-in JSON file in
``sim/hardware/clusters/``, or one of your own). ``group_fabric`` reads the graph for one process
group and returns the ``GroupFabric`` the collective cost model uses; ``degraded`` gives the same
cluster with a slow NIC, slow NVLink or an oversubscribed spine.

Bandwidths are bytes per second in one direction, except ``nic_gbps``: a NIC's line rate in Gb/s,
as vendors quote it.

Graph nodes (attributes ``kind`` and ``layer``, the row of a drawing from the bottom):

- ``("nvswitch", domain)``, layer 0: one per NVLink domain (8 GPUs on HGX, 72 on GB200 NVL72,
  where a domain spans 18 "nodes" of 4 GPUs), only when ``nvswitch``;
- ``("gpu", node, i)``, layer 1;
- ``("pcie", node, j)``, layer 2: one PCIe switch per GPU–NIC group, min(GPUs, NICs) per node
  (``gpus_per_nic`` GPUs share a NIC, or a GPU owns 1 / ``gpus_per_nic`` NICs);
- ``("nic", node, k)``, layer 3; ``("leaf", l)``, layer 4; ``("spine", s)``, layer 5.

Graph edges (attributes ``kind`` and ``capacity_Bps``, per direction):

- ``nvlink``: GPU–NVSwitch at the GPU's NVLink bandwidth (without NVSwitch: GPU–GPU inside a
  domain, the GPU's bandwidth split over its peers);
- ``pcie``: GPU–PCIe switch, the GPU's PCIe link;
- ``nic``: PCIe switch–NIC, the NIC's line rate;
- ``leaf``: NIC–leaf, the NIC's port on its leaf switch, at the NIC's line rate;
- ``spine``: leaf–spine; a full leaf's downlink capacity / oversubscription, spread over the spines.

Leaves: rail-optimized, NIC k of each of ``nodes_per_leaf`` nodes sits on that group's leaf k
(same-rail traffic stays on one leaf); otherwise all NICs of ``nodes_per_leaf`` nodes share one
leaf. Spines: none under a single leaf, else ceil(leaves / (2 · oversubscription)), a two-tier
Clos whose non-blocking leaves give half their ports to uplinks (as in the DGX SuperPOD tables:
4 scalable units, 32 leaves, 16 spines).
"""

import dataclasses
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import networkx as nx

from sim.errors import UserError
from sim.fileio import read_json
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.fabric import GroupFabric
from sim.hardware.json_reader import JsonReader
from sim.hardware.registry import load_profile
from sim.hardware.schema import HardwareProfile

FIELDS = (
    "name",
    "device_profile",
    "gpus_per_node",
    "nvlink_domain",
    "nvlink_bw_Bps",
    "nvswitch",
    "pcie_bw_Bps",
    "nics_per_node",
    "nic_gbps",
    "gpus_per_nic",
    "rail_optimized",
    "nodes_per_leaf",
    "spine_oversubscription",
    "nic_latency_s",
    "host_cpu",
    "collnet",
    "sources",
)
HOST_CPUS = ("intel", "amd", "arm")
LINK_KINDS = ("nvlink", "pcie", "nic", "leaf", "spine")
# PCIe x16 per direction by generation: 8 GT/s (Gen3) doubling per generation, 128b/130b encoding
# (PCI-SIG base specifications; 63.0 GB/s for Gen5 x16 as NVIDIA's DGX H100 documents give it)
PCIE_X16_Bps = {gen: 8e9 * 2 ** (gen - 3) * 16 * 128 / 130 / 8 for gen in (3, 4, 5, 6)}
NODE_LAYERS = {"nvswitch": 0, "gpu": 1, "pcie": 2, "nic": 3, "leaf": 4, "spine": 5}
Node = tuple[Any, ...]


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """One kind of node and the network between nodes. ``sources`` maps a field to its citation
    (it takes no part in equality or hashing)."""

    name: str
    device_profile: str  # a built-in profile name (sim/hardware/profiles) of the GPUs
    gpus_per_node: int
    nvlink_domain: int  # GPUs in one NVLink/NVSwitch domain: 8, or 72 on GB200 NVL72
    nvlink_bw_Bps: float | None  # per GPU, per direction; None: PCIe only
    nvswitch: bool
    pcie_bw_Bps: float  # the GPU's link to the host and to its NIC
    nics_per_node: int
    nic_gbps: float  # one NIC's line rate
    gpus_per_nic: float  # gpus_per_node / nics_per_node: 2 on AWS p4d, 0.25 on p5 (4 NICs per GPU)
    rail_optimized: bool  # NIC k of every node of a leaf group on leaf k
    nodes_per_leaf: int
    spine_oversubscription: float = 1.0  # >= 1: leaf uplink capacity = downlink / oversubscription
    nic_latency_s: float | None = None
    host_cpu: str = "intel"  # NCCL's LL caps and per-step network overhead depend on it (tuning.cc)
    collnet: bool = False  # in-network reduction (SHARP) switches: NCCL's CollNet algorithms
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def nic_bw_Bps(self) -> float:
        """One NIC's bandwidth in bytes per second per direction."""
        return self.nic_gbps * 1e9 / 8


# -- loading ------------------------------------------------------------------------------------


def _read_builtin_documents() -> dict[str, dict[str, Any]]:
    folder = resources.files("sim.hardware") / "clusters"
    docs = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            doc = json.loads(entry.read_text())
            docs[doc["name"]] = doc
    return docs


_BUILTIN_DOCUMENTS = _read_builtin_documents()
BUILTIN_CLUSTERS: tuple[str, ...] = tuple(_BUILTIN_DOCUMENTS)


@cache
def _load_builtin(name: str) -> ClusterSpec:
    return cluster_from_dict(_BUILTIN_DOCUMENTS[name], f"built-in cluster {name}")


def builtin_cluster_document(name: str) -> dict[str, Any]:
    """A copy of a built-in cluster's JSON document (a template for one of your own)."""
    return json.loads(json.dumps(_BUILTIN_DOCUMENTS[name]))


def load_cluster(name_or_path: str, where: str = "cluster") -> ClusterSpec:
    """A built-in cluster by name, or a cluster JSON file by path; a mistake is one ``UserError``
    naming the file and the field."""
    if name_or_path in _BUILTIN_DOCUMENTS:
        return _load_builtin(name_or_path)
    if not Path(name_or_path).is_file():
        raise UserError(
            f"{where}: {name_or_path!r} is neither a built-in cluster ({', '.join(BUILTIN_CLUSTERS)}) "
            "nor an existing file"
        )
    return cluster_from_dict(read_json(name_or_path, "cluster"), str(name_or_path))


def cluster_from_dict(data: Any, where: str) -> ClusterSpec:
    """Parse and check one cluster document (``where`` names it in messages)."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a cluster must be a JSON object")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]}; known fields: {', '.join(FIELDS)}")
    r = JsonReader(data, where)
    gpus, nics = _count(r, "gpus_per_node"), _count(r, "nics_per_node")
    spec = ClusterSpec(
        name=r.get("name", str),
        device_profile=r.choice("device_profile", tuple(BUILTIN_PROFILES)),
        gpus_per_node=gpus,
        nvlink_domain=_count(r, "nvlink_domain"),
        nvlink_bw_Bps=_optional_positive(r, "nvlink_bw_Bps"),
        nvswitch=r.get("nvswitch", bool),
        pcie_bw_Bps=float(r.positive("pcie_bw_Bps")),
        nics_per_node=nics,
        nic_gbps=float(r.positive("nic_gbps")),
        gpus_per_nic=_gpus_per_nic(r, gpus, nics),
        rail_optimized=r.get("rail_optimized", bool),
        nodes_per_leaf=_count(r, "nodes_per_leaf"),
        spine_oversubscription=r.number("spine_oversubscription", 1.0, 1.0),
        nic_latency_s=_optional_positive(r, "nic_latency_s", None),
        host_cpu=r.choice("host_cpu", HOST_CPUS, "intel"),
        collnet=r.get("collnet", bool, False),
        sources=_sources(r),
    )
    _check_shape(spec, where)
    return spec


def _count(r: JsonReader, key: str) -> int:
    value = r.get(key, int)
    if value < 1:
        raise UserError(f"{r.where}: field {r.name(key)} must be an integer >= 1, got {value!r}")
    return int(value)


def _optional_positive(r: JsonReader, key: str, default: Any = ...) -> float | None:
    """A number > 0, or null (PCIe only, unknown)."""
    value = r.get(key, (int, float, type(None)), default)
    if value is not None and value <= 0:
        raise UserError(f"{r.where}: field {r.name(key)} must be > 0 or null, got {value!r}")
    return None if value is None else float(value)


def _gpus_per_nic(r: JsonReader, gpus: int, nics: int) -> float:
    derived = gpus / nics
    given = r.positive("gpus_per_nic", None)
    if given is not None and not math.isclose(given, derived):
        raise UserError(
            f"{r.where}: field gpus_per_nic is {given!r}, but gpus_per_node / nics_per_node = {derived:g}"
        )
    return derived


def _sources(r: JsonReader) -> dict[str, str]:
    if "sources" not in r.data:
        return {}
    s = r.sub("sources")
    for key in s.data:
        if key not in FIELDS:
            raise UserError(f"{r.where}: field {s.name(key)} cites no field of a cluster")
        s.get(key, str)
    return dict(s.data)


def _check_shape(spec: ClusterSpec, where: str) -> None:
    """Cross-field rules: whole NVLink domains and whole GPU–NIC groups per node."""
    gpus, domain, nics = spec.gpus_per_node, spec.nvlink_domain, spec.nics_per_node
    if domain % gpus and gpus % domain:
        raise UserError(
            f"{where}: field nvlink_domain ({domain}) must divide gpus_per_node ({gpus}) or be a multiple of it"
        )
    if gpus % nics and nics % gpus:
        raise UserError(
            f"{where}: field nics_per_node ({nics}) must divide gpus_per_node ({gpus}) or be a multiple of it"
        )
    if spec.nvswitch and spec.nvlink_bw_Bps is None:
        raise UserError(f"{where}: field nvswitch is true but nvlink_bw_Bps is null")


def default_cluster(profile: HardwareProfile, gpus_per_node: int) -> ClusterSpec:
    """The cluster a profile's GPUs come in: the built-in cluster its ``node.cluster`` names, else
    nodes of ``gpus_per_node`` GPUs built from its ``node`` section (NVLink, PCIe, NICs), on
    one leaf per 32 nodes, not rail-optimized. A node without NICs (``nics_per_node`` 0) has
    no network: a group that spans nodes on it is refused when its fabric is asked for."""
    node = profile.node
    if node.cluster is not None:
        return load_cluster(node.cluster, where=f"profile {profile.name}: field node.cluster")
    gen = node.pcie_gen or 4
    nvlink = node.nvlink_bw_Bps
    return ClusterSpec(
        name=f"{profile.name} nodes",
        device_profile=profile.name,
        gpus_per_node=gpus_per_node,
        nvlink_domain=gpus_per_node if nvlink else 1,
        nvlink_bw_Bps=nvlink,
        nvswitch=node.nvswitch and nvlink is not None,
        pcie_bw_Bps=PCIE_X16_Bps[gen] * node.pcie_lanes / 16,
        nics_per_node=node.nics_per_node,
        nic_gbps=node.nic_gbps or 0.0,
        gpus_per_nic=gpus_per_node / node.nics_per_node if node.nics_per_node else math.inf,
        rail_optimized=False,
        nodes_per_leaf=32,
    )


# -- what-ifs -----------------------------------------------------------------------------------


def degraded(
    spec: ClusterSpec,
    *,
    nic_factor: float = 1.0,
    nvlink_factor: float = 1.0,
    spine_oversubscription: float | None = None,
) -> ClusterSpec:
    """The same cluster with its NICs at ``nic_factor`` of their rate, NVLink at ``nvlink_factor``
    and, if given, the spine at another oversubscription; nothing else changes. A ring runs at the
    pace of its slowest link, so one slow NIC per node is modelled as all NICs slow."""
    for name, factor in (("nic_factor", nic_factor), ("nvlink_factor", nvlink_factor)):
        if not factor > 0:
            raise UserError(f"degraded cluster {spec.name}: {name} must be > 0, got {factor!r}")
    if spine_oversubscription is not None and not spine_oversubscription >= 1:
        raise UserError(
            f"degraded cluster {spec.name}: spine_oversubscription must be >= 1, got {spine_oversubscription!r}"
        )
    nvlink = None if spec.nvlink_bw_Bps is None else spec.nvlink_bw_Bps * nvlink_factor
    return dataclasses.replace(
        spec,
        nic_gbps=spec.nic_gbps * nic_factor,
        nvlink_bw_Bps=nvlink,
        spine_oversubscription=spec.spine_oversubscription
        if spine_oversubscription is None
        else float(spine_oversubscription),
    )


# -- the graph ----------------------------------------------------------------------------------


def cluster_graph(spec: ClusterSpec, n_nodes: int) -> nx.Graph:
    """``n_nodes`` nodes of ``spec`` and their network (see the module docstring for the layout)."""
    if n_nodes < 1:
        raise UserError(f"cluster {spec.name}: the number of nodes must be >= 1, got {n_nodes}")
    graph = nx.Graph(cluster=spec.name, n_nodes=n_nodes)
    for node in range(n_nodes):
        _add_node_box(graph, spec, node)
    _add_nvlink(graph, spec, n_nodes)
    _add_leaves(graph, spec, n_nodes)
    _add_spines(graph, spec)
    return graph


def _link(graph: nx.Graph, a: Node, b: Node, kind: str, capacity_Bps: float) -> None:
    for end in (a, b):
        graph.add_node(end, kind=end[0], layer=NODE_LAYERS[end[0]])
    graph.add_edge(a, b, kind=kind, capacity_Bps=float(capacity_Bps))


def _add_node_box(graph: nx.Graph, spec: ClusterSpec, node: int) -> None:
    """One node's GPUs and NICs, each GPU–NIC group under its own PCIe switch."""
    switches = min(spec.gpus_per_node, spec.nics_per_node)
    for i in range(spec.gpus_per_node):
        switch = ("pcie", node, i * switches // spec.gpus_per_node)
        _link(graph, ("gpu", node, i), switch, "pcie", spec.pcie_bw_Bps)
    for k in range(spec.nics_per_node):
        switch = ("pcie", node, k * switches // spec.nics_per_node)
        _link(graph, switch, ("nic", node, k), "nic", spec.nic_bw_Bps)


def _add_nvlink(graph: nx.Graph, spec: ClusterSpec, n_nodes: int) -> None:
    """NVLink domains of ``nvlink_domain`` consecutive GPUs (node-major), through one NVSwitch
    each, or fully connected by direct links without one."""
    bw = spec.nvlink_bw_Bps
    if bw is None:
        return
    gpus = [("gpu", n, i) for n in range(n_nodes) for i in range(spec.gpus_per_node)]
    for domain, start in enumerate(range(0, len(gpus), spec.nvlink_domain)):
        members = gpus[start : start + spec.nvlink_domain]
        if spec.nvswitch:
            for gpu in members:
                _link(graph, gpu, ("nvswitch", domain), "nvlink", bw)
        else:
            for a, b in itertools.combinations(members, 2):
                _link(graph, a, b, "nvlink", bw / (spec.nvlink_domain - 1))


def _leaf_index(spec: ClusterSpec, node: int, nic: int) -> int:
    group = node // spec.nodes_per_leaf
    return group * spec.nics_per_node + nic if spec.rail_optimized else group


def _add_leaves(graph: nx.Graph, spec: ClusterSpec, n_nodes: int) -> None:
    for node in range(n_nodes):
        for k in range(spec.nics_per_node):
            _link(graph, ("nic", node, k), ("leaf", _leaf_index(spec, node, k)), "leaf", spec.nic_bw_Bps)


def _full_leaf_downlink_Bps(spec: ClusterSpec) -> float:
    """What one leaf serves when all its ``nodes_per_leaf`` nodes are there."""
    ports = spec.nodes_per_leaf * (1 if spec.rail_optimized else spec.nics_per_node)
    return ports * spec.nic_bw_Bps


def _add_spines(graph: nx.Graph, spec: ClusterSpec) -> None:
    leaves = sorted(n for n, kind in graph.nodes(data="kind") if kind == "leaf")
    if len(leaves) < 2:
        return
    n_spines = math.ceil(len(leaves) / (2 * spec.spine_oversubscription))
    uplink_Bps = _full_leaf_downlink_Bps(spec) / spec.spine_oversubscription / n_spines
    for leaf in leaves:
        for s in range(n_spines):
            _link(graph, leaf, ("spine", s), "spine", uplink_Bps)


# -- what one process group sees ------------------------------------------------------------------


def group_fabric(
    spec: ClusterSpec,
    graph: nx.Graph,
    members: Sequence[int],
    gpus_per_node: int,
    *,
    arch: str | None = None,
) -> GroupFabric:
    """The fabric a process group of global ``members`` ranks sees; rank r runs on node
    r // ``gpus_per_node``, GPU r % ``gpus_per_node`` (node-major, as torchrun places them).
    ``arch``: the GPUs' architecture (default: the cluster's device profile's)."""
    placement = _placement(spec, graph, members, gpus_per_node)
    per_node = {len(gpus) for gpus in placement.values()}
    if len(per_node) != 1:
        raise ValueError(f"process group {list(members)} has unequal ranks per node: {placement}")
    nics = {node: _nics_of(graph, node, gpus) for node, gpus in placement.items()}
    first_node, first_gpus = next(iter(placement.items()))
    gpu = ("gpu", first_node, first_gpus[0])
    multi_node = len(placement) > 1
    return GroupFabric(
        n_ranks=len(members),
        n_nodes=len(placement),
        ranks_per_node=per_node.pop(),
        arch=arch or load_profile(spec.device_profile).device.architecture,
        nvlink_bw_Bps=_nvlink_Bps(graph, gpu),
        nvswitch=spec.nvswitch,
        nvlink_domain=spec.nvlink_domain,
        pcie_bw_Bps=_capacities(graph, gpu, "pcie")[0],
        nics_per_node=min(len(v) for v in nics.values()) if multi_node else 0,
        # a node without NICs (a workstation's GPUs: rtx-3090's profile) has no NIC bandwidth
        nic_bw_Bps=_capacities(graph, min(nics[first_node]), "nic")[0] if nics[first_node] else 0.0,
        network_share=1 / spec.spine_oversubscription if multi_node and _crosses_spine(graph, nics) else 1.0,
        nic_latency_s=spec.nic_latency_s or 0.0,
        host_cpu="amd" if spec.host_cpu == "amd" else "intel",
        collnet=spec.collnet,
    )


def _placement(
    spec: ClusterSpec, graph: nx.Graph, members: Sequence[int], gpus_per_node: int
) -> dict[int, list[int]]:
    """Node -> the group's GPUs on it."""
    if not members or len(set(members)) != len(members):
        raise ValueError(f"a process group needs distinct ranks, got {list(members)}")
    if not 1 <= gpus_per_node <= spec.gpus_per_node:
        raise UserError(
            f"cluster {spec.name}: {gpus_per_node} ranks per node, but its nodes hold {spec.gpus_per_node} GPUs"
        )
    placement: dict[int, list[int]] = {}
    for rank in members:
        node, local = divmod(rank, gpus_per_node)
        if ("gpu", node, local) not in graph:
            raise UserError(
                f"cluster {spec.name}: rank {rank} runs on node {node}, "
                f"but the cluster graph has {graph.graph.get('n_nodes')} nodes"
            )
        placement.setdefault(node, []).append(local)
    return placement


def _neighbours(graph: nx.Graph, node: Node, kind: str) -> list[Node]:
    return sorted(n for n in graph[node] if n[0] == kind)


def _nics_of(graph: nx.Graph, node: int, gpus: list[int]) -> frozenset[Node]:
    """The NICs the group's GPUs on one node reach through their PCIe switches."""
    switches = {s for i in gpus for s in _neighbours(graph, ("gpu", node, i), "pcie")}
    return frozenset(nic for s in switches for nic in _neighbours(graph, s, "nic"))


def _capacities(graph: nx.Graph, node: Node, kind: str) -> list[float]:
    return [d["capacity_Bps"] for _, _, d in graph.edges(node, data=True) if d["kind"] == kind]


def _nvlink_Bps(graph: nx.Graph, gpu: Node) -> float | None:
    """The GPU's NVLink bandwidth: its link to the NVSwitch, or the sum of its direct links."""
    links = _capacities(graph, gpu, "nvlink")
    return sum(links) if links else None


def _crosses_spine(graph: nx.Graph, nics: Mapping[int, frozenset[Node]]) -> bool:
    """Whether the group's traffic leaves a leaf: same-rail NICs (NIC k of each node) under
    different leaves; when the nodes use different rails, any two leaves at all."""
    same_rails = len({frozenset(nic[2] for nic in v) for v in nics.values()}) == 1
    leaves: dict[int | None, set[Node]] = defaultdict(set)
    for node_nics in nics.values():
        for nic in node_nics:
            leaves[nic[2] if same_rails else None].update(_neighbours(graph, nic, "leaf"))
    return any(len(v) > 1 for v in leaves.values())
