"""``calibrate compute`` on a model described from its config.json: its own units, measured in
the real ``transformers`` model (``calibrate.hf_units``), applied by the simulator block by block,
and refused for any other model."""

import json
from pathlib import Path

import pytest
import torch
from simtest import calibrated_compute_profile, compute_target, description_cache

from calibrate import hf_units
from sim.cli.main import main as fsdpsim_main
from sim.costs.compute_build import build_compute_costs
from sim.hardware.registry import load_profile
from sim.scenario.loader import load_scenario
from sim.workload.described import described_layer_ops
from sim.workload.layer_op import CalibrationGroup, LayerKind
from sim.workload.options import OptimizerName
from sim.workload.shapes import Workload

pytestmark = pytest.mark.slow  # real torch.distributed processes

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "hf"
CPU = torch.device("cpu")


def _scenario(folder: Path, config: str, dtype: str = "bf16") -> Path:
    (folder / f"{config}.json").write_text((DATA / f"{config}.json").read_text())
    path = folder / f"{config}.toml"
    path.write_text(
        f'[model]\nconfig = "{config}.json"\n[training]\nmicro_batch = 1\nseq_len = 32\n'
        f'[parallel]\nworld_size = 2\n[precision]\nparam_dtype = "{dtype}"\n'
    )
    return path


folder = description_cache("hf-units")


@pytest.mark.parametrize(
    ("config", "block_units", "experts"),
    [
        ("tiny-mixtral", ("block.0", "block.0"), [True]),  # MoE: every layer alike
        ("tiny-qwen2", ("block.0", "block.0"), [False]),  # dense
        ("tiny-deepseek-v2", ("block.0", "block.1", "block.1"), [False, True]),  # a dense first layer
    ],
)
def test_the_units_are_the_models_own_one_block_per_kind(
    folder: Path, config: str, block_units: tuple[str, ...], experts: list[bool]
) -> None:
    target = compute_target(_scenario(folder, config))
    dm = hf_units.build_described(target, CPU, torch.bfloat16)
    assert dm.block_units == block_units
    assert dm.kept == tuple(int(u.removeprefix("block.")) for u in dict.fromkeys(block_units))
    # the kept layers are the model's own classes, MoE where the model routes to experts
    assert [hasattr(layer.mlp, "experts") for layer in dm.layers] == experts
    assert type(dm.model).__name__ == target.model.description.architecture  # type: ignore[union-attr]
    if config == "tiny-deepseek-v2":
        return  # its kinds are the point; the MoE and the dense model are timed below
    times, units = hf_units.measure_described(target, CPU, reps=1)
    measured = hf_units.units_of(times, units)
    assert list(measured) == ["embed", *dict.fromkeys(block_units), "head"]
    for name, u in measured.items():
        assert u.forward_s > 0 and u.backward_s > 0, name
        assert (u.recompute_s > 0) == name.startswith("block."), name


@pytest.fixture(scope="module")
def calibrated(folder: Path) -> Path:
    """A datasheet profile with a compute section of tiny-mixtral measured by 2 gloo ranks."""
    return calibrated_compute_profile(folder, _scenario(folder, "tiny-mixtral"), "cpu-test")


def test_two_ranks_write_the_described_models_units(calibrated: Path, folder: Path) -> None:
    doc = json.loads(calibrated.read_text())
    compute = doc["compute"]
    d = load_scenario(folder / "tiny-mixtral.toml").model.description
    assert d is not None
    assert compute["described_model"] == {
        "name": d.name,
        "architecture": "MixtralForCausalLM",
        "config_sha256": d.config_sha256,
        "finetune": "full",
        "decoder_seq_len": None,
    }
    assert compute["block_units"] == ["block.0", "block.0"]
    assert compute["attention_kernel"] == "flash"  # a causal call without a mask: the CPU's fused kernel
    assert list(compute["units"]) == ["embed", "block.0", "head"]
    assert "MixtralForCausalLM" in doc["source"]["compute"]["method"]


def test_the_simulator_scales_each_block_by_its_measured_unit(calibrated: Path, folder: Path) -> None:
    sc = load_scenario(folder / "tiny-mixtral.toml")
    profile = load_profile(str(calibrated))
    assert profile.compute is not None
    workload = Workload(
        micro_batch=1, seq_len=32, act_bytes=2, attention_kernel=profile.backend.attention_kernel
    )
    assert sc.model.description is not None
    ops = described_layer_ops(sc.model.description, workload)
    costs = build_compute_costs(
        profile,
        ops,
        model=sc.model,
        micro_batch=1,
        seq_len=32,
        param_dtype="bf16",
        optimizer=OptimizerName.ADAMW,
    )

    def total(members: list, which: int, quantity: str) -> float:  # type: ignore[type-arg]
        return sum(costs.op_s(op)[which] * costs._scale(op, quantity) for op in members)

    units = profile.compute.units
    for block in (0, 1):
        members = [op for op in ops if op.block == block]
        assert total(members, 0, "forward") == pytest.approx(units["block.0"].forward_s)
        assert total(members, 1, "backward") == pytest.approx(units["block.0"].backward_s)
    outside = [op for op in ops if op.block is None]
    head = [op for op in outside if op.group is not CalibrationGroup.EMBED]
    assert any(op.kind is LayerKind.ROTARY for op in head)  # the head was timed as the rest of the model
    assert total(head, 0, "forward") == pytest.approx(units["head"].forward_s)
    embed = [op for op in outside if op.group is CalibrationGroup.EMBED]
    assert total(embed, 1, "backward") == pytest.approx(units["embed"].backward_s)
    # the bytes stay the description's
    assert all(costs._scale(op, "saved") == 1.0 for op in ops)
    assert (
        fsdpsim_main(["run", str(folder / "tiny-mixtral.toml"), "--set", f"cluster.profile={calibrated}"])
        == 0
    )


@pytest.mark.parametrize("other", ["tiny-qwen2", "llama"])
def test_the_profile_refuses_another_model_in_one_line(
    calibrated: Path, folder: Path, other: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if other == "llama":
        scenario = folder / "llama.toml"
        scenario.write_text(
            '[model]\npreset = "tiny"\n[training]\nmicro_batch = 1\nseq_len = 32\n'
            '[parallel]\nworld_size = 2\n[precision]\nparam_dtype = "bf16"\n'
        )
    else:
        scenario = _scenario(folder, other)
    assert fsdpsim_main(["run", str(scenario), "--set", f"cluster.profile={calibrated}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "measured on model tiny-mixtral (MixtralForCausalLM)" in err[0]


def test_the_matrix_rows_of_described_models_are_their_own_system() -> None:
    from validation.matrix_rows import HF_BASE, HF_MATRIX, MATRIX, system_of

    assert [system_of(o) for _, o in HF_MATRIX] == ["hf"] * len(HF_MATRIX) and len(HF_MATRIX) == 7
    assert all(system_of(o) != "hf" for name, o in MATRIX if (name, o) not in HF_MATRIX)
    for _, overrides in HF_MATRIX:  # each row's config exists where the base scenario points
        config = next(o for o in overrides if o.startswith("model.config=")).split("=", 1)[1]
        assert (ROOT / HF_BASE).parent.joinpath(config).is_file()


@pytest.mark.parametrize("block_units", [[], ["embed", "block.0"], "block.0"])
def test_malformed_block_units_are_refused_by_name(
    calibrated: Path, tmp_path: Path, block_units: object
) -> None:
    from sim.errors import UserError

    doc = json.loads(calibrated.read_text())
    doc["compute"]["block_units"] = block_units
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="block_units"):
        load_profile(str(path))
