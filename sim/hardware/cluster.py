"""The cluster as a graph: the GPUs, switches, NICs, leaves and spines of a set of nodes and the
links between them, built from a ``ClusterSpec`` (``sim.hardware.cluster_spec``: a built-in JSON
file in ``sim/hardware/clusters/``, or one of your own, and its degraded what-ifs).
``group_fabric`` reads the graph for one process group and returns the ``GroupFabric`` the
collective cost model uses.

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

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from sim.errors import UserError
from sim.hardware.cluster_spec import ClusterSpec
from sim.hardware.fabric import GroupFabric
from sim.hardware.registry import load_profile

LINK_KINDS = ("nvlink", "pcie", "nic", "leaf", "spine")
NODE_LAYERS = {"nvswitch": 0, "gpu": 1, "pcie": 2, "nic": 3, "leaf": 4, "spine": 5}
Node = tuple[Any, ...]


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
