"""One collective's time as NCCL's own tuner estimates it, on the fabric one process group sees.

NCCL (NVIDIA/nccl@5067397, the revision every constant here is read from) picks, for each
collective and size, the algorithm and protocol whose modelled time is least. Its model has two
halves, both reproduced here:

- **The topology search** (``src/graph/search.cc`` ``ncclTopoCompute``) finds *channels* (rings or
  trees laid over the GPUs, entering and leaving a node through a NIC) and a per-channel bandwidth
  ``bw``, trying the speeds of a per-architecture table from the fastest down and keeping the
  largest ``nChannels × bw`` the links allow; ``ncclTopoDupChannels`` then doubles the channels at
  half the speed. ``ring_graph`` and ``nvls_graph`` (``sim.costs.nccl_graph``) redo that search
  on the ``GroupFabric``: each channel takes ``bw`` of every GPU's NVLink (NVLS: the head twice),
  and ``bw`` of the NIC it crosses (NIC and its PCIe link, whichever is slower).
- **The cost model** (``src/graph/tuning.cc`` ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``):
  per (algorithm, protocol) a bus bandwidth from the channels, capped and scaled by protocol
  (LL moves half its bytes as flags, LL128 120 of 128), converted to algorithm bandwidth, and a
  latency of a base plus one hardware latency per step of the pattern: a ring pays
  ``nRanks - 1`` steps (all-reduce twice), of which ``nNodes - 1`` cross the network, a tree
  ``log2(nNodes)`` network hops. time = latency + bytes / algorithm bandwidth.

Links are in NCCL's own units (``src/graph/topo.h``, ``topo.cc``): NVLink as links × a
per-architecture rate (20 GB/s on sm80, 20.6 on sm90, 40.1 on sm100), PCIe Gen3/4/5 x16 as
12/24/48 GB/s (lanes × GT/s / 80), a NIC as its line rate / 8. ``NcclFit`` carries what a
calibration fitted (``calibrate.topology_fit``): factors on the per-channel bandwidths and
latencies, so that measurements on a few nodes extrapolate through the same model.

What is not modelled: CollNet needs SHARP switches (``GroupFabric.collnet``, off by default as in
NCCL); PAT only runs with one GPU per node (as NCCL enables it); tuner plugins and NCCL_ALGO /
NCCL_PROTO overrides; the medium-size dip real rings show below ~64 MB (NCCL's model does not have
it either).
"""

import math
from dataclasses import dataclass

from sim.costs.nccl_graph import GB, MAX_RING_CHANNELS, cc_row, nvls_graph, ring_graph, sm_number
from sim.hardware.fabric import GroupFabric
from sim.hardware.schema import NcclFit

US = 1e-6  # NCCL's latencies are in microseconds (its bandwidths in GB/s: nccl_graph.GB)

ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOCOLS = ("LL", "LL128", "Simple")

# tuning.cc ncclTunerConstantsDefaults.baseLatencies [algorithm][protocol], microseconds
BASE_LATENCY_US = {
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "collnet_direct": (0.0, 0.0, 0.0),
    "collnet_chain": (0.0, 0.0, 0.0),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
    "pat": (8.0, 8.0, 8.0),
}
# tuning.cc hwLatencies [hardware][algorithm][protocol], microseconds per step
HW_LATENCY_US = {
    "nvlink": {
        "tree": (0.6, 1.25, 4.0),
        "ring": (0.6, 1.9, 3.4),
        "collnet_direct": (0.0, 0.0, 3.7),
        "collnet_chain": (0.0, 0.0, 2.8),
        "nvls": (0.0, 0.0, 25.0),
        "nvls_tree": (0.0, 0.0, 25.0),
        "pat": (0.0, 0.0, 4.0),
    },
    "pci": {
        "tree": (1.0, 1.9, 4.0),
        "ring": (1.0, 2.5, 5.7),
        "collnet_direct": (0.0, 0.0, 3.7),
        "collnet_chain": (0.0, 0.0, 2.8),
        "nvls": (0.0, 0.0, 0.0),
        "nvls_tree": (0.0, 0.0, 0.0),
        "pat": (0.0, 0.0, 4.0),
    },
    "net": {
        "tree": (5.0, 8.5, 14.0),
        "ring": (2.7, 4.0, 14.0),
        "collnet_direct": (0.0, 0.0, 31.0),
        "collnet_chain": (0.0, 0.0, 30.0),
        "nvls": (0.0, 0.0, 18.0),
        "nvls_tree": (0.0, 0.0, 20.9),
        "pat": (0.0, 0.0, 14.0),
    },
}
# tuning.cc llMaxBws: rows Volta/Ampere/Hopper/Blackwell for one node (by GPU), and for several
# nodes Intel (row 0) or AMD (row 1) hosts; columns 1 node, 2 nodes, more
LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
# per-channel caps, rows Volta/Ampere/Hopper/Blackwell, columns 1 node, 2 nodes, more
PER_CH_MAX_RING_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7), (40.0, 40.0, 40.0))
PER_CH_MAX_TREE_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
PER_CH_MAX_TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
PER_CH_MAX_NVLS_TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)  # tuning.cc nvlsEfficiency, by compute-capability row
# tuning.cc treeCorrectionFactor [protocol][log2(bytes / 64)], all-reduce trees of medium sizes
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5, 0.4, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8, 0.9, 0.9, 0.9, 0.9, 1.0, 1.0, 1.0),
    (0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.7, 0.7, 0.8, 0.9, 0.9, 0.9),
)  # fmt: skip
# thread counts and per-thread thresholds (device.h, comm.h) for the channels a size uses
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}
# tuning.cc getNetOverhead: microseconds of proxy work per network step, by host CPU
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}


