"""Hardware profiles: what the simulator knows about a machine, as frozen dataclasses.

Built-in datasheet profiles (``sim.hardware.builtin``) and calibrated ones (written by
``calibrate``) share one versioned JSON format, read by ``sim.hardware.parse``; the simulator
reads nothing else from hardware.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sim.hardware.compute_section import ComputeSection

SCHEMA_VERSION = 2
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
BACKENDS = ("nccl", "gloo")
ATTENTION_KERNELS = ("flash", "math")


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """α–β model of a collective over one kind of link: t = latency_s + wire_bytes / bus_bw_Bps."""

    latency_s: float
    bus_bw_Bps: float


@dataclass(frozen=True, kw_only=True)
class CollectiveCurve:
    """Measured time against message size for one (collective, group size, dtype, spans-nodes).

    ``sizes_bytes`` is nccl-tests' "size": the all-gather output, the reduce-scatter input,
    the all-reduce buffer. ``times_s`` are means over the timed iterations. ``fit`` is used
    outside the measured range.
    """

    collective: str
    group_size: int
    dtype: str
    spans_nodes: bool
    sizes_bytes: tuple[int, ...]
    times_s: tuple[float, ...]
    fit: LinkModel


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]  # dtype -> dense FLOP/s
    hbm_bandwidth_Bps: float
    compute_efficiency: float  # achieved fraction of peak for matmul-bound layers


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    name: str
    overlaps_comm_compute: bool  # False for gloo: collectives block the issuing thread
    collective_temp_buffers: bool  # gloo copies the whole input/output into a temporary
    attention_kernel: str  # "flash" (no seq^2 buffers) or "math" (seq^2 scores)
    collective_launch_s: float = 0.0  # per-collective fixed host overhead on top of the link latency


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    name: str
    calibrated: bool
    device: DeviceSpec
    backend: BackendSpec
    gpus_per_node: int
    intra_node: LinkModel
    inter_node: LinkModel
    collectives: tuple[CollectiveCurve, ...] = ()
    source: Mapping[str, Any] = field(default_factory=dict)
    compute: ComputeSection | None = None  # per-unit measurements from ``calibrate compute``

    def curve(
        self, collective: str, group_size: int, dtype: str, spans_nodes: bool
    ) -> CollectiveCurve | None:
        """The measured curve for this case; a curve of another dtype is used if this one is missing."""
        same_shape = [
            c
            for c in self.collectives
            if c.collective == collective and c.group_size == group_size and c.spans_nodes == spans_nodes
        ]
        exact = [c for c in same_shape if c.dtype == dtype]
        candidates = exact or same_shape
        return candidates[0] if candidates else None

    @property
    def compute_slowdown_during_collective(self) -> float:
        """Calibrated slowdown of compute while a collective runs (1.0 without a compute section)."""
        return self.compute.compute_slowdown_during_collective if self.compute else 1.0
