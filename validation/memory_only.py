"""``fsdpsim validate --memory-only``: real FSDP2 peak memory of one rank at any world size
(fake process group, FakeTensorMode, FSDPMemTracker) beside the simulator's prediction."""

import dataclasses
from typing import Any

from sim.hardware.registry import load_profile
from sim.hardware.schema import HardwareProfile
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from sim.simulate import simulate
from validation.compare import Comparison, memory_rows


def matching_profile(scenario: Scenario, attention_kernel: str) -> HardwareProfile:
    """The scenario's profile with the attention kernel that ran and no backend temporaries
    (the fake process group allocates none); with ``parallel.cpu_offload`` the device is the host, as
    in the fake run (its mesh is on the CPU). For FSDP1 also serial, as the measured step ran: its
    unshard stream does not wait for compute, so on a GPU a backward prefetch issued by a host
    that runs ahead allocates while the loss is still computing, which a CPU step never does."""
    profile = load_profile(scenario.cluster.profile, where=f"{scenario.source}: cluster.profile")
    if scenario.parallel.cpu_offload:  # the fake run's device is this CPU: CPUOffloadPolicy moves nothing
        profile = dataclasses.replace(profile, node=dataclasses.replace(profile.node, host_is_device=True))
    backend = dataclasses.replace(
        profile.backend,
        attention_kernel=attention_kernel,
        collective_temp_buffers=False,
        overlaps_comm_compute=profile.backend.overlaps_comm_compute and scenario.parallel.fsdp_version == 2,
    )
    return dataclasses.replace(profile, backend=backend)


def compare_memory(scenario: Scenario, measured: dict[str, Any]) -> Comparison:
    """Predicted against measured peak memory and its categories."""
    profile = matching_profile(scenario, measured["kernels"]["attention_kernel"])
    report = build_report(simulate(scenario, profile))
    return Comparison(rows=memory_rows(report, measured))


def validate_memory_only(
    scenario_path: str, overrides: list[str], timeout_s: float
) -> tuple[Comparison, dict[str, Any]]:
    from validation.build_fsdp1 import check_runs_here
    from validation.fake_memory_child import measure_fake_memory_subprocess

    scenario = load_scenario(scenario_path, overrides)  # a user mistake fails here, before anything runs
    check_runs_here(scenario)
    measured = measure_fake_memory_subprocess(scenario_path, overrides, timeout_s)
    return compare_memory(scenario, measured), measured