NO_FIT = NcclFit()


@dataclass(frozen=True, kw_only=True)
class NcclChoice:
    """The algorithm and protocol NCCL picks, the channels the size uses, and the modelled time."""

    time_s: float
    algorithm: str
    protocol: str
    channels: int
    bus_bw_Bps: float  # the algorithm's bus bandwidth (what nccl-tests reports for large sizes)
    latency_s: float

    @property
    def wire_fraction(self) -> float:
        """Share of the time spent moving bytes (the rest is latency, which contends for nothing)."""
        return 0.0 if self.time_s <= 0 else max(0.0, 1.0 - self.latency_s / self.time_s)


def _columns(fabric: GroupFabric) -> tuple[int, int, int]:
    """(compute-capability row, LL row, node column) of the tables."""
    row = cc_row(fabric.arch)
    ll_row = row if fabric.n_nodes == 1 else (1 if fabric.host_cpu == "amd" else 0)
    return row, ll_row, min(fabric.n_nodes, 3) - 1


def _steps(collective: str, n_ranks: int) -> int:
    return 2 * (n_ranks - 1) if collective == "all_reduce" else n_ranks - 1


def _enabled(collective: str, algorithm: str, protocol: str, fabric: GroupFabric) -> bool:
    """Which pairs NCCL considers (tuning.cc and enqueue.cc's updateCollCostTable): all-gather and
    reduce-scatter run as ring, PAT (one GPU per node), NVLS (inside one node) or CollNet; NVLS
    and NVLS-tree only with Simple; LL128 on NVLink (or without intra-node links) and sm80+."""
    if collective in ("all_gather", "reduce_scatter"):
        if algorithm not in ("ring", "pat", "nvls", "collnet_direct"):
            return False
        if algorithm == "pat" and (protocol != "Simple" or fabric.n_nodes != fabric.n_ranks):
            return False
        if algorithm == "nvls" and fabric.n_nodes > 1:
            return False  # needs CollNet's network offload across nodes
    elif algorithm == "pat":
        return False
    if algorithm in ("nvls", "nvls_tree", "collnet_direct", "collnet_chain") and protocol != "Simple":
        return False
    if algorithm.startswith("collnet") and not (fabric.collnet and fabric.n_nodes > 1):
        return False
    if algorithm == "nvls_tree" and fabric.n_nodes == 1:
        return False
    if algorithm == "nvls" and fabric.n_nodes > 1 and not fabric.collnet:
        return False
    if protocol == "LL128":
        on_nvlink = fabric.nvlink_bw_Bps is not None or fabric.ranks_per_node == 1
        return on_nvlink and sm_number(fabric.arch) >= 70
    return True


