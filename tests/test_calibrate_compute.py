"""``calibrate compute`` on the tiny preset for real, the memory probes, and the dimension check."""

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from simtest import run_calibrate

from calibrate.compute import ComputeTarget
from calibrate.memtrack import SavedTensorBytes, peak_above_start
from sim.cli.main import main as fsdpsim_main
from sim.costs.compute_build import check_compute_matches
from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.compute_section import parse_compute_section
from sim.hardware.registry import load_profile
from sim.scenario.loader import load_scenario
from sim.workload.model import PRESETS

pytestmark = pytest.mark.slow  # real torch.distributed processes

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "scenarios" / "tiny.toml"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A datasheet profile with a compute section measured for scenarios/tiny.toml by 2 ranks."""
    path = tmp_path_factory.mktemp("compute") / "cpu.json"
    base = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    base["name"] = "cpu-test"
    path.write_text(json.dumps(base))
    proc = run_calibrate(
        "compute", str(TINY), "--profile", str(path), "--nproc", "2", "--reps", "2", timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    return path


def test_tiny_end_to_end_adds_a_compute_section(calibrated: Path) -> None:
    prof = load_profile(str(calibrated))
    assert prof.compute is not None and prof.device.name.startswith("NVIDIA H100")  # the rest is kept
    c = prof.compute
    sc = load_scenario(str(TINY))
    check_compute_matches(
        c, sc.model, sc.training.micro_batch, sc.training.seq_len, sc.precision.param_dtype, "t"
    )
    assert c.dims.hidden == 64 and (c.micro_batch, c.seq_len, c.param_dtype) == (
        2,
        64,
        "fp32",
    )
    for name, unit in c.units.items():
        assert unit.forward_s > 0 and unit.backward_s > 0, name
        assert (unit.recompute_s > 0) == (name == "block"), name
    assert c.copy_Bps > 0 and c.optimizer_s_per_param["adamw"] > 0 and c.optimizer_s_per_param["sgd"] > 0
    assert c.compute_slowdown_during_collective >= 1.0
    # the block's forward time run after run varies (it never repeats to the nanosecond on a host)
    assert c.compute_time_rel_std > 0
    assert c.attention_kernel == "flash"  # the tiny Llama's causal call runs this CPU's fused kernel
    # FSDP2's own costs, measured with the real fully_shard: DTensor optimizer, per-unit host work
    assert c.fsdp_optimizer_s_per_param["adamw"] > 0 and c.fsdp_optimizer_s_per_param["sgd"] > 0
    assert c.fsdp_forward_overhead_s >= 0 and c.fsdp_backward_overhead_s >= 0
    assert c.host_overhead_in_step is True  # the host is the device on a CPU
    src = json.loads(calibrated.read_text())["source"]["compute"]
    assert src["world_size"] == 2 and src["attention_kernel"].startswith("aten.")
    overhead = src["fsdp_unit_overhead"]
    for phase in ("forward", "backward"):
        assert overhead[f"{phase}_s"] == max(0.0, overhead[f"{phase}_raw_s"])
    # the units' times come from whole models; the isolated ones are kept beside them
    assert set(src["units_alone"]) == {
        f"{u}.{f}" for u in ("embed", "block", "head") for f in ("forward_s", "backward_s", "recompute_s")
    }
    ratio = src["in_model_over_alone"]
    for phase in ("forward_s", "backward_s"):
        assert getattr(c.units["block"], phase) == pytest.approx(
            ratio[phase] * src["units_alone"][f"block.{phase}"]
        )


def test_measured_bytes_cover_the_tensors_that_must_be_saved(calibrated: Path) -> None:
    units = json.loads(calibrated.read_text())["compute"]["units"]
    b, s, h, v = 2, 64, 64, 512
    assert units["embed"]["saved_activation_bytes"] == b * s * 8  # the int64 token ids
    assert units["block"]["saved_activation_bytes"] >= 8 * b * s * h * 4  # norms, q/k/v, attention, MLP
    assert units["head"]["saved_activation_bytes"] >= b * s * v * 4  # the fp32 log-softmax of the logits
    assert units["head"]["backward_transient_bytes"] >= b * s * v * 4  # the logits' gradient


def test_the_simulator_runs_the_scenario_on_the_calibrated_profile(
    calibrated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fsdpsim_main(["run", str(TINY), "--set", f"cluster.profile={calibrated}"]) == 0
    assert "step time" in capsys.readouterr().out


def test_other_dimensions_are_refused_by_name(calibrated: Path) -> None:
    c = parse_compute_section(json.loads(calibrated.read_text())["compute"], "p")
    tiny = PRESETS["tiny"]
    with pytest.raises(UserError, match=r"seq_len=64 \(scenario: 128\)"):
        check_compute_matches(c, tiny, 2, 128, "fp32", "profile p")
    with pytest.raises(
        UserError, match=r"model\.hidden=64 \(scenario: 256\).*param_dtype='fp32' \(scenario: 'bf16'\)"
    ):
        check_compute_matches(c, PRESETS["llama-5m"], 2, 64, "bf16", "profile p")
    from dataclasses import replace

    with pytest.raises(UserError, match="tie_embeddings"):
        check_compute_matches(c, replace(tiny, tie_embeddings=True), 2, 64, "fp32", "profile p")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c["units"].pop("block"), "missing field compute.units.block"),
        (
            lambda c: c["units"]["head"].update(forward_s=-1.0),
            "compute.units.head.forward_s must be a number >= 0",
        ),
        (lambda c: c.update(compute_slowdown_during_collective=0.5), "compute_slowdown_during_collective"),
        (lambda c: c.pop("copy_Bps"), "missing field compute.copy_Bps"),
        (lambda c: c.update(compute_time_rel_std=-0.1), "compute.compute_time_rel_std must be a number >= 0"),
        (lambda c: c.update(attention_kernel="fast"), "compute.attention_kernel must be flash or math"),
    ],
)
def test_a_malformed_compute_section_is_refused(calibrated: Path, edit, match: str) -> None:  # type: ignore[no-untyped-def]
    c = json.loads(calibrated.read_text())["compute"]
    edit(c)
    with pytest.raises(UserError, match=match):
        parse_compute_section(c, "profile p")


def test_a_missing_or_corrupted_profile_exits_2_before_measuring(tmp_path: Path) -> None:
    from calibrate.cli import main

    assert main(["compute", str(TINY), "--profile", str(tmp_path / "none.json")]) == 2
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema_version": 1, "name": ')
    assert main(["compute", str(TINY), "--profile", str(broken)]) == 2
    assert broken.read_text() == '{"schema_version": 1, "name": '


def test_scenario_and_flags_are_exclusive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from calibrate.cli import main

    path = tmp_path / "p.json"
    path.write_text(json.dumps(BUILTIN_PROFILES["a100-sxm-80g"]))
    assert main(["compute", str(TINY), "--profile", str(path), "--model", "tiny"]) == 2
    assert "not both" in capsys.readouterr().err


def test_flags_describe_a_target_without_a_scenario_file() -> None:
    from calibrate.cli import build_parser
    from calibrate.cli_compute import target_from_args

    args = build_parser().parse_args(
        [
            "compute",
            "--profile",
            "p.json",
            "--model",
            "llama-5m",
            "--micro-batch",
            "1",
            "--seq-len",
            "32",
            "--param-dtype",
            "bf16",
        ]
    )
    assert target_from_args(args, 4) == ComputeTarget(
        model=PRESETS["llama-5m"], micro_batch=1, seq_len=32, param_dtype="bf16", world_size=4
    )


def test_peak_above_start_counts_what_lives_at_once() -> None:
    x = torch.randn(1000, 1000, requires_grad=True)
    # mul's output (4 MB) lives while exp writes its output (4 MB)
    out, peak = peak_above_start(lambda: (x * 2).exp(), CPU)
    assert peak == 8_000_000 and out.shape == (1000, 1000)
    _, none = peak_above_start(lambda: x.detach().add_(1), CPU)
    assert none == 0


def test_a_tensor_released_before_the_next_op_is_not_counted_with_its_output() -> None:
    x = torch.randn(1000, 1000)

    def chain() -> torch.Tensor:
        a = x * 2  # 4 MB
        b = a + 1  # 4 MB, a still referenced: 8 MB live
        del a
        return b.exp()  # a is gone before exp allocates: 8 MB, not 12 MB

    _, peak = peak_above_start(chain, CPU)
    assert peak == 8_000_000


def test_saved_bytes_count_each_storage_once_and_skip_parameters() -> None:
    w = torch.nn.Parameter(torch.randn(256, 256))
    x = torch.randn(4, 256, requires_grad=True)
    with SavedTensorBytes([w]) as saved:
        y = x @ w  # saves x and w
        z = y[:, :128] * y[:, 128:]  # saves two views of y's storage
    assert saved.bytes == x.numel() * 4 + y.numel() * 4
    assert z.shape == (4, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compute_of_the_tiny_preset(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    base = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    path.write_text(json.dumps(base))
    proc = run_calibrate(
        "compute", str(TINY), "--profile", str(path), "--nproc", "1", "--reps", "3", timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    c = load_profile(str(path)).compute
    assert c is not None and c.units["block"].forward_s > 0
    assert json.loads(path.read_text())["source"]["compute"]["backend"] == "nccl"


def _unit(forward: float, backward: float, recompute: float = 0.0) -> Any:
    from sim.hardware.compute_section import UnitMeasurement

    return UnitMeasurement(
        forward_s=forward,
        backward_s=backward,
        recompute_s=recompute,
        saved_activation_bytes=7,
        forward_transient_bytes=5,
        backward_transient_bytes=3,
    )


def test_in_model_times_are_the_depth_difference_and_the_rest_split_as_measured_alone() -> None:
    from calibrate.context_timing import in_model

    alone = {"embed": _unit(1.0, 2.0), "block": _unit(10.0, 20.0, 9.0), "head": _unit(3.0, 6.0)}
    # 1 layer: 15 / 30; 3 layers: 39 / 78 -> a layer is 12 / 24, the ends 3 / 6
    units, ratio = in_model(alone, {1: (15.0, 30.0), 3: (39.0, 78.0)})
    assert (units["block"].forward_s, units["block"].backward_s) == pytest.approx((12.0, 24.0))
    assert units["block"].recompute_s == pytest.approx(9.0 * 1.2)  # scaled like the forward
    assert (units["embed"].forward_s, units["head"].forward_s) == pytest.approx((0.75, 2.25))
    assert (units["embed"].backward_s, units["head"].backward_s) == pytest.approx((1.5, 4.5))
    assert ratio == pytest.approx({"forward_s": 1.2, "backward_s": 1.2})
    assert all(units[u].saved_activation_bytes == 7 for u in units)  # memory stays as measured alone


def test_in_model_keeps_the_isolated_times_when_noise_swamps_the_difference() -> None:
    from calibrate.context_timing import in_model

    alone = {"embed": _unit(1.0, 2.0), "block": _unit(10.0, 20.0, 9.0), "head": _unit(3.0, 6.0)}
    units, ratio = in_model(alone, {1: (15.0, 30.0), 3: (14.0, 78.0)})  # deeper model faster: noise
    assert units["block"].forward_s == 10.0 and units["embed"].forward_s == 1.0
    assert units["block"].backward_s == pytest.approx(24.0)
    assert ratio["forward_s"] == 1.0 and units["block"].recompute_s == 9.0
