"""Hardware profiles: what the simulator knows about a machine, read from one versioned JSON format.

Built-in datasheet profiles (``sim.builtin_profiles``) and calibrated ones (written by
``calibrate``) share this format and this loader; the simulator reads nothing else from hardware.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.dtypes import canonical_dtype
from sim.errors import UserError

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
    the all-reduce buffer. ``times_s`` are means over the timed iterations. ``fit`` is used outside the measured range.
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
    compute: Mapping[str, Any] | None = None  # per-unit measurements from ``calibrate compute``

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


class _Reader:
    """Typed access to a JSON object that names the file and field in every error."""

    def __init__(self, data: Any, where: str, path: str = ""):
        if not isinstance(data, dict):
            raise UserError(f"{where}: {path or 'profile'} must be a JSON object")
        self.data, self.where, self.path = data, where, path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise UserError(f"{self.where}: missing field {self._name(key)}")
            return default
        value = self.data[key]
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _as_tuple(kind))
        if not ok:
            names = "/".join(t.__name__ for t in _as_tuple(kind))
            raise UserError(f"{self.where}: field {self._name(key)} must be {names}, got {value!r}")
        return value

    def positive(self, key: str, default: Any = ...) -> float:
        value = self.get(key, (int, float), default)
        if value is not None and value <= 0:
            raise UserError(f"{self.where}: field {self._name(key)} must be > 0, got {value!r}")
        return value

    def choice(self, key: str, allowed: tuple[str, ...], default: Any = ...) -> str:
        value = self.get(key, str, default)
        if value not in allowed:
            raise UserError(
                f"{self.where}: field {self._name(key)} is {value!r}; allowed: {', '.join(allowed)}"
            )
        return value

    def sub(self, key: str) -> "_Reader":
        return _Reader(self.get(key, dict), self.where, self._name(key))


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _link(r: _Reader) -> LinkModel:
    latency_s = r.get("latency_s", (int, float))
    if latency_s < 0:
        raise UserError(f"{r.where}: field {r._name('latency_s')} must be >= 0, got {latency_s!r}")
    return LinkModel(latency_s=latency_s, bus_bw_Bps=r.positive("bus_bw_Bps"))


def _curve(raw: Any, where: str, index: int) -> CollectiveCurve:
    r = _Reader(raw, where, f"collectives[{index}]")
    points = r.get("points", list)
    if not points:
        raise UserError(f"{where}: field collectives[{index}].points is empty")
    readers = [_Reader(p, where, f"collectives[{index}].points[{j}]") for j, p in enumerate(points)]
    sizes = tuple(int(p.positive("bytes")) for p in readers)
    times = tuple(float(p.positive("time_s")) for p in readers)
    if list(sizes) != sorted(set(sizes)):
        raise UserError(f"{where}: collectives[{index}].points must have strictly increasing bytes")
    try:
        dtype = canonical_dtype(r.get("dtype", str))
    except UserError as e:
        raise UserError(f"{where}: collectives[{index}].dtype: {e}") from None
    return CollectiveCurve(
        collective=r.choice("collective", COLLECTIVES),
        group_size=int(r.positive("group_size")),
        dtype=dtype,
        spans_nodes=r.get("spans_nodes", bool),
        sizes_bytes=sizes,
        times_s=times,
        fit=_link(r.sub("fit")),
    )


def _compute_section(compute: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    from sim.compute_profile import validate_compute_section

    if compute is not None:
        validate_compute_section(compute, where)
    return compute


def profile_from_dict(data: Any, where: str) -> HardwareProfile:
    """Validate a profile's JSON object; every error names ``where`` and the field."""
    r = _Reader(data, where)
    version = r.get("schema_version", int)
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{where}: schema_version {version} is not supported (this fsdp-sim reads version {SCHEMA_VERSION}); "
            "recalibrate with this version"
        )
    dev, be, topo = r.sub("device"), r.sub("backend"), r.sub("topology")
    flops = dev.get("peak_flops", dict)
    peak = {}
    for dtype, value in flops.items():
        if not isinstance(value, int | float) or value <= 0:
            raise UserError(f"{where}: field device.peak_flops.{dtype} must be a positive number")
        try:
            peak[canonical_dtype(dtype)] = float(value)
        except UserError as e:
            raise UserError(f"{where}: field device.peak_flops.{dtype}: {e}") from None
    efficiency = dev.positive("compute_efficiency")
    if efficiency > 1:
        raise UserError(f"{where}: field device.compute_efficiency must be in (0, 1], got {efficiency}")
    return HardwareProfile(
        name=r.get("name", str),
        calibrated=r.get("calibrated", bool),
        source=r.get("source", dict, {}),
        device=DeviceSpec(
            name=dev.get("name", str),
            memory_bytes=int(dev.positive("memory_bytes")),
            peak_flops=peak,
            hbm_bandwidth_Bps=dev.positive("hbm_bandwidth_Bps"),
            compute_efficiency=efficiency,
        ),
        backend=BackendSpec(
            name=be.choice("name", BACKENDS),
            overlaps_comm_compute=be.get("overlaps_comm_compute", bool),
            collective_temp_buffers=be.get("collective_temp_buffers", bool),
            attention_kernel=be.choice("attention_kernel", ATTENTION_KERNELS),
            collective_launch_s=float(be.get("collective_launch_s", (int, float), 0.0)),
        ),
        gpus_per_node=int(topo.positive("gpus_per_node")),
        intra_node=_link(topo.sub("intra_node")),
        inter_node=_link(topo.sub("inter_node")),
        collectives=tuple(_curve(c, where, i) for i, c in enumerate(r.get("collectives", list, []))),
        compute=_compute_section(r.get("compute", dict, None), where),
    )


def load_profile(name_or_path: str, where: str = "cluster.profile") -> HardwareProfile:
    """A built-in profile by name, or a JSON profile file by path."""
    from sim.builtin_profiles import BUILTIN_PROFILES

    if name_or_path in BUILTIN_PROFILES:
        return profile_from_dict(BUILTIN_PROFILES[name_or_path], f"built-in profile {name_or_path}")
    path = Path(name_or_path)
    if not path.is_file():
        raise UserError(
            f"{where}: {name_or_path!r} is neither a built-in profile ({', '.join(BUILTIN_PROFILES)}) nor an existing file"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a valid JSON profile ({e})") from None
    return profile_from_dict(data, str(path))
