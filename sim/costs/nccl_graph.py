"""NCCL's topology search on the fabric one process group sees (NVIDIA/nccl@5067397,
``src/graph/search.cc`` ``ncclTopoCompute``, ``topo.cc``, ``topo.h``): the channels (rings or trees
laid over the GPUs, entering and leaving a node through a NIC) and their per-channel bandwidth,
tried from the fastest speed of a per-architecture table down, keeping the largest
``nChannels × bw`` the links allow; ``ncclTopoDupChannels`` then doubles the channels at half the
speed. Links in NCCL's own units: NVLink as links × a per-architecture rate, PCIe as lanes × GT/s
/ 80, a NIC as its line rate / 8. The cost model on these graphs is ``sim.costs.nccl``'s.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from sim.hardware.fabric import GroupFabric

GB = 1e9  # NCCL's bandwidths are in GB/s (10^9 B/s)

# search.cc speed arrays (GB/s per channel), tried from the fastest down
SPEEDS_INTRA = {
    "sm80": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    "sm90": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    "sm100": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
}
SPEEDS_INTER = {
    "sm80": (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12),
    "sm90": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
    "sm100": (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
}  # fmt: skip
MAX_RING_CHANNELS = 32  # init.cc: ringGraph->maxChannels = MAXCHANNELS / 2, MAXCHANNELS = 64 (device.h)
NVLS_MAX_ARITY = 32  # device.h NCCL_MAX_NVLS_ARITY: NVLS channels <= min(32, GPUs)
# topo.h per-link NVLink rates NCCL assumes, and the physical per-direction rate of one link
# (NVLink 3 and 4: 25 GB/s; NVLink 5: 50 GB/s), to count a GPU's links from its total bandwidth
NVLINK_NCCL_GBPS = {"sm80": 20.0, "sm86": 12.0, "sm90": 20.6, "sm100": 40.1}
NVLINK_PHYSICAL_LINK_GBPS = {"sm80": 25.0, "sm86": 25.0, "sm90": 25.0, "sm100": 50.0}
# topo.cc: PCIe bandwidth = lanes × GT/s / 80 GB/s, i.e. 48 for Gen5 x16 whose line rate is 63 GB/s
# per direction (32 GT/s × 16 × 128/130 / 8): NCCL counts 48/63 of the physical rate
PCIE_NCCL_PER_PHYSICAL = 48.0 / 63.0


@dataclass(frozen=True, kw_only=True)
class ChannelGraph:
    """A searched graph: channels and their per-channel bandwidth inside and between nodes (GB/s)."""

    n_channels: int
    bw_intra: float
    bw_inter: float


def cc_row(arch: str) -> int:
    """The compute-capability row of NCCL's tables: Volta, Ampere, Hopper, Blackwell."""
    major = sm_number(arch) // 10
    return 3 if major >= 10 else 2 if major >= 9 else 1 if major >= 8 else 0


def sm_number(arch: str) -> int:
    """``sm90`` -> 90; a part NCCL's tables do not know (e.g. AMD's gfx942) counts as sm80."""
    return int(arch[2:]) if arch.startswith("sm") and arch[2:].isdigit() else 80


def _speed_family(arch: str) -> str:
    sm = sm_number(arch)
    return "sm100" if sm >= 100 else "sm90" if sm >= 90 else "sm80"


def nvlink_total_gbps(fabric: GroupFabric) -> float:
    """A GPU's NVLink bandwidth as NCCL counts it (links × per-link rate), 0 without NVLink."""
    if fabric.nvlink_bw_Bps is None:
        return 0.0
    family = fabric.arch if fabric.arch in NVLINK_NCCL_GBPS else _speed_family(fabric.arch)
    links = round(fabric.nvlink_bw_Bps / GB / NVLINK_PHYSICAL_LINK_GBPS[family])
    return max(1, links) * NVLINK_NCCL_GBPS[family]


def pcie_gbps(fabric: GroupFabric) -> float:
    return fabric.pcie_bw_Bps / GB * PCIE_NCCL_PER_PHYSICAL


def nic_gbps(fabric: GroupFabric) -> float:
    """What one NIC carries for this group: its line rate, or its PCIe link if slower, times the
    share the fabric above it delivers (spine oversubscription), split between the groups of the
    same kind that drive it at the same time (two GPUs of different HSDP replicate groups on one
    NIC each get half of it)."""
    return min(fabric.nic_bw_Bps / GB, pcie_gbps(fabric)) * fabric.network_share / fabric.nic_sharing


def _intra_capacity(fabric: GroupFabric) -> float:
    """Per-GPU bandwidth the channels inside a node share: NVLink, else PCIe."""
    return nvlink_total_gbps(fabric) or pcie_gbps(fabric)


