"""A checkpointed block's memory where its backward makes the step's peak (the ``tiny`` preset,
fp32, 2 ranks, full checkpointing: the peak is in block 0's MLP backward): the block's kept input
allocated once, a calibrated unit's measured backward peak kept as measured, and the real step
(fake process group, FakeTensorMode) against the simulated one."""

from pathlib import Path

import pytest
from simtest import TINY_SCENARIO, real_step_peak, tiny_with_config

from sim.scenario.loader import load_scenario
from sim.simulate import build_step, scenario_profile, simulate

TINY = str(TINY_SCENARIO)  # fp32, 2 x 64 tokens, hidden 64
CPU = "cluster.profile=profiles/cpu-2x-gloo.json"  # compute (and bytes) calibrated on the tiny units


def _figures(*sets: str):  # type: ignore[no-untyped-def]
    s = load_scenario(TINY, list(sets))
    profile = scenario_profile(s)
    cfg = build_step(s, profile)[0]
    return profile, list(zip(cfg.segments, cfg.figures, strict=True))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_fp32_block_saves_its_input_as_it_is(dtype: str) -> None:
    """RMSNorm's ``to(float32)`` returns an fp32 input itself: what the block's first op saves of
    it is the block's input (2 x 64 tokens x 64 x 4 B), which a checkpointed block keeps anyway."""
    _, figures = _figures(f"precision.param_dtype={dtype}")
    first = [fig.block_input_saved_bytes for seg, fig in figures if seg.block is not None]
    assert first == [2 * 64 * 64 * 4 if dtype == "fp32" else 0] * 2


def test_the_recompute_allocates_the_blocks_saves_less_its_kept_input() -> None:
    result = simulate(load_scenario(TINY, ["checkpointing.mode=full"]))
    _, figures = _figures("checkpointing.mode=full")
    saved = {seg.unit: fig.saved_bytes for seg, fig in figures if seg.block is not None}
    recomputed = {
        m.label.split(":")[1]: m.delta_bytes
        for m in result.events.memory_of(0)
        if m.label.startswith("recomputed_activations:") and m.delta_bytes > 0
    }
    kept = {
        m.label.split(":")[1]: m.delta_bytes
        for m in result.events.memory_of(0)
        if m.label.startswith("block_input:") and m.delta_bytes > 0
    }
    assert recomputed == {unit: saved[unit] - kept[unit] for unit in saved}
    assert set(kept.values()) == {2 * 64 * 64 * 4}


def test_a_calibrated_units_backward_peak_is_the_measured_one() -> None:
    """The measured figure is the unit's peak above its start, net of what its backward frees: the
    segment's net figure is scaled to it, not each op's before the frees (which, once the MLP
    product's early release was modelled, came to 88 KB below it, 2026-12-07)."""
    profile, figures = _figures(CPU)
    assert profile.compute is not None
    units = profile.compute.units
    for seg, fig in figures:
        if seg.block is not None:
            assert fig.backward_transient_bytes == units["block"].backward_transient_bytes
        elif seg.name.startswith("model.norm"):
            assert fig.backward_transient_bytes == units["head"].backward_transient_bytes


@pytest.mark.parametrize(
    ("sets", "bound"),
    [(["checkpointing.mode=full"], 1e-3), (["checkpointing.mode=full", CPU], 5e-3)],
    ids=["analytic", "calibrated"],
)
def test_the_real_checkpointed_step_peaks_as_simulated(sets: list[str], bound: float) -> None:
    """2026-12-07: -0.06 % (analytic) and +0.36 % (calibrated on this machine's CPU units); before,
    +1.15 % and +1.57 % (the block's input allocated again by its recompute) and, with the MLP's
    backward peak modelled but the input still counted twice and the calibrated peak scaled op by
    op, -2.9 % calibrated."""
    row, _ = real_step_peak(TINY, sets)
    assert abs(row.predicted / row.measured - 1) <= bound


@pytest.mark.parametrize(
    ("sets", "held"),
    [
        (["checkpointing.mode=full"], [0]),
        (["checkpointing.mode=selective", "checkpointing.selective=2"], [1]),
        (["checkpointing.mode=full", "precision.param_dtype=bf16"], []),
    ],
    ids=["full", "every-2nd", "bf16"],
)
def test_a_checkpointed_blocks_input_its_maker_keeps_is_not_allocated_again(
    tmp_path: Path, sets: list[str], held: list[int]
) -> None:
    """fp32: the embedding's output (block 0's input) is saved by block 0's RMSNorm as it is, so
    the region that made it keeps it; where that region keeps its saves (the embedding's always,
    block 0 unless checkpointed) a checkpointed next block allocates no second copy of it. bf16:
    the norm saves its own fp32 copy, and the checkpoint's kept input is allocated."""
    result = simulate(load_scenario(tiny_with_config(tmp_path, "tiny-llama.json"), sets))
    checkpointed = sorted(result.step.checkpoint.blocks)
    allocated = {
        int(m.label.split(":")[1].rsplit(".", 1)[1])
        for m in result.events.memory_of(0)
        if m.label.startswith("block_input:") and m.delta_bytes > 0
    }
    assert allocated == set(checkpointed) - set(held)
    dtype_bytes = 2 if "precision.param_dtype=bf16" in sets else 4
    assert all(
        m.delta_bytes == 2 * 64 * 64 * dtype_bytes
        for m in result.events.memory_of(0)
        if m.label.startswith("block_input:") and m.delta_bytes > 0
    )


@pytest.mark.parametrize(
    "sets",
    [["checkpointing.mode=full"], ["checkpointing.mode=selective", "checkpointing.selective=2"]],
    ids=["full", "every-2nd"],
)
def test_the_real_checkpointed_step_of_a_described_fp32_model_peaks_as_simulated(
    tmp_path: Path, sets: list[str]
) -> None:
    """2026-12-07: -0.06 % and -0.05 %; before, +1.15 % and +0.96 % (the block's input counted
    by the embedding's, or block 0's, saves and again as the checkpoint's kept input)."""
    row, _ = real_step_peak(tiny_with_config(tmp_path, "tiny-llama.json"), sets)
    assert abs(row.predicted / row.measured - 1) <= 1e-3
