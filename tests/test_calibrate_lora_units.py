"""``calibrate compute`` on a LoRA model described from its config.json: PEFT's LoRA applied to the
real model as the scenario sets it, the first block a unit of its own, the profile keyed by the
LoRA settings, and every mismatch (full training, other settings, QLoRA) refused in one line."""

import json
from pathlib import Path

import pytest
import torch
from simtest import calibrated_compute_profile, compute_target, description_cache, run_calibrate

from calibrate import hf_units
from sim.cli.main import main as fsdpsim_main
from sim.scenario.loader import load_scenario
from sim.workload.description import finetune_fingerprint

pytestmark = pytest.mark.slow  # real torch.distributed processes

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "hf"
CPU = torch.device("cpu")
LORA = 'method = "lora"\nrank = 4\nalpha = 8\ntarget_modules = ["q_proj", "v_proj"]\n'


def _scenario(folder: Path, name: str, finetune: str | None) -> Path:
    (folder / "tiny-qwen2.json").write_text((DATA / "tiny-qwen2.json").read_text())
    path = folder / f"{name}.toml"
    path.write_text(
        '[model]\nconfig = "tiny-qwen2.json"\n[training]\nmicro_batch = 1\nseq_len = 32\n'
        '[parallel]\nworld_size = 2\n[precision]\nparam_dtype = "bf16"\n'
        + (f"[finetune]\n{finetune}" if finetune else "")
    )
    return path


folder = description_cache("lora-units")


def test_the_fingerprint_names_the_settings_and_tells_them_apart(folder: Path) -> None:
    lora = load_scenario(_scenario(folder, "lora", LORA)).model.description
    full = load_scenario(_scenario(folder, "full", None)).model.description
    other = load_scenario(_scenario(folder, "r8", LORA.replace("rank = 4", "rank = 8"))).model.description
    assert lora is not None and full is not None and other is not None
    assert finetune_fingerprint(full.finetune) == "full"
    assert finetune_fingerprint(lora.finetune) == "lora:r4:a8.0:d0.0:q_proj,v_proj"
    assert finetune_fingerprint(other.finetune) == "lora:r8:a8.0:d0.0:q_proj,v_proj"


def test_the_measured_model_trains_only_its_adapters_and_times_every_unit(folder: Path) -> None:
    target = compute_target(_scenario(folder, "lora", LORA))
    dm = hf_units.build_described(target, CPU, torch.bfloat16)
    # the first block alone (its input needs no gradient), the second its own kind
    assert dm.block_units == ("block.0", "block.1")
    trained = {n for n, p in dm.model.named_parameters() if p.requires_grad}
    expected = {
        f"model.layers.{i}.self_attn.{m}.lora_{ab}.default.weight"
        for i in (0, 1)
        for m in ("q_proj", "v_proj")
        for ab in "AB"
    }
    assert trained == expected
    assert all(p.dtype == torch.bfloat16 for p in dm.model.parameters())  # adapters in the compute dtype
    times, units = hf_units.measure_described(target, CPU, reps=1)
    measured = hf_units.units_of(times, units)
    assert list(measured) == ["embed", "block.0", "block.1", "head"]
    for name in ("block.0", "block.1", "head"):
        assert measured[name].forward_s > 0 and measured[name].backward_s > 0, name
    # the frozen embedding has no backward; the first block's backward is the rest of the step's
    assert measured["embed"].backward_s == 0.0


@pytest.fixture(scope="module")
def calibrated(folder: Path) -> Path:
    """A datasheet profile with a compute section of tiny-qwen2 + LoRA measured by 2 gloo ranks."""
    return calibrated_compute_profile(folder, _scenario(folder, "lora", LORA), "cpu-lora-test")


def test_two_ranks_write_the_lora_units_keyed_by_the_settings(calibrated: Path) -> None:
    compute = json.loads(calibrated.read_text())["compute"]
    assert compute["described_model"]["finetune"] == "lora:r4:a8.0:d0.0:q_proj,v_proj"
    assert compute["block_units"] == ["block.0", "block.1"]
    assert compute["units"]["embed"]["backward_s"] == 0.0
    assert compute["fsdp_unit_overhead_s"]["forward"] >= 0.0
    assert compute["fsdp1_unit_overhead_s"]["backward"] >= 0.0  # FSDP1 LoRA (PEFT's wrap) uses it


def test_the_simulator_runs_the_lora_scenario_on_its_profile(calibrated: Path, folder: Path) -> None:
    scenario = folder / "lora.toml"
    assert fsdpsim_main(["run", str(scenario), "--set", f"cluster.profile={calibrated}"]) == 0


@pytest.mark.parametrize(
    ("name", "finetune", "trained"),
    [("full", None, "'full'"), ("r8", LORA.replace("rank = 4", "rank = 8"), "'lora:r8:")],
)
def test_other_fine_tuning_is_refused_in_one_line(
    calibrated: Path,
    folder: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    finetune: str | None,
    trained: str,
) -> None:
    scenario = _scenario(folder, name, finetune)
    assert fsdpsim_main(["run", str(scenario), "--set", f"cluster.profile={calibrated}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "trained 'lora:r4:a8.0:d0.0:q_proj,v_proj'" in err[0] and trained in err[0]


def test_qlora_is_refused_before_any_rank_starts(folder: Path, calibrated: Path) -> None:
    scenario = _scenario(folder, "qlora", LORA.replace('"lora"', '"qlora"'))
    proc = run_calibrate(
        "compute", str(scenario), "--profile", str(calibrated), "--nproc", "2", "--reps", "1"
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "fine-tuned with QLoRA" in lines[0]
    assert "rank" not in lines[0]


def test_a_profile_from_before_lora_calibration_reads_as_full_training(
    calibrated: Path, tmp_path: Path
) -> None:
    from sim.hardware.registry import load_profile

    doc = json.loads(calibrated.read_text())
    del doc["compute"]["described_model"]["finetune"]
    path = tmp_path / "older.json"
    path.write_text(json.dumps(doc))
    profile = load_profile(str(path))
    assert profile.compute is not None and profile.compute.described_model is not None
    assert profile.compute.described_model.finetune == "full"
