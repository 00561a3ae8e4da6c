"""From a profile's JSON object to a ``HardwareProfile``; every error names the file and field."""

from typing import Any

from sim.dtypes import canonical_dtype
from sim.errors import UserError
from sim.hardware.compute_section import parse_compute_section
from sim.hardware.json_reader import JsonReader
from sim.hardware.schema import (
    ATTENTION_KERNELS,
    BACKENDS,
    COLLECTIVES,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    AttentionCurve,
    BackendSpec,
    CollectiveCurve,
    DeviceSpec,
    HardwareProfile,
    LinkModel,
    NcclFit,
    NodeSpec,
)


def _link(r: JsonReader) -> LinkModel:
    latency_s = r.get("latency_s", (int, float))
    if latency_s < 0:
        raise UserError(f"{r.where}: field {r.name('latency_s')} must be >= 0, got {latency_s!r}")
    return LinkModel(latency_s=latency_s, bus_bw_Bps=r.positive("bus_bw_Bps"))


def _nccl_fit(topo: JsonReader) -> NcclFit:
    if "nccl_fit" not in topo.data:
        return NcclFit()
    f = topo.sub("nccl_fit")
    return NcclFit(
        intra_bw_factor=float(f.positive("intra_bw_factor", 1.0)),
        inter_bw_factor=float(f.positive("inter_bw_factor", 1.0)),
        intra_latency_factor=float(f.positive("intra_latency_factor", 1.0)),
        inter_latency_factor=float(f.positive("inter_latency_factor", 1.0)),
        extra_latency_s=f.number("extra_latency_s", 0.0, 0.0),
        source=f.get("source", str, ""),
    )


def _dtype(value: str, where: str, name: str) -> str:
    try:
        return canonical_dtype(value)
    except UserError as e:
        raise UserError(f"{where}: {name}: {e}") from None


def _curve(raw: Any, where: str, index: int) -> CollectiveCurve:
    r = JsonReader(raw, where, f"collectives[{index}]")
    points = r.get("points", list)
    if not points:
        raise UserError(f"{where}: field collectives[{index}].points is empty")
    readers = [JsonReader(p, where, f"collectives[{index}].points[{j}]") for j, p in enumerate(points)]
    sizes = tuple(int(p.positive("bytes")) for p in readers)
    times = tuple(float(p.positive("time_s")) for p in readers)
    if list(sizes) != sorted(set(sizes)):
        raise UserError(f"{where}: collectives[{index}].points must have strictly increasing bytes")
    return CollectiveCurve(
        collective=r.choice("collective", COLLECTIVES),
        group_size=int(r.positive("group_size")),
        dtype=_dtype(r.get("dtype", str), where, f"collectives[{index}].dtype"),
        spans_nodes=r.get("spans_nodes", bool),
        sizes_bytes=sizes,
        times_s=times,
        fit=_link(r.sub("fit")),
        ranks_per_node=None
        if r.get("ranks_per_node", int, None) is None
        else int(r.positive("ranks_per_node")),
    )


def _per_dtype(dev: JsonReader, key: str, where: str, default: object = ...) -> dict[str, float]:
    """A ``{dtype: positive number}`` table, with canonical dtype names."""
    table = {}
    for dtype, value in dev.get(key, dict, default).items():
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise UserError(f"{where}: field device.{key}.{dtype} must be a positive number")
        table[_dtype(dtype, where, f"field device.{key}.{dtype}")] = float(value)
    return table


def _attention(dev: JsonReader, where: str) -> tuple[AttentionCurve, ...]:
    curves = []
    for i, raw in enumerate(dev.get("attention", list, [])):
        r = JsonReader(raw, where, f"device.attention[{i}]")
        seq = tuple(int(x) for x in r.get("seq_lens", list))
        flops = tuple(float(x) for x in r.get("fwd_bwd_flops", list))
        if not seq or len(seq) != len(flops) or list(seq) != sorted(set(seq)) or min(flops) <= 0:
            raise UserError(
                f"{where}: device.attention[{i}] needs increasing seq_lens and as many positive fwd_bwd_flops"
            )
        curves.append(
            AttentionCurve(
                kernel=r.choice("kernel", ATTENTION_KERNELS),
                head_dim=int(r.positive("head_dim")),
                causal=r.get("causal", bool),
                seq_lens=seq,
                fwd_bwd_flops=flops,
            )
        )
    return tuple(curves)


