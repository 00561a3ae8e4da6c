"""Time of one all-to-all (expert parallelism's token dispatch and combine) on NCCL, from the
fabric its group sees. A pure function.

NCCL has no all-to-all algorithm in its tuner: ``ncclAllToAll`` (and torch's
``all_to_all_single``) is a group of point-to-point sends and receives, one pair per peer, run
concurrently (``src/collectives.cc`` / nccl-tests ``src/alltoall.cu``). With nccl-tests' size S
(each rank's send buffer; busbw = algbw · (n−1)/n, ``AlltoAllGetBw``) each rank sends S/n to every
peer: S·(r−1)/n over its node's NVLink (or PCIe without it) to the r−1 peers on its node, and
S·(n−r)/n through its share of the node's NICs to the others. The two run at once, so the time is
the slower of the two plus one point-to-point latency:

    t = latency + max(S·(r−1)/n / nvlink_bw, S·(n−r)/n / (nics · nic_bw · share / (r · sharing)))

Bandwidths are the ``GroupFabric``'s (per GPU, per direction: NVLink through NVSwitch, a NIC's line
rate, the spine's share); this is what the links allow, an upper bound that a calibrated curve
(``fsdpsim calibrate comm --collectives all_to_all``) replaces. The latency is one step of NCCL's
Simple protocol as its tuner prices a ring step (``sim.costs.nccl``: ``tuning.cc`` base latency
plus the hardware latency of the link the farthest peer is reached over, and the NIC's own), since
NCCL publishes no separate point-to-point latency model.
"""

from sim.costs.nccl import BASE_LATENCY_US, HW_LATENCY_US, US
from sim.hardware.fabric import GroupFabric

SIMPLE = 2  # index of the Simple protocol in NCCL's (LL, LL128, Simple) tables


def all_to_all_latency_s(fabric: GroupFabric) -> float:
    """One Simple-protocol step to the farthest peer (``tuning.cc`` baseLat + hwLat)."""
    base = BASE_LATENCY_US["ring"][SIMPLE]
    if fabric.n_nodes > 1:
        return (base + HW_LATENCY_US["net"]["ring"][SIMPLE]) * US + fabric.nic_latency_s
    hw = "nvlink" if fabric.nvlink_bw_Bps is not None else "pci"
    return (base + HW_LATENCY_US[hw]["ring"][SIMPLE]) * US


def all_to_all_wire_s(size_bytes: int, fabric: GroupFabric) -> float:
    """Seconds the bytes take on the slower of the node's fabric and the NICs (see the module)."""
    n, r = fabric.n_ranks, fabric.ranks_per_node
    intra_bw = fabric.nvlink_bw_Bps if fabric.nvlink_bw_Bps is not None else fabric.pcie_bw_Bps
    intra_s = size_bytes * (r - 1) / n / intra_bw
    if fabric.n_nodes <= 1:
        return intra_s
    per_gpu_net_Bps = (
        fabric.nics_per_node * fabric.nic_bw_Bps * fabric.network_share / (r * fabric.nic_sharing)
    )
    return max(intra_s, size_bytes * (n - r) / n / per_gpu_net_Bps)


def all_to_all_time_s(size_bytes: int, fabric: GroupFabric) -> tuple[float, float]:
    """(time, latency) of one all-to-all of nccl-tests ``size_bytes`` on ``fabric``."""
    latency = all_to_all_latency_s(fabric)
    return latency + all_to_all_wire_s(size_bytes, fabric), latency
