"""The network one simulated job runs on: its nodes of a cluster as a graph, and the fabric each
process group sees on that graph (``sim.hardware.cluster``). Graphs and fabrics are built once
per cluster and group, and shared by every simulation of a process (a sweep's points)."""

import math
from collections.abc import Hashable
from dataclasses import dataclass, replace
from functools import cache

import networkx as nx

from sim.hardware.cluster import ClusterSpec, cluster_graph, degraded, group_fabric
from sim.hardware.fabric import GroupFabric


@dataclass(frozen=True, kw_only=True)
class Network:
    spec: ClusterSpec
    n_nodes: int
    ranks_per_node: int  # ranks placed on each node (node-major), at most the cluster's GPUs
    arch: str  # the GPUs' architecture, from the profile simulated (it may not be the cluster's own)

    @property
    def graph(self) -> nx.Graph:
        return _graph(self.spec, self.n_nodes)

    def fabric(self, members: tuple[int, ...], nic_sharing: int = 1) -> GroupFabric:
        """What the process group of global ranks ``members`` sees of the cluster, its NICs shared
        with ``nic_sharing`` - 1 other groups running the same collectives."""
        return replace(_fabric(self, members), nic_sharing=nic_sharing)

    def links(self, members: tuple[int, ...]) -> tuple[Hashable, ...]:
        """The links the group's collectives cross on the graph: every node's NVLink domain where
        the group has several GPUs on it, and every NIC its GPUs send through (``sim.core.links``
        shares them between the collectives in flight)."""
        return _links(self, members)

    def nic_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks whose GPUs send through the NIC(s) of ``rank``'s GPU (``rank`` included):
        local GPU i uses NIC i · NICs // GPUs when GPUs share NICs (the graph's PCIe layout)."""
        gpus, nics = self.spec.gpus_per_node, self.spec.nics_per_node
        node, local = divmod(rank, self.ranks_per_node)
        if nics == 0 or nics >= gpus:
            return (rank,)
        nic = local * nics // gpus
        return tuple(
            node * self.ranks_per_node + i for i in range(self.ranks_per_node) if i * nics // gpus == nic
        )


@cache
def _graph(spec: ClusterSpec, n_nodes: int) -> nx.Graph:
    return cluster_graph(spec, n_nodes)


@cache
def _fabric(network: Network, members: tuple[int, ...]) -> GroupFabric:
    return group_fabric(network.spec, network.graph, members, network.ranks_per_node, arch=network.arch)


@cache
def _links(network: Network, members: tuple[int, ...]) -> tuple[Hashable, ...]:
    per_node: dict[int, list[int]] = {}
    for rank in members:
        node, local = divmod(rank, network.ranks_per_node)
        per_node.setdefault(node, []).append(local)
    multi_node = len(per_node) > 1
    graph = network.graph
    links: list[Hashable] = []
    for node, gpus in per_node.items():
        if len(gpus) > 1:
            links.append(("nvlink", node))
        if multi_node:
            links += sorted(
                {
                    nic
                    for g in gpus
                    for sw in graph[("gpu", node, g)]
                    if sw[0] == "pcie"
                    for nic in graph[sw]
                    if nic[0] == "nic"
                }
            )
    return tuple(links)


def job_network(
    spec: ClusterSpec,
    *,
    world_size: int,
    ranks_per_node: int,
    arch: str,
    nics_per_node: int | None = None,
    nic_gbps: float | None = None,
    nic_factor: float = 1.0,
    nvlink_factor: float = 1.0,
    spine_oversubscription: float | None = None,
) -> Network:
    """The nodes ``world_size`` ranks fill, ``ranks_per_node`` to a node, on ``spec`` with the
    scenario's what-ifs applied (other NICs, NICs or NVLink slower by a factor, a spine
    oversubscribed)."""
    if nics_per_node is not None or nic_gbps is not None:
        nics = nics_per_node or spec.nics_per_node
        spec = replace(
            spec,
            nics_per_node=nics,
            nic_gbps=nic_gbps or spec.nic_gbps,
            gpus_per_nic=spec.gpus_per_node / nics,
        )
    spec = degraded(
        spec,
        nic_factor=nic_factor,
        nvlink_factor=nvlink_factor,
        spine_oversubscription=spine_oversubscription,
    )
    return Network(
        spec=spec, n_nodes=math.ceil(world_size / ranks_per_node), ranks_per_node=ranks_per_node, arch=arch
    )