def _bus_bw(collective: str, algorithm: str, protocol: str, fabric: GroupFabric, fit: NcclFit) -> float:
    """tuning.cc's per-(algorithm, protocol) bandwidth in GB/s, before the algorithm-bandwidth
    conversion; 0 where the algorithm cannot run."""
    row, ll_row, col = _columns(fabric)
    multi = fabric.n_nodes > 1
    # a calibration's factors: on the graph found inside a node, or on the one across nodes
    factor = fit.inter_bw_factor if multi else fit.intra_bw_factor
    if algorithm in ("nvls", "nvls_tree"):
        nvls = nvls_graph(fabric)
        if nvls is None or nvls.n_channels < 2:
            return 0.0
        intra = nvls.bw_intra * NVLS_EFFICIENCY[row] * (nvls.n_channels - 1) / nvls.n_channels
        ppn = fabric.ranks_per_node
        intra *= 2.0 if collective == "all_reduce" else (ppn - 1) / ppn
        inter = nvls.bw_inter * (2 if fabric.n_nodes <= 2 and algorithm == "nvls_tree" else 1)
        bw = min(intra, inter) * factor
        if algorithm == "nvls_tree":
            bw = min(bw, PER_CH_MAX_NVLS_TREE_BW[row][col])
        return nvls.n_channels * bw
    graph = ring_graph(fabric)
    per_channel = graph.bw_intra if fabric.n_nodes <= 2 else graph.bw_inter
    bus = graph.n_channels * per_channel * factor
    n = graph.n_channels
    if algorithm == "ring" and protocol == "LL":
        bus = min(LL_MAX_BW[ll_row][col], bus * 0.5)
    if algorithm == "ring" and protocol == "LL128":
        bus = min(bus * 0.92, n * PER_CH_MAX_RING_LL128_BW[row][col])
    if algorithm == "tree":
        if collective == "all_reduce":
            bus = min(bus * 0.92, n * PER_CH_MAX_TREE_BW[row][col])
        if protocol == "LL":
            bus = min(bus / 3.8, LL_MAX_BW[ll_row][col])
        if protocol == "LL128":
            bus = min(
                bus * (7.0 / 9.0 if not multi else 120.0 / 128.0), n * PER_CH_MAX_TREE_LL128_BW[row][col]
            )
        if sm_number(fabric.arch) >= 90 and multi:
            bus *= 0.85  # sm90's search falls back to the simpler TREE pattern (search.cc)
    if algorithm == "pat":
        bus *= 0.75
    if algorithm == "collnet_direct":
        if collective in ("all_gather", "reduce_scatter"):
            return fabric.ranks_per_node * min(graph.bw_intra, graph.bw_inter * 0.9)
        factor = fabric.ranks_per_node / n
        bus /= factor - (factor - 1) / 2
        if sm_number(fabric.arch) >= 90:
            bus *= 0.85
    return bus


def _algorithm_bw(collective: str, algorithm: str, bus_gbps: float, n_ranks: int) -> float:
    """tuning.cc's conversion to algorithm bandwidth (bytes of the collective's size per µs×1e3)."""
    if algorithm != "ring" and collective in ("all_gather", "reduce_scatter"):
        return bus_gbps
    if algorithm in ("ring", "nvls", "nvls_tree"):
        return bus_gbps * n_ranks / _steps(collective, n_ranks)
    return bus_gbps * 0.5


def _latency_us(collective: str, algorithm: str, protocol: str, fabric: GroupFabric, fit: NcclFit) -> float:
    """tuning.cc's latency: a base per (algorithm, protocol) plus the pattern's hardware steps."""
    p = PROTOCOLS.index(protocol)
    n, nodes, ppn = fabric.n_ranks, fabric.n_nodes, fabric.ranks_per_node
    intra_hw = "nvlink" if fabric.nvlink_bw_Bps is not None else "pci"
    intra = HW_LATENCY_US[intra_hw][algorithm][p] * fit.intra_latency_factor
    net_algorithm = "tree" if ppn == 1 else algorithm  # with one GPU per node latencies are exposed
    inter = (HW_LATENCY_US["net"][net_algorithm][p] + fabric.nic_latency_s / US) * fit.inter_latency_factor
    if protocol == "Simple":
        inter += fabric.nic_latency_s / US  # the flush
    base = BASE_LATENCY_US[algorithm][p]
    log_nodes = int(math.log2(nodes))
    if algorithm == "ring":
        overhead = NET_OVERHEAD_US[fabric.host_cpu] * (3 if protocol == "Simple" else 1) if nodes > 1 else 0.0
        intra = max(intra, overhead)
        steps = _steps(collective, n)
        inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if collective == "all_reduce" else nodes - 1)
        return base + (steps - inter_steps) * intra + inter_steps * inter
    if algorithm == "tree":
        return base + 2 * ((ppn - 1) * intra + log_nodes * inter) if collective == "all_reduce" else math.inf
    if algorithm == "collnet_direct":
        return base + 2 * (min(1, ppn - 1) * intra + (ppn - 1) * 0.4) + inter
    if algorithm == "collnet_chain":
        return base + 2 * (ppn - 1) * intra + inter
    if algorithm == "nvls":
        return intra + (inter if nodes > 1 else 0.0)
    if algorithm == "nvls_tree":
        return base + intra + 2 * log_nodes * inter
    # PAT (all-gather, reduce-scatter): logarithmic in nodes, and still a linear part per rank
    return base + log_nodes * (inter / 3.5) + n * 2.8


