"""DeepSpeed ZeRO's optimizer step measured through the real engine (``calibrate.deepspeed_overhead``)
and charged by the ZeRO schedules in place of their modelled casts, optimizer and copy-back.

The calibration runs for real: ``calibrate compute`` on 2 gloo ranks for the tiny model under
ZeRO-3 bf16, which starts ``deepspeed.initialize`` with the scenario's own DeepSpeed config.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from simtest import outside_rank_env

from sim.core.events import OpKind
from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.compute_section import parse_compute_section
from sim.hardware.registry import load_profile
from sim.scenario.loader import load_scenario
from sim.schedule.zero_state import flat_padded_numel, partition_numel, zero_params
from sim.simulate import build_step, simulate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "scenarios" / "tiny.toml"
ZERO3 = ["deepspeed.enabled=true", "deepspeed.stage=3", "precision.param_dtype=bf16"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ds") / "cpu.json"
    base = dict(BUILTIN_PROFILES["h100-sxm"], name="cpu-ds-test")  # its device section is kept
    path.write_text(json.dumps(base))
    sets = [a for o in ZERO3 for a in ("--set", o)]
    env = outside_rank_env()
    cmd = [sys.executable, "-m", "calibrate", "compute", str(TINY), *sets, "--profile", str(path)]
    cmd += ["--nproc", "2", "--reps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def _scenario(*extra: str):
    return load_scenario(str(TINY), [*ZERO3, *extra])


def _partition(stage: int) -> int:
    """This rank's partition as the schedules size it (``sim.schedule.zero_state``)."""
    step, _, _ = build_step(_scenario(f"deepspeed.stage={stage}"), load_profile("h100-sxm"))
    if stage == 3:
        return sum(partition_numel(p, 2) for p in zero_params(step))
    return flat_padded_numel(step) // 2


def test_the_step_is_measured_for_the_scenarios_stage(calibrated: Path) -> None:
    compute = load_profile(str(calibrated)).compute
    assert compute is not None
    assert set(compute.deepspeed_step_s_per_param) == {"3"}
    rate = compute.deepspeed_step_s_per_param["3"]
    # the step contains an AdamW over the same elements (plus the casts, norms and copy-back)
    assert rate > compute.optimizer_s_per_param["adamw"]
    source = json.loads(calibrated.read_text())["source"]["compute"]["deepspeed_step"]
    # the real optimizer's fp32 partition is the one the ZeRO-3 schedule steps over
    assert source["partition_numel"] == _partition(3)
    assert source["s_per_param"] == pytest.approx(rate)
    assert "engine.step()" in source["method"]


@pytest.mark.parametrize("sub_group", [10**9, 20000])  # one sub-group, then several
def test_zero3_charges_the_measured_step_per_sub_group(calibrated: Path, sub_group: int) -> None:
    profile = load_profile(str(calibrated))
    rate = profile.compute.deepspeed_step_s_per_param["3"]  # type: ignore[union-attr]
    r = simulate(_scenario(f"deepspeed.sub_group_size={sub_group}"), profile)
    steps = [o for o in r.program.ops if o.kind is OpKind.OPTIMIZER]
    part = _partition(3)
    sizes = [min(sub_group, part - g * sub_group) for g in range(math.ceil(part / sub_group))]
    assert [o.duration_s for o in steps] == pytest.approx([rate * n for n in sizes])


def test_another_stage_keeps_the_modelled_step(calibrated: Path) -> None:
    """A profile measured under ZeRO-3 says nothing of ZeRO-2's step: the schedule models it."""
    profile = load_profile(str(calibrated))
    rate = profile.compute.deepspeed_step_s_per_param["3"]  # type: ignore[union-attr]
    r = simulate(_scenario("deepspeed.stage=2"), profile)
    (step,) = [o for o in r.program.ops if o.kind is OpKind.OPTIMIZER]
    (copy_back,) = [o for o in r.program.ops if o.name == "fp32 partition -> params"]
    assert step.duration_s != pytest.approx(rate * _partition(2)) and copy_back.duration_s > 0


def test_zero12_charges_the_measured_step_and_no_separate_copy_back(calibrated: Path) -> None:
    data = json.loads(calibrated.read_text())
    data["compute"]["deepspeed_step_s_per_param"] = {"2": 1e-7}
    profile_path = calibrated.parent / "stage2.json"
    profile_path.write_text(json.dumps(data))
    r = simulate(_scenario("deepspeed.stage=2"), load_profile(str(profile_path)))
    (step,) = [o for o in r.program.ops if o.kind is OpKind.OPTIMIZER]
    (copy_back,) = [o for o in r.program.ops if o.name == "fp32 partition -> params"]
    assert step.duration_s == pytest.approx(1e-7 * _partition(2)) and copy_back.duration_s == 0.0


