"""Shared builders for simulator tests: scenarios from dicts and profiles with chosen numbers."""

import copy
from typing import Any

from sim.builtin_profiles import BUILTIN_PROFILES
from sim.profile import HardwareProfile, profile_from_dict
from sim.scenario import Scenario, scenario_from_dict


def make_scenario(**sections: dict[str, Any]) -> Scenario:
    """A scenario of the tiny preset on 2 ranks, with ``sections`` merged over it."""
    data: dict[str, dict[str, Any]] = {
        "model": {"preset": "tiny"},
        "training": {"micro_batch": 2, "seq_len": 64},
        "parallel": {"world_size": 2, "strategy": "FULL_SHARD", "wrap": "block"},
        "precision": {"param_dtype": "fp32"},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return scenario_from_dict(data, "test-scenario")


def make_profile(
    *,
    overlap: bool = True,
    temp_buffers: bool = False,
    bus_bw_Bps: float | None = None,
    latency_s: float | None = None,
    launch_s: float | None = None,
) -> HardwareProfile:
    """The h100-sxm datasheet profile with the backend and link numbers a test needs."""
    data = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    data["backend"]["overlaps_comm_compute"] = overlap
    data["backend"]["collective_temp_buffers"] = temp_buffers
    for link in ("intra_node", "inter_node"):
        if bus_bw_Bps is not None:
            data["topology"][link]["bus_bw_Bps"] = bus_bw_Bps
        if latency_s is not None:
            data["topology"][link]["latency_s"] = latency_s
    if launch_s is not None:
        data["backend"]["collective_launch_s"] = launch_s
    return profile_from_dict(data, "test-profile")
