"""``calibrate compute`` on an encoder-decoder (T5): both stacks cut to one block per kind, every
kind timed inside the real model on the scenario's encoder and decoder lengths, and the profile
refused for another decoder length."""

import json
from pathlib import Path

import pytest
import torch
from simtest import calibrated_compute_profile, compute_target, description_cache

from calibrate import hf_units
from sim.cli.main import main as fsdpsim_main

pytestmark = pytest.mark.slow  # real torch.distributed processes

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "hf"
CPU = torch.device("cpu")


def _scenario(folder: Path, decoder_seq_len: int) -> Path:
    (folder / "tiny-t5.json").write_text((DATA / "tiny-t5.json").read_text())
    path = folder / f"t5-{decoder_seq_len}.toml"
    path.write_text(
        '[model]\nconfig = "tiny-t5.json"\n'
        f"[training]\nmicro_batch = 1\nseq_len = 32\ndecoder_seq_len = {decoder_seq_len}\n"
        '[parallel]\nworld_size = 2\n[precision]\nparam_dtype = "fp32"\n'
    )
    return path


folder = description_cache("t5-units")


def test_both_stacks_keep_one_block_per_kind(folder: Path) -> None:
    target = compute_target(_scenario(folder, 16))
    dm = hf_units.build_described(target, CPU, torch.float32)
    # tiny-t5: 3 encoder blocks, 2 decoder blocks; each stack's first block holds the relative
    # position bias, so it is a kind of its own; the decoder's blocks follow the encoder's
    assert dm.block_units == ("block.0", "block.1", "block.1", "block.3", "block.4")
    assert dm.kept == (0, 1, 3, 4)
    model = dm.model
    assert len(model.encoder.block) == 2 and len(model.decoder.block) == 2  # type: ignore[union-attr, arg-type]
    assert [layer.layer[0].SelfAttention.has_relative_attention_bias for layer in dm.layers] == [
        True,
        False,
        True,
        False,
    ]
    assert [len(layer.layer) for layer in dm.layers] == [2, 2, 3, 3]  # the decoder's cross-attention
    times, units = hf_units.measure_described(target, CPU, reps=1)
    measured = hf_units.units_of(times, units)
    assert list(measured) == ["embed", "block.0", "block.1", "block.3", "block.4", "head"]
    for name, u in measured.items():
        assert u.forward_s > 0 and u.backward_s > 0, name
        assert (u.recompute_s > 0) == name.startswith("block."), name


@pytest.fixture(scope="module")
def calibrated(folder: Path) -> Path:
    return calibrated_compute_profile(folder, _scenario(folder, 16), "cpu-t5-test")


def test_two_ranks_write_the_t5_units_and_the_simulator_runs_on_them(calibrated: Path, folder: Path) -> None:
    compute = json.loads(calibrated.read_text())["compute"]
    assert compute["described_model"]["architecture"] == "T5ForConditionalGeneration"
    assert compute["described_model"]["decoder_seq_len"] == 16
    assert compute["block_units"] == ["block.0", "block.1", "block.1", "block.3", "block.4"]
    # T5's call (a float position-bias mask) sends this CPU's SDPA to its math path: with the
    # causal Llama call's flash figures its activations were predicted at 44 % of a real run's
    assert compute["attention_kernel"] == "math"
    assert fsdpsim_main(["run", str(folder / "t5-16.toml"), "--set", f"cluster.profile={calibrated}"]) == 0


def test_another_decoder_length_is_refused_in_one_line(
    calibrated: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = _scenario(folder, 24)
    assert fsdpsim_main(["run", str(scenario), "--set", f"cluster.profile={calibrated}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "a decoder of 16 tokens, not the scenario's 24" in err[0]