def test_a_gpu_profile_never_charges_it(calibrated: Path) -> None:
    """Where the host is not the device the measurement is not added (the section says so)."""
    data = json.loads(calibrated.read_text())
    data["compute"]["host_overhead_in_step"] = False
    profile_path = calibrated.parent / "gpu.json"
    profile_path.write_text(json.dumps(data))
    r = simulate(_scenario(), load_profile(str(profile_path)))
    rate = data["compute"]["deepspeed_step_s_per_param"]["3"]
    (step,) = [o for o in r.program.ops if o.kind is OpKind.OPTIMIZER]
    assert step.duration_s != pytest.approx(rate * _partition(3))
    assert not any(o.name.startswith("deepspeed hooks") for o in r.program.ops)


def test_the_section_round_trips_and_refuses_an_unknown_stage(calibrated: Path) -> None:
    compute = load_profile(str(calibrated)).compute
    assert compute is not None
    assert parse_compute_section(compute.to_dict(), "p.json") == compute
    bad = compute.to_dict() | {"deepspeed_step_s_per_param": {"4": 1e-9}}
    message = r"p.json: field compute.deepspeed_step_s_per_param has stage '4'; allowed: 1, 2, 3"
    with pytest.raises(UserError, match=message):
        parse_compute_section(bad, "p.json")


def _hooks_per_layer(r, phase_before_backward: bool) -> dict[int, float]:
    """Seconds of DeepSpeed hook time charged to each decoder layer in forward (or backward)."""
    ops = list(r.program.ops)
    first_backward = next(i for i, o in enumerate(ops) if o.kind is OpKind.BACKWARD)
    out: dict[int, float] = {}
    for i, o in enumerate(ops):
        module = o.name.removeprefix("deepspeed hooks ")
        if o.kind is not OpKind.HOST or module == o.name or (i < first_backward) != phase_before_backward:
            continue
        if not module.startswith("model.layers."):
            continue
        layer = int(module.split(".")[2])
        out[layer] = out.get(layer, 0.0) + o.duration_s
    return out


def test_zero3_charges_each_layer_its_measured_hook_time_once_per_pass(calibrated: Path) -> None:
    profile = load_profile(str(calibrated))
    layer = profile.compute.deepspeed_layer_overhead_s["3"]  # type: ignore[union-attr]
    source = json.loads(calibrated.read_text())["source"]["compute"]["deepspeed_layer"]
    for phase in ("forward", "backward"):
        assert layer[phase] == max(0.0, source[f"{phase}_raw_s"])  # floored after the mean over ranks
    r = simulate(_scenario(), profile)
    n_layers = r.scenario.model.n_layers
    for phase, forward in (("forward", True), ("backward", False)):
        if layer[phase] > 0:
            per_layer = _hooks_per_layer(r, forward)
            assert sorted(per_layer) == list(range(n_layers))
            assert list(per_layer.values()) == pytest.approx([layer[phase]] * n_layers)


def test_zero2_spreads_a_layers_hook_time_over_its_parameters(calibrated: Path) -> None:
    data = json.loads(calibrated.read_text())
    data["compute"]["deepspeed_layer_overhead_s"] = {"2": {"forward": 0.0, "backward": 2e-3}}
    profile_path = calibrated.parent / "stage2-hooks.json"
    profile_path.write_text(json.dumps(data))
    r = simulate(_scenario("deepspeed.stage=2"), load_profile(str(profile_path)))
    assert not _hooks_per_layer(r, True)  # nothing measured in forward, nothing charged
    per_layer = _hooks_per_layer(r, False)
    assert list(per_layer.values()) == pytest.approx([2e-3] * r.scenario.model.n_layers)


def test_blocked_time_is_the_union_of_calls_and_waits() -> None:
    """A synchronous collective's own wait lies inside its call: counted once; waits outside the
    window are not counted."""
    from calibrate.deepspeed_overhead import blocked_s

    records = [
        ("all_gather", 1.0, 2.0, 8),
        ("wait", 1.5, 1.9, 0),  # inside the call above
        ("wait", 1.8, 2.5, 0),  # overlaps its end
        ("all_reduce", 3.0, 3.25, 4),
        ("wait", 9.0, 9.5, 0),  # outside [0, 5]
    ]
    assert blocked_s(records, 0.0, 5.0) == pytest.approx(1.5 + 0.25)
    assert blocked_s(records, 2.9, 3.5) == pytest.approx(0.25)