def _ring_channels(fabric: GroupFabric, speed: float, multi_node: bool) -> int:
    """The most ring channels of ``speed`` GB/s the links carry (search.cc's recursive search
    adds channels until a link runs out)."""
    n = MAX_RING_CHANNELS
    if fabric.ranks_per_node > 1:
        n = min(n, math.floor(_intra_capacity(fabric) / speed + 1e-9))
    if multi_node:
        per_nic = math.floor(nic_gbps(fabric) / speed + 1e-9)
        n = min(n, per_nic * fabric.nics_per_node)
        if fabric.ranks_per_node == 1:  # every channel leaves through the one GPU's PCIe link
            n = min(n, math.floor(pcie_gbps(fabric) / speed + 1e-9))
    return max(0, n)


def _search(
    speeds: tuple[float, ...], max_bw: float, total_bw: float, channels: Callable[[float], int]
) -> tuple[int, float, int]:
    """search.cc pass 1: from the first speed the paths allow, keep the best nChannels × speed;
    go on to a slower speed while it is more than 0.49 of the best found, stop once the
    channels carry the GPU's whole bandwidth. Returns (channels, speed, index of the speed)."""
    i = next((k for k, s in enumerate(speeds) if s <= max_bw), len(speeds) - 1)
    best: tuple[int, float, int] = (0, 0.0, i)
    while True:
        n = channels(speeds[i])
        if n * speeds[i] > best[0] * best[1]:
            best = (n, speeds[i], i)
        if best[0] and best[0] * best[1] >= total_bw:
            break
        if i + 1 >= len(speeds) or (best[0] and speeds[i + 1] / best[1] <= 0.49):
            break
        i += 1
    if best[0] == 0:  # nothing fits: one channel at the slowest speed (search.cc's fallback order)
        return 1, speeds[-1], len(speeds) - 1
    return best


@cache
def ring_graph(fabric: GroupFabric) -> ChannelGraph:
    """The ring (and tree: same channel count, init.cc) graph of ``fabric``: search, then
    ``ncclTopoDupChannels`` (double the channels at half the speed when a channel is at least
    25 GB/s, unless on sm90+ it is below 50 with more than 4 channels), then pass 2's try of a
    faster speed at the same channel count."""
    multi = fabric.n_nodes > 1
    family = _speed_family(fabric.arch)
    speeds = SPEEDS_INTER[family] if multi else SPEEDS_INTRA[family]
    intra = _intra_capacity(fabric)
    max_bw = min(nic_gbps(fabric), pcie_gbps(fabric)) if multi else intra
    total_bw = intra if fabric.ranks_per_node > 1 else max_bw
    n, bw, i = _search(speeds, max_bw, total_bw, lambda s: _ring_channels(fabric, s, multi))
    if bw >= 25.0 and not (sm_number(fabric.arch) > 80 and bw < 50.0 and n > 4):
        dup = min(2 * n, MAX_RING_CHANNELS)
        bw /= math.ceil(dup / n)
        n = dup
        i = next((k for k, s in enumerate(speeds) if s <= bw), i)
    while i > 0 and _ring_channels(fabric, speeds[i - 1], multi) >= n:
        i -= 1
        bw = speeds[i]
    return ChannelGraph(n_channels=n, bw_intra=bw, bw_inter=bw)


@cache
def nvls_graph(fabric: GroupFabric) -> ChannelGraph | None:
    """NVLS (NVLink SHARP, sm90+ with an NVSwitch): one channel per GPU of the node (up to 32),
    each loading every GPU's NVLink once and its head's twice, so ``(GPUs + 1) × bw`` must fit;
    pass 2 then raises the network-side speed while it is below twice the NVLink-side one
    (search.cc). Across nodes every head sends through its own NIC."""
    if not fabric.nvswitch or sm_number(fabric.arch) < 90 or fabric.ranks_per_node < 2:
        return None
    multi = fabric.n_nodes > 1
    family = _speed_family(fabric.arch)
    speeds = SPEEDS_INTER[family] if multi else SPEEDS_INTRA[family]
    n = min(NVLS_MAX_ARITY, fabric.ranks_per_node)
    intra = nvlink_total_gbps(fabric)
    i = next((k for k, s in enumerate(speeds) if (fabric.ranks_per_node + 1) * s <= intra + 1e-9), None)
    if i is None:
        return None
    bw_intra = speeds[i]
    inter_cap = nic_gbps(fabric) * fabric.nics_per_node / n if multi else math.inf
    if multi and bw_intra > inter_cap:
        return None
    j = i
    while j > 0 and speeds[j] < 2 * bw_intra and speeds[j - 1] <= inter_cap:
        j -= 1
    return ChannelGraph(n_channels=n, bw_intra=bw_intra, bw_inter=speeds[j])
