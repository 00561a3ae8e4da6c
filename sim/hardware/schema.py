"""Hardware profiles: what the simulator knows about a machine, as frozen dataclasses.

Built-in datasheet profiles (``sim.hardware.builtin``) and calibrated ones (written by
``calibrate``) share one versioned JSON format, read by ``sim.hardware.parse``; the simulator
reads nothing else from hardware.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sim.hardware.compute_section import ComputeSection

SCHEMA_VERSION = 3
READABLE_VERSIONS = (2, 3)  # version 3 only adds optional fields (the GPU model's inputs, ``node``)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
BACKENDS = ("nccl", "gloo")
# "math": SDPA's math path; "eager": a model's own eager attention (matmul, fp32 softmax, cast)
ATTENTION_KERNELS = ("flash", "cudnn", "efficient", "math", "eager")


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """α–β model of a collective over one kind of link: t = latency_s + wire_bytes / bus_bw_Bps."""

    latency_s: float
    bus_bw_Bps: float


@dataclass(frozen=True, kw_only=True)
class NcclFit:
    """What a calibration fitted to measured collectives, applied inside NCCL's own cost model
    (``sim.costs.nccl``); 1.0 and 0.0 leave the model as NCCL has it. Bandwidth factors multiply
    the per-channel bandwidths inside and between nodes, latency factors the per-step hardware
    latencies; ``extra_latency_s`` is added to every collective. ``source`` says what was fitted
    to what (measurements, group shapes, residuals)."""

    intra_bw_factor: float = 1.0
    inter_bw_factor: float = 1.0
    intra_latency_factor: float = 1.0
    inter_latency_factor: float = 1.0
    extra_latency_s: float = 0.0
    source: str = field(default="", compare=False)


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
    ranks_per_node: int | None = None  # the group's ranks on each of its nodes, where recorded


@dataclass(frozen=True, kw_only=True)
class AttentionCurve:
    """Published throughput of one attention kernel: forward+backward FLOP/s by sequence length,
    FLOPs counted as the FlashAttention benchmarks count them (forward 4·b·s²·h·d, halved when
    causal; backward 2.5 × forward)."""

    kernel: str  # "flash", "cudnn", "efficient", "math"
    head_dim: int
    causal: bool
    seq_lens: tuple[int, ...]
    fwd_bwd_flops: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]  # dtype -> dense FLOP/s (datasheet; calibrated: measured)
    hbm_bandwidth_Bps: float
    compute_efficiency: float = 1.0  # version 2: achieved fraction of peak for matmul-bound layers
    # -- the GPU compute model's inputs (sim.costs.gpu), each from a kernel-level measurement --
    architecture: str = ""  # "sm80", "sm90", "sm100", "sm86", "sm89", "gfx942", "cpu"
    matmul_flops: Mapping[str, float] = field(default_factory=dict)  # max achievable (MAMF) per dtype
    achievable_hbm_bandwidth_Bps: float | None = None  # streaming read+write rate
    # the fraction of that rate eager ATen elementwise/reduction kernels reach on the bytes the
    # tracer counts (validation.eager_bandwidth); None: not measured on this part
    eager_memory_efficiency: float | None = None
    sm_count: int | None = None
    kernel_launch_s: float = 0.0  # back-to-back kernels: the device's floor per kernel
    host_op_overhead_s: float = 0.0  # eager PyTorch: host time to issue one op
    overlap_slowdown: float = 1.0  # compute slowdown while a collective overlaps it
    attention: tuple[AttentionCurve, ...] = ()
    context_bytes: int = 0  # CUDA context and kernels, outside the caching allocator
    cublas_workspace_bytes: int = 0  # per (handle, stream), through the caching allocator


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """What one server holds besides its GPUs: the links the network model and offload use."""

    nvlink_bw_Bps: float | None = None  # per GPU, per direction; None: no NVLink
    nvswitch: bool = False
    pcie_gen: int | None = None
    pcie_lanes: int = 16
    host_to_device_Bps: float | None = None  # measured pinned copy rate
    nics_per_node: int = 0
    nic_gbps: float = 0.0
    host_memory_bytes: int | None = None
    cluster: str | None = None  # the built-in cluster (sim/hardware/clusters) these nodes come from
    # -- the host side offload uses (``fsdpsim calibrate host`` measures what a machine allows) --
    device_to_host_Bps: float | None = None  # measured pinned copy rate
    pageable_host_to_device_Bps: float | None = None  # from pageable (not pinned) host memory
    nvme_read_Bps: float | None = None  # per node, what ZeRO-Infinity swaps in at
    nvme_write_Bps: float | None = None
    # the optimizer on the host, seconds per parameter element for one rank (its share of the cores)
    cpu_adam_s_per_param: float | None = None  # DeepSpeed's CPU Adam (ZeRO-Offload)
    cpu_torch_adamw_s_per_param: float | None = None  # torch.optim.AdamW on CPU tensors (FSDP1 CPUOffload)
    cpu_torch_sgd_s_per_param: float | None = None  # torch.optim.SGD with momentum on CPU tensors
    pageable_device_to_host_Bps: float | None = None  # into pageable (not pinned) host memory
    # the device is the host (a CPU machine): ``Tensor.to`` between them returns the tensor itself,
    # so FSDP2's CPUOffloadPolicy moves nothing and keeps everything in the one memory
    host_is_device: bool = False

    def pcie_Bps(self) -> float | None:
        """The datasheet rate of the GPU's host link, per direction: PCIe 3.0/4.0/5.0 move 0.985 /
        1.969 / 3.938 GB/s per lane after 128b/130b encoding (PCI-SIG base specifications)."""
        per_lane = {3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
        return None if self.pcie_gen not in per_lane else per_lane[self.pcie_gen] * self.pcie_lanes

    def h2d_Bps(self) -> float | None:
        """Pinned host-to-device: measured where known, else the PCIe datasheet rate."""
        return self.host_to_device_Bps or self.pcie_Bps()

    def d2h_Bps(self) -> float | None:
        return self.device_to_host_Bps or self.host_to_device_Bps or self.pcie_Bps()


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    name: str
    overlaps_comm_compute: bool  # False for gloo: collectives block the issuing thread
    collective_temp_buffers: bool  # gloo copies the whole input/output into a temporary
    attention_kernel: str  # "flash" (no seq^2 buffers), "math" or "eager" (seq^2 scores)
    collective_launch_s: float = 0.0  # per-collective fixed host overhead on top of the link latency
    # FSDP2's host work per unit and pass (hooks, DTensor bookkeeping) on a GPU host, where it runs
    # ahead of the device on the host stream; a calibrated CPU profile measures it in ``compute``
    fsdp_unit_host_forward_s: float = 0.0
    fsdp_unit_host_backward_s: float = 0.0


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
    node: NodeSpec = field(default_factory=NodeSpec)
    nccl_fit: NcclFit = field(default_factory=NcclFit)  # topology.nccl_fit, from calibration

    @property
    def host_is_device(self) -> bool:
        """The device is the host's CPU: the profile says so (``calibrate host`` on a machine
        without an accelerator), or its backend is gloo, which fsdp-sim calibrates on CPUs only."""
        return self.node.host_is_device or self.backend.name == "gloo"

    def curve(
        self,
        collective: str,
        group_size: int,
        dtype: str,
        spans_nodes: bool,
        ranks_per_node: int | None = None,
    ) -> CollectiveCurve | None:
        """The measured curve for this case; a curve of another dtype is used if this one is missing.
        With ``ranks_per_node``, a curve that records another layout of the group does not match."""
        same_shape = [
            c
            for c in self.collectives
            if c.collective == collective
            and c.group_size == group_size
            and c.spans_nodes == spans_nodes
            and (ranks_per_node is None or c.ranks_per_node in (None, ranks_per_node))
        ]
        exact = [c for c in same_shape if c.dtype == dtype]
        candidates = exact or same_shape
        return candidates[0] if candidates else None

    @property
    def attention_kernel(self) -> str:
        """The attention kernel ops are costed with: the one the compute calibration saw the
        scenario's own attention call run (T5's float position-bias mask: a CPU's math path),
        else the backend's."""
        measured = self.compute.attention_kernel if self.compute is not None else None
        return measured or self.backend.attention_kernel

    @property
    def compute_slowdown_during_collective(self) -> float:
        """Slowdown of compute while a collective runs: calibrated where the profile has a compute
        section, else the device's published figure (1.0 without one)."""
        return (
            self.compute.compute_slowdown_during_collective if self.compute else self.device.overlap_slowdown
        )