def _time_us(
    collective: str, algorithm: str, protocol: str, size_bytes: int, fabric: GroupFabric, fit: NcclFit
) -> tuple[float, float, float]:
    """(time, latency, bus bandwidth) in µs, µs and GB/s, as ncclTopoGetAlgoTime; time is inf where
    the pair does not run."""
    if not _enabled(collective, algorithm, protocol, fabric):
        return math.inf, math.inf, 0.0
    bus = _bus_bw(collective, algorithm, protocol, fabric, fit)
    if bus <= 0:
        return math.inf, math.inf, 0.0
    bw = _algorithm_bw(collective, algorithm, bus, fabric.n_ranks)
    latency = _latency_us(collective, algorithm, protocol, fabric, fit)
    log_size = int(math.log2(size_bytes >> 6)) if size_bytes >> 6 else -1
    if algorithm == "tree" and collective == "all_reduce" and 0 <= log_size < 23:
        bw *= TREE_CORRECTION[PROTOCOLS.index(protocol)][log_size]
    channels = ring_graph(fabric).n_channels
    if (
        algorithm == "ring"
        and protocol == "Simple"
        and fabric.n_nodes > 1
        and collective == "all_reduce"
        and size_bytes / (channels * fabric.n_ranks) >= 64
    ):
        latency *= 1.9 if sm_number(fabric.arch) < 80 else 1.4  # the ring's plateau (tuning.cc)
    return latency + size_bytes / (1e3 * bw), latency, bus


def runtime_channels(fabric: GroupFabric) -> int:
    """The channels (CTAs) a communicator runs, each with its own connections and buffers:
    connect.cc ``ncclTopoPostset`` doubles the searched ring channels, and on sm90+ across nodes
    doubles them again while the searched speed is above 45 GB/s and they are fewer than 16."""
    graph = ring_graph(fabric)
    channels = min(2 * MAX_RING_CHANNELS, 2 * graph.n_channels)
    if sm_number(fabric.arch) >= 90 and fabric.n_nodes > 1 and graph.bw_intra > 45.0 and channels < 16:
        channels *= 2
    return channels


def _channels_used(algorithm: str, protocol: str, size_bytes: int, fabric: GroupFabric) -> int:
    """enqueue.cc topoGetAlgoInfo: NVLS uses its own channels; rings and trees drop channels while
    the size is under channels × threads × the per-thread threshold."""
    if algorithm in ("nvls", "nvls_tree"):
        graph = nvls_graph(fabric)
        return graph.n_channels if graph else 1
    channels = runtime_channels(fabric)
    threads, threshold = MAX_THREADS[protocol], THREAD_THRESHOLD[protocol]
    if algorithm == "ring" and protocol == "LL":
        threshold *= fabric.n_ranks
    while channels > 1 and size_bytes < channels * threads * threshold:
        channels -= 1
    return channels


def nccl_choice(collective: str, size_bytes: int, fabric: GroupFabric, fit: NcclFit = NO_FIT) -> NcclChoice:
    """The (algorithm, protocol) of least modelled time for nccl-tests ``size_bytes`` (all-gather
    output, reduce-scatter input, all-reduce buffer), as NCCL picks it; its time includes
    ``fit.extra_latency_s``."""
    if fabric.n_ranks <= 1 or size_bytes <= 0:
        return NcclChoice(
            time_s=0.0, algorithm="ring", protocol="Simple", channels=0, bus_bw_Bps=0.0, latency_s=0.0
        )
    best = min(
        (_time_us(collective, a, p, size_bytes, fabric, fit), a, p) for a in ALGORITHMS for p in PROTOCOLS
    )
    (time_us, latency_us, bus), algorithm, protocol = best
    if math.isinf(time_us):
        raise ValueError(f"no NCCL algorithm runs {collective} on {fabric}")
    extra = fit.extra_latency_s
    return NcclChoice(
        time_s=time_us * US + extra,
        algorithm=algorithm,
        protocol=protocol,
        channels=_channels_used(algorithm, protocol, size_bytes, fabric),
        bus_bw_Bps=bus * GB,
        latency_s=latency_us * US + extra,
    )
