"""Shared builders for simulator tests: scenarios from dicts and profiles with chosen numbers."""

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.parse import profile_from_dict
from sim.hardware.schema import HardwareProfile
from sim.scenario.loader import load_scenario, scenario_from_dict
from sim.scenario.sections import Scenario


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


def elementwise_op(name: str, **fields: Any) -> Any:
    """A ``LayerOp`` of no FLOPs and no parameters (an elementwise op of block 0), with ``fields``
    (its saved bytes, its orders of requests) set over it."""
    from sim.workload.layer_op import LayerKind, LayerOp

    base: dict[str, Any] = {
        "name": name,
        "module": name,
        "kind": LayerKind.ELEMENTWISE,
        "block": 0,
        "params": (),
        "flops": 0.0,
        "memory_bytes": 0.0,
        "saved_bytes": 0,
    }
    return LayerOp(**(base | fields))


def make_profile(
    *,
    overlap: bool = True,
    temp_buffers: bool = False,
    launch_s: float | None = None,
    overlap_slowdown: float | None = None,
    roofline: bool = False,
) -> HardwareProfile:
    """The h100-sxm datasheet profile with the backend and link numbers a test needs
    (``overlap_slowdown=1.0``: compute that a collective overlaps is not slowed, so an op's
    duration does not depend on when the collectives around it run; ``roofline``: without the GPU
    kernel model's inputs, so that compute is the roofline a calibrated profile scales)."""
    data = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    if roofline:
        data["device"].pop("matmul_flops")
        data["device"].pop("achievable_hbm_bandwidth_Bps")
    if overlap_slowdown is not None:
        data["device"]["overlap_slowdown"] = overlap_slowdown
    data["backend"]["overlaps_comm_compute"] = overlap
    data["backend"]["collective_temp_buffers"] = temp_buffers
    if launch_s is not None:
        data["backend"]["collective_launch_s"] = launch_s
    return profile_from_dict(data, "test-profile")


def synthetic_compute_section(scenario: Scenario, profile: HardwareProfile, factor: float) -> dict[str, Any]:
    """A compute section whose every measurement is ``factor`` x the analytic model's, at the
    scenario's dimensions (what `calibrate compute` would write on a machine that runs exactly
    ``factor`` times slower and allocates ``factor`` times more)."""
    from sim.costs.compute_build import build_compute_costs
    from sim.dtypes import dtype_bytes
    from sim.workload.forward import layer_ops
    from sim.workload.layer_op import CalibrationGroup
    from sim.workload.shapes import Workload

    t = scenario.training
    workload = Workload(
        micro_batch=t.micro_batch,
        seq_len=t.seq_len,
        act_bytes=dtype_bytes(scenario.param_dtype),
        attention_kernel=profile.backend.attention_kernel,
    )
    ops = layer_ops(scenario.model, workload)
    costs = build_compute_costs(
        profile,
        ops,
        model=scenario.model,
        micro_batch=t.micro_batch,
        seq_len=t.seq_len,
        param_dtype=scenario.param_dtype,
        optimizer="adamw",
    )
    units = {}
    for group in CalibrationGroup:
        members = [op for op in ops if op.group is group and op.block in (None, 0)]
        fwd = sum(costs.op_s(op)[0] for op in members)
        bwd = sum(costs.op_s(op)[1] for op in members)
        units[group.value] = {
            "forward_s": factor * fwd,
            "backward_s": factor * bwd,
            "recompute_s": factor * fwd,
            "saved_activation_bytes": factor * sum(op.saved_bytes for op in members),
            "forward_transient_bytes": factor * max(op.forward_transient_bytes for op in members),
            "backward_transient_bytes": factor * max(op.backward_transient_bytes for op in members),
        }
    m = scenario.model
    return {
        "model": {
            f: getattr(m, f)
            for f in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab", "tie_embeddings")
        },
        "micro_batch": t.micro_batch,
        "seq_len": t.seq_len,
        "param_dtype": scenario.param_dtype,
        "units": units,
        "copy_Bps": costs.copy_Bps,
        "optimizer_s_per_param": {
            "adamw": costs.optimizer_s_per_element,
            "sgd": costs.optimizer_s_per_element,
        },
        "fsdp_optimizer_s_per_param": {
            "adamw": costs.optimizer_s_per_element,
            "sgd": costs.optimizer_s_per_element,
        },
        "fsdp_unit_overhead_s": {"forward": 0.0, "backward": 0.0},
        "host_overhead_in_step": False,
        # the profile's own figure, so that only the unit times differ from the analytic run
        "compute_slowdown_during_collective": profile.compute_slowdown_during_collective,
    }


