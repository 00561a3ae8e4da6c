"""Hardware profiles: the built-ins load, and every malformed file is refused naming file and field."""

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.parse import profile_from_dict
from sim.hardware.registry import load_profile
from sim.hardware.schema import SCHEMA_VERSION, HardwareProfile

MiB = 1 << 20


def good_profile() -> dict[str, Any]:
    data = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    data["name"] = "test-cluster"
    data["calibrated"] = True
    data["collectives"] = [
        {
            "collective": "all_gather",
            "group_size": 8,
            "dtype": "bfloat16",
            "spans_nodes": False,
            "points": [{"bytes": 1 * MiB, "time_s": 3e-5}, {"bytes": 64 * MiB, "time_s": 2e-4}],
            "fit": {"latency_s": 2e-5, "bus_bw_Bps": 3e11},
        }
    ]
    return data


def write_json(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


def refused(tmp_path: Path, data: Any) -> str:
    path = write_json(tmp_path, data)
    with pytest.raises(UserError) as info:
        load_profile(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", list(BUILTIN_PROFILES))
def test_builtin_profiles_load(name: str) -> None:
    p = load_profile(name)
    assert isinstance(p, HardwareProfile)
    assert p.name == name and p.calibrated is False
    assert p.gpus_per_node in (2, 8) and p.device.memory_bytes > 20 * 2**30
    assert p.inter_node.bus_bw_Bps <= p.intra_node.bus_bw_Bps  # a ring leaving the node is never faster
    assert p.device.peak_flops["bf16"] > p.device.peak_flops["fp32"] > 0
    assert p.backend.name == "nccl" and p.collectives == ()


def test_builtin_h100_numbers() -> None:
    p = load_profile("h100-sxm")
    assert p.device.memory_bytes == 81559 * MiB
    assert p.device.peak_flops["bf16"] == 989.4e12
    assert (p.intra_node.latency_s, p.intra_node.bus_bw_Bps) == (15e-6, 360e9)
    assert (p.inter_node.latency_s, p.inter_node.bus_bw_Bps) == (30e-6, 360e9)  # rings over 8 NICs
    assert p.device.matmul_flops["bf16"] == 794.5e12  # ml-engineering's MAMF


def test_calibrated_file_loads(tmp_path: Path) -> None:
    p = load_profile(str(write_json(tmp_path, good_profile())))
    assert p.name == "test-cluster" and p.calibrated is True
    (curve,) = p.collectives
    assert curve.dtype == "bf16"  # canonical spelling
    assert curve.sizes_bytes == (1 * MiB, 64 * MiB) and curve.times_s == (3e-5, 2e-4)
    assert (curve.fit.latency_s, curve.fit.bus_bw_Bps) == (2e-5, 3e11)
    assert p.curve("all_gather", 8, "bf16", False) is curve
    assert p.curve("all_gather", 8, "fp32", False) is curve  # another dtype's curve is better than none
    assert p.curve("all_gather", 8, "bf16", True) is None
    assert p.curve("all_gather", 16, "bf16", False) is None
    assert p.curve("reduce_scatter", 8, "bf16", False) is None


def test_unknown_name_that_is_no_file() -> None:
    with pytest.raises(UserError, match=r"^cluster\.profile: 'tpu-v5' is neither a built-in profile \(") as e:
        load_profile("tpu-v5")
    assert all(name in str(e.value) for name in BUILTIN_PROFILES)  # it lists the allowed names


def test_corrupted_json(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(good_profile())[:-40])
    with pytest.raises(UserError, match=r"profile\.json: not a valid JSON profile \("):
        load_profile(str(path))


def test_binary_garbage(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match=r"profile\.json: not a valid JSON profile"):
        load_profile(str(path))


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a file|neither a built-in profile"):
        load_profile(str(tmp_path))


def test_not_an_object(tmp_path: Path) -> None:
    assert "profile must be a JSON object" in refused(tmp_path, [1, 2])


def test_wrong_schema_version(tmp_path: Path) -> None:
    data = good_profile() | {"schema_version": SCHEMA_VERSION + 1}
    message = refused(tmp_path, data)
    assert f"schema_version {SCHEMA_VERSION + 1} is not supported" in message


def test_schema_version_of_wrong_type(tmp_path: Path) -> None:
    message = refused(tmp_path, good_profile() | {"schema_version": "1"})
    assert "field schema_version must be int, got '1'" in message


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (("name",), "name"),
        (("device", "memory_bytes"), "device.memory_bytes"),
        (("backend", "attention_kernel"), "backend.attention_kernel"),
        (("topology", "inter_node"), "topology.inter_node"),
        (("topology", "intra_node", "bus_bw_Bps"), "topology.intra_node.bus_bw_Bps"),
        (("collectives", 0, "fit"), "collectives[0].fit"),
        (("collectives", 0, "points", 1, "time_s"), "collectives[0].points[1].time_s"),
    ],
)
def test_missing_field(tmp_path: Path, path: tuple, field: str) -> None:
    data = good_profile()
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    assert refused(tmp_path, data).endswith(f"missing field {field}")


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("calibrated",), "yes", "calibrated"),
        (("topology", "gpus_per_node"), "8", "topology.gpus_per_node"),
        (("device", "memory_bytes"), True, "device.memory_bytes"),
        (("backend", "overlaps_comm_compute"), 1, "backend.overlaps_comm_compute"),
        (("device",), [], "device"),
        (("collectives", 0, "spans_nodes"), "false", "collectives[0].spans_nodes"),
        (("collectives", 0, "points"), {"bytes": 1}, "collectives[0].points"),
    ],
)
def test_wrong_type(tmp_path: Path, path: tuple, value: Any, field: str) -> None:
    data = good_profile()
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    assert f"field {field} must be " in refused(tmp_path, data)


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (("topology", "inter_node", "bus_bw_Bps"), "topology.inter_node.bus_bw_Bps"),
        (("topology", "intra_node", "bus_bw_Bps"), "topology.intra_node.bus_bw_Bps"),
        (("collectives", 0, "fit", "bus_bw_Bps"), "collectives[0].fit.bus_bw_Bps"),
        (("device", "hbm_bandwidth_Bps"), "device.hbm_bandwidth_Bps"),
    ],
)
@pytest.mark.parametrize("value", [-1e9, 0])
def test_non_positive_bandwidth(tmp_path: Path, path: tuple, field: str, value: float) -> None:
    data = good_profile()
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    assert f"field {field} must be > 0, got {value!r}" in refused(tmp_path, data)


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (("topology", "inter_node", "latency_s"), "topology.inter_node.latency_s"),
        (("collectives", 0, "fit", "latency_s"), "collectives[0].fit.latency_s"),
    ],
)
def test_negative_latency(tmp_path: Path, path: tuple, field: str) -> None:
    data = good_profile()
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = -1e-5
    assert f"field {field} must be >= 0" in refused(tmp_path, data)