def _device(dev: JsonReader, where: str) -> DeviceSpec:
    efficiency = dev.positive("compute_efficiency", 1.0)
    if efficiency > 1:
        raise UserError(f"{where}: field device.compute_efficiency must be in (0, 1], got {efficiency}")
    hbm = dev.get("achievable_hbm_bandwidth_Bps", (int, float), None)
    eager = dev.get("eager_memory_efficiency", (int, float), None)
    if eager is not None and not 0 < eager <= 1:
        raise UserError(f"{where}: field device.eager_memory_efficiency must be in (0, 1], got {eager}")
    sms = dev.get("sm_count", int, None)
    return DeviceSpec(
        name=dev.get("name", str),
        memory_bytes=int(dev.positive("memory_bytes")),
        peak_flops=_per_dtype(dev, "peak_flops", where),
        hbm_bandwidth_Bps=dev.positive("hbm_bandwidth_Bps"),
        compute_efficiency=efficiency,
        architecture=dev.get("architecture", str, ""),
        matmul_flops=_per_dtype(dev, "matmul_flops", where, {}),
        achievable_hbm_bandwidth_Bps=None if hbm is None else dev.positive("achievable_hbm_bandwidth_Bps"),
        eager_memory_efficiency=None if eager is None else float(eager),
        sm_count=None if sms is None else int(dev.positive("sm_count")),
        kernel_launch_s=dev.number("kernel_launch_s", 0.0, 0.0),
        host_op_overhead_s=dev.number("host_op_overhead_s", 0.0, 0.0),
        overlap_slowdown=dev.number("overlap_slowdown", 1.0, 1.0),
        attention=_attention(dev, where),
        context_bytes=int(dev.number("context_bytes", 0.0, 0)),
        cublas_workspace_bytes=int(dev.number("cublas_workspace_bytes", 0.0, 0)),
    )


OPTIONAL_NODE_RATES = (
    "nvlink_bw_Bps",
    "host_to_device_Bps",
    "device_to_host_Bps",
    "pageable_host_to_device_Bps",
    "nvme_read_Bps",
    "nvme_write_Bps",
    "cpu_adam_s_per_param",
    "cpu_torch_adamw_s_per_param",
    "cpu_torch_sgd_s_per_param",
    "pageable_device_to_host_Bps",
)


def _node(r: JsonReader) -> NodeSpec:
    if "node" not in r.data:
        return NodeSpec()
    n = r.sub("node")
    optional = {k: n.get(k, (int, float), None) for k in OPTIONAL_NODE_RATES}
    for key, value in optional.items():
        if value is not None:
            n.positive(key)
    gen = n.get("pcie_gen", int, None)
    host = n.get("host_memory_bytes", int, None)
    return NodeSpec(
        nvlink_bw_Bps=optional["nvlink_bw_Bps"],
        nvswitch=n.get("nvswitch", bool, False),
        pcie_gen=None if gen is None else int(n.positive("pcie_gen")),
        pcie_lanes=int(n.positive("pcie_lanes", 16)),
        host_to_device_Bps=optional["host_to_device_Bps"],
        nics_per_node=int(n.number("nics_per_node", 0.0, 0)),
        nic_gbps=n.number("nic_gbps", 0.0, 0.0),
        host_memory_bytes=None if host is None else int(n.positive("host_memory_bytes")),
        cluster=n.get("cluster", str, None),
        device_to_host_Bps=optional["device_to_host_Bps"],
        pageable_host_to_device_Bps=optional["pageable_host_to_device_Bps"],
        nvme_read_Bps=optional["nvme_read_Bps"],
        nvme_write_Bps=optional["nvme_write_Bps"],
        cpu_adam_s_per_param=optional["cpu_adam_s_per_param"],
        cpu_torch_adamw_s_per_param=optional["cpu_torch_adamw_s_per_param"],
        cpu_torch_sgd_s_per_param=optional["cpu_torch_sgd_s_per_param"],
        pageable_device_to_host_Bps=optional["pageable_device_to_host_Bps"],
        host_is_device=n.get("host_is_device", bool, False),
    )


def _backend(be: JsonReader) -> BackendSpec:
    host = be.sub("fsdp2_unit_host_s") if "fsdp2_unit_host_s" in be.data else None
    return BackendSpec(
        fsdp_unit_host_forward_s=host.number("forward") if host else 0.0,
        fsdp_unit_host_backward_s=host.number("backward") if host else 0.0,
        name=be.choice("name", BACKENDS),
        overlaps_comm_compute=be.get("overlaps_comm_compute", bool),
        collective_temp_buffers=be.get("collective_temp_buffers", bool),
        attention_kernel=be.choice("attention_kernel", ATTENTION_KERNELS),
        collective_launch_s=float(be.get("collective_launch_s", (int, float), 0.0)),
    )


def profile_from_dict(data: Any, where: str) -> HardwareProfile:
    """Validate a profile's JSON object; every error names ``where`` and the field."""
    r = JsonReader(data, where)
    version = r.get("schema_version", int)
    if version not in READABLE_VERSIONS:
        raise UserError(
            f"{where}: schema_version {version} is not supported (this fsdp-sim reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} and writes {SCHEMA_VERSION}); recalibrate with this version"
        )
    topo = r.sub("topology")
    compute = r.get("compute", dict, None)
    return HardwareProfile(
        name=r.get("name", str),
        calibrated=r.get("calibrated", bool),
        source=r.get("source", dict, {}),
        device=_device(r.sub("device"), where),
        backend=_backend(r.sub("backend")),
        gpus_per_node=int(topo.positive("gpus_per_node")),
        intra_node=_link(topo.sub("intra_node")),
        inter_node=_link(topo.sub("inter_node")),
        nccl_fit=_nccl_fit(topo),
        collectives=tuple(_curve(c, where, i) for i, c in enumerate(r.get("collectives", list, []))),
        compute=parse_compute_section(compute, where) if compute is not None else None,
        node=_node(r),
    )