def outside_rank_env() -> dict[str, str]:
    """This process's environment without a rank's torch.distributed variables, so that a command
    started from a test launches its own ranks, as a user's shell would."""
    return {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }


def run_calibrate(*args: str, timeout: float = 300) -> "subprocess.CompletedProcess[str]":
    """``python -m calibrate ...`` in a fresh process from the repository root, as a user runs it."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "calibrate", *args]
    return subprocess.run(
        cmd, cwd=root, env=outside_rank_env(), capture_output=True, text=True, timeout=timeout
    )


def calibrated_compute_profile(folder: Path, scenario: Path, name: str) -> Path:
    """A copy of the h100-sxm datasheet profile named ``name`` in ``folder``, with the compute
    section ``calibrate compute`` measures for ``scenario`` on 2 gloo ranks (one repetition)."""
    import json

    path = folder / "profile.json"
    base = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    base["name"] = name
    path.write_text(json.dumps(base))
    proc = run_calibrate("compute", str(scenario), "--profile", str(path), "--nproc", "2", "--reps", "1")
    assert proc.returncode == 0, proc.stderr
    return path


def description_cache(name: str) -> Any:
    """A module-scoped ``folder`` fixture: a temporary folder (``name``) for a test module's scenarios
    of Hugging Face configs. Their descriptions go to the run's one cache (``conftest``'s
    ``FSDPSIM_CACHE_DIR``, which the ranks a calibration starts inherit)."""

    @pytest.fixture(scope="module")
    def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp(name)

    return folder


def compute_target(scenario: Path, world_size: int = 2) -> Any:
    """What ``calibrate compute`` measures for the scenario file (``calibrate.compute.ComputeTarget``)."""
    from calibrate.compute import ComputeTarget

    sc = load_scenario(scenario)
    return ComputeTarget(
        model=sc.model,
        micro_batch=sc.training.micro_batch,
        seq_len=sc.training.seq_len,
        param_dtype=sc.precision.param_dtype,
        world_size=world_size,
    )


TINY_SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "tiny.toml"
HF_CONFIGS = Path(__file__).resolve().parent / "data" / "hf"


def tiny_with_config(tmp_path: Path, config: str) -> str:
    """``scenarios/tiny.toml`` (fp32, 2 x 64 tokens, 2 ranks) with its preset replaced by the
    described model ``tests/data/hf/CONFIG`` (``--set`` cannot swap a preset for a config)."""
    text = TINY_SCENARIO.read_text()
    assert 'preset = "tiny"' in text
    path = tmp_path / f"{Path(config).stem}.toml"
    path.write_text(text.replace('preset = "tiny"', f'config = "{HF_CONFIGS / config}"'))
    return str(path)


def real_step_peak(scenario: str, sets: list[str]) -> tuple[Any, dict[str, Any]]:
    """The real FSDP2 step of one rank (fake process group, FakeTensorMode, in a child process)
    against the simulator: the comparison's peak-memory row and the measurement."""
    from validation.fake_memory_child import measure_fake_memory_subprocess
    from validation.memory_only import compare_memory

    measured = measure_fake_memory_subprocess(scenario, sets, 300.0)
    row = compare_memory(load_scenario(scenario, sets), measured).rows[0]
    assert row.metric == "peak memory"
    return row, measured