def test_zero_latency_is_allowed(tmp_path: Path) -> None:
    data = good_profile()
    data["topology"]["intra_node"]["latency_s"] = 0
    assert load_profile(str(write_json(tmp_path, data))).intra_node.latency_s == 0


def test_negative_peak_flops(tmp_path: Path) -> None:
    data = good_profile()
    data["device"]["peak_flops"]["bf16"] = -1.0
    assert "field device.peak_flops.bf16 must be a positive number" in refused(tmp_path, data)


@pytest.mark.parametrize("value", [0, 1.5, -0.2])
def test_eager_memory_efficiency_outside_zero_one(tmp_path: Path, value: float) -> None:
    data = good_profile()
    data["device"]["eager_memory_efficiency"] = value
    assert f"field device.eager_memory_efficiency must be in (0, 1], got {value}" in refused(tmp_path, data)


def test_efficiency_above_one(tmp_path: Path) -> None:
    data = good_profile()
    data["device"]["compute_efficiency"] = 1.5
    assert "field device.compute_efficiency must be in (0, 1]" in refused(tmp_path, data)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [("collective", "broadcast", "all_gather, reduce_scatter, all_reduce")],
)
def test_bad_collective_name(tmp_path: Path, key: str, value: str, allowed: str) -> None:
    data = good_profile()
    data["collectives"][0][key] = value
    assert f"field collectives[0].{key} is {value!r}; allowed: {allowed}" in refused(tmp_path, data)


def test_bad_backend_name(tmp_path: Path) -> None:
    data = good_profile()
    data["backend"]["name"] = "mpi"
    assert "field backend.name is 'mpi'; allowed: nccl, gloo" in refused(tmp_path, data)


def test_bad_curve_dtype(tmp_path: Path) -> None:
    data = good_profile()
    data["collectives"][0]["dtype"] = "int3"
    assert "collectives[0].dtype: unknown dtype 'int3'" in refused(tmp_path, data)


@pytest.mark.parametrize(
    "sizes",
    [[64 * MiB, 1 * MiB], [1 * MiB, 1 * MiB], [1 * MiB, 4 * MiB, 2 * MiB]],
    ids=["decreasing", "repeated", "unsorted"],
)
def test_non_increasing_point_sizes(tmp_path: Path, sizes: list[int]) -> None:
    data = good_profile()
    data["collectives"][0]["points"] = [{"bytes": b, "time_s": 1e-4 * (i + 1)} for i, b in enumerate(sizes)]
    assert "collectives[0].points must have strictly increasing bytes" in refused(tmp_path, data)


def test_empty_points(tmp_path: Path) -> None:
    data = good_profile()
    data["collectives"][0]["points"] = []
    assert "field collectives[0].points is empty" in refused(tmp_path, data)


def test_second_curve_is_named_by_index(tmp_path: Path) -> None:
    data = good_profile()
    bad = copy.deepcopy(data["collectives"][0]) | {"group_size": -8}
    data["collectives"].append(bad)
    assert "field collectives[1].group_size must be > 0" in refused(tmp_path, data)


def test_profile_from_dict_names_where() -> None:
    with pytest.raises(UserError, match=r"^somewhere: missing field schema_version$"):
        profile_from_dict({}, "somewhere")


def test_unknown_peak_flops_dtype_names_file_and_field(tmp_path: Path) -> None:
    data = good_profile()
    data["device"]["peak_flops"]["tf32"] = 494e12
    assert "field device.peak_flops.tf32: unknown dtype 'tf32'" in refused(tmp_path, data)
