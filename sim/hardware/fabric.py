"""What one process group's collectives see of the cluster: the shape of the group and the links
it can use. Derived from the cluster graph (``sim.hardware.cluster``); read by NCCL's cost model
(``sim.costs.nccl``), which turns it into channels, algorithms, protocols and a time.

Bandwidths are bytes per second in one direction; latencies seconds.
"""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GroupFabric:
    n_ranks: int
    n_nodes: int  # nodes the group spans
    ranks_per_node: int  # the group's GPUs on each of its nodes (uniform: FSDP's groups are)
    arch: str  # GPU architecture, as NCCL's tuner tables distinguish them: "sm80", "sm90", "sm100", ...
    # inside a node
    nvlink_bw_Bps: float | None  # per GPU, per direction, through NVSwitch or direct links; None: PCIe only
    nvswitch: bool  # an NVSwitch domain (NVLS needs one, on sm90 and newer)
    nvlink_domain: int  # GPUs in one NVLink domain (8 on HGX, 72 on GB200 NVL72)
    pcie_bw_Bps: float  # the GPU's PCIe link (GPU <-> host, and GPU <-> NIC)
    # across nodes
    nics_per_node: int  # NICs the group's ranks of one node can drive
    nic_bw_Bps: float  # one NIC, per direction
    # fraction of NIC bandwidth the fabric above the NICs delivers (spine oversubscription)
    network_share: float = 1.0
    nic_latency_s: float = 0.0  # the NIC's own latency NCCL adds per network step (graph latencyInter)
    host_cpu: str = "intel"  # "intel" or "amd": NCCL's LL caps and network overheads depend on it
    collnet: bool = False  # switches that reduce in the network (SHARP): NCCL's CollNet algorithms
    # groups of this group's kind whose collectives use each of its NICs at the same time (the
    # schedule issues the same collective on every group of a kind): 1 unless GPUs of different
    # groups share a NIC, as two HSDP replicate groups do on a node with a NIC per two GPUs
    nic_sharing: int = 1
