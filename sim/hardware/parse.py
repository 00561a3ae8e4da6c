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
    SCHEMA_VERSION,
    BackendSpec,
    CollectiveCurve,
    DeviceSpec,
    HardwareProfile,
    LinkModel,
)


def _link(r: JsonReader) -> LinkModel:
    latency_s = r.get("latency_s", (int, float))
    if latency_s < 0:
        raise UserError(f"{r.where}: field {r.name('latency_s')} must be >= 0, got {latency_s!r}")
    return LinkModel(latency_s=latency_s, bus_bw_Bps=r.positive("bus_bw_Bps"))


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
    )


def _device(dev: JsonReader, where: str) -> DeviceSpec:
    peak = {}
    for dtype, value in dev.get("peak_flops", dict).items():
        if not isinstance(value, int | float) or value <= 0:
            raise UserError(f"{where}: field device.peak_flops.{dtype} must be a positive number")
        peak[_dtype(dtype, where, f"field device.peak_flops.{dtype}")] = float(value)
    efficiency = dev.positive("compute_efficiency")
    if efficiency > 1:
        raise UserError(f"{where}: field device.compute_efficiency must be in (0, 1], got {efficiency}")
    return DeviceSpec(
        name=dev.get("name", str),
        memory_bytes=int(dev.positive("memory_bytes")),
        peak_flops=peak,
        hbm_bandwidth_Bps=dev.positive("hbm_bandwidth_Bps"),
        compute_efficiency=efficiency,
    )


def _backend(be: JsonReader) -> BackendSpec:
    return BackendSpec(
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
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{where}: schema_version {version} is not supported (this fsdp-sim reads version {SCHEMA_VERSION}); "
            "recalibrate with this version"
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
        collectives=tuple(_curve(c, where, i) for i, c in enumerate(r.get("collectives", list, []))),
        compute=parse_compute_section(compute, where) if compute is not None else None,
    )
