"""What a cluster is, as data: ``ClusterSpec`` (one kind of node and the network between
nodes), read from a built-in JSON file in ``sim/hardware/clusters/`` or one of your own with every
mistake named by file and field, the cluster a hardware profile's GPUs come in when the scenario
names none (``default_cluster``), and the same cluster degraded for what-ifs (``degraded``). The
graph of a job's nodes built from a spec is ``sim.hardware.cluster``.

Bandwidths are bytes per second in one direction, except ``nic_gbps``: a NIC's line rate in Gb/s,
as vendors quote it.
"""

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from sim.errors import UserError
from sim.fileio import read_json
from sim.hardware.builtin import BUILTIN_PROFILES, builtin_documents
from sim.hardware.json_reader import JsonReader
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
# PCIe x16 per direction by generation: 8 GT/s (Gen3) doubling per generation, 128b/130b encoding
# (PCI-SIG base specifications; 63.0 GB/s for Gen5 x16 as NVIDIA's DGX H100 documents give it)
PCIE_X16_Bps = {gen: 8e9 * 2 ** (gen - 3) * 16 * 128 / 130 / 8 for gen in (3, 4, 5, 6)}


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


_BUILTIN_DOCUMENTS = builtin_documents("clusters")
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
