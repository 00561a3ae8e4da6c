"""The network one simulated job runs on: its nodes of a cluster as a graph, and the fabric each
process group sees on that graph (``sim.hardware.cluster``). Graphs and fabrics are built once
per cluster and group, and shared by every simulation of a process (a sweep's points)."""

import math
from collections.abc import Hashable
from dataclasses import dataclass, replace
from functools import cache

import networkx as nx
import numpy as np

from sim.errors import UserError
from sim.hardware.cluster import Node, cluster_graph, group_fabric
from sim.hardware.cluster_spec import ClusterSpec, degraded
from sim.hardware.fabric import GroupFabric


@dataclass(frozen=True, kw_only=True)
class Network:
    spec: ClusterSpec
    n_nodes: int
    ranks_per_node: int  # ranks placed on each node (node-major), at most the cluster's GPUs
    arch: str  # the GPUs' architecture, from the profile simulated (it may not be the cluster's own)
    # what-ifs that make links differ: each NIC's rate × a draw from N(1, nic_jitter) (clipped to
    # [0.05, 2], one seeded draw per NIC), and one NIC (node, index) at slow_nic_factor of its rate
    nic_jitter: float = 0.0
    seed: int = 0
    slow_nic: tuple[int, int] | None = None
    slow_nic_factor: float = 1.0

    @property
    def links_identical(self) -> bool:
        """Whether every group of a kind sees the same links (then one rank stands for all)."""
        return self.nic_jitter == 0 and (self.slow_nic is None or self.slow_nic_factor == 1.0)

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
    fabric = group_fabric(network.spec, network.graph, members, network.ranks_per_node, arch=network.arch)
    if network.links_identical or fabric.n_nodes == 1:
        return fabric
    factors = _nic_factors(network)
    # a ring splits its bytes evenly over its channels and ends with the slowest one
    slowest = min(factors[link] for link in _links(network, members) if link in factors)
    return replace(fabric, nic_bw_Bps=fabric.nic_bw_Bps * slowest)


@cache
def _nic_factors(network: Network) -> dict[Node, float]:
    """Each NIC's factor on its rate (``Network``'s what-ifs), by graph vertex ("nic", node, k)."""
    nics: list[Node] = [
        ("nic", node, k) for node in range(network.n_nodes) for k in range(network.spec.nics_per_node)
    ]
    factors: dict[Node, float] = dict.fromkeys(nics, 1.0)
    if network.nic_jitter > 0:
        rng = np.random.default_rng(network.seed)
        draws = np.clip(rng.normal(1.0, network.nic_jitter, size=len(nics)), 0.05, 2.0)
        factors = dict(zip(nics, (float(d) for d in draws), strict=True))
    if network.slow_nic is not None:
        node, k = network.slow_nic
        factors[("nic", node, k)] *= network.slow_nic_factor
    return factors


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
    nic_jitter: float = 0.0,
    seed: int = 0,
    slow_nic: tuple[int, int] | None = None,
    slow_nic_factor: float = 1.0,
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
    n_nodes = math.ceil(world_size / ranks_per_node)
    if slow_nic is not None and not (0 <= slow_nic[0] < n_nodes and 0 <= slow_nic[1] < spec.nics_per_node):
        raise UserError(
            f"simulation.slow_nic_node = {slow_nic[0]}, simulation.slow_nic = {slow_nic[1]}: not in the job, "
            f"whose {n_nodes} node(s) have NICs 0..{spec.nics_per_node - 1}"
        )
    return Network(
        spec=spec,
        n_nodes=n_nodes,
        ranks_per_node=ranks_per_node,
        arch=arch,
        nic_jitter=nic_jitter,
        seed=seed,
        slow_nic=slow_nic,
        slow_nic_factor=slow_nic_factor,
    )
