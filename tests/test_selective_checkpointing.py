"""Selective activation checkpointing as torchtitan applies it: the op-level policy and every N-th
block, in time and memory, the memory checked against real FSDP2 with the real policy (fake
process group, ``fsdpsim validate --memory-only``)."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sim.errors import UserError
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.simulate import simulate
from sim.workload.checkpointing import checkpoint_plan
from sim.workload.options import CheckpointMode
from validation.fake_memory_child import measure_fake_memory_subprocess
from validation.memory_only import compare_memory

ROOT = Path(__file__).resolve().parent.parent
FIVE_M = str(ROOT / "scenarios" / "validate-cpu.toml")  # llama-5m: 4 blocks
SEVEN_B = str(ROOT / "scenarios" / "llama2-7b-8xh100-zero3.toml")
MODES = {
    "none": ["checkpointing.mode=none"],
    "full": ["checkpointing.mode=full"],
    "op": ["checkpointing.mode=selective", "checkpointing.selective=op"],
    "every 1": ["checkpointing.mode=selective", "checkpointing.selective=1"],
    "every 2": ["checkpointing.mode=selective", "checkpointing.selective=2"],
}


def _report(sets: list[str]):  # type: ignore[no-untyped-def]
    return build_report(simulate(load_scenario(SEVEN_B, sets)))


def test_every_nth_block_follows_torchtitans_count() -> None:
    """torchtitan counts wrapped blocks from 1 and checkpoints those whose count N divides."""
    assert checkpoint_plan(CheckpointMode.SELECTIVE, 2, 6).blocks == {1, 3, 5}
    assert checkpoint_plan(CheckpointMode.SELECTIVE, 3, 6).blocks == {2, 5}
    assert checkpoint_plan(CheckpointMode.SELECTIVE, 1, 6) == checkpoint_plan(CheckpointMode.FULL, "op", 6)
    assert not checkpoint_plan(CheckpointMode.NONE, "op", 6).active
    plan = checkpoint_plan(CheckpointMode.SELECTIVE, "op", 6)
    assert plan.selective_op and plan.blocks == set(range(6))


def test_time_and_memory_order_between_none_and_full() -> None:
    r = {name: _report(sets) for name, sets in MODES.items()}
    assert r["every 1"].to_json() == r["full"].to_json()  # every block is full checkpointing
    for partial in ("op", "every 2"):
        assert r["none"].step_time_s < r[partial].step_time_s < r["full"].step_time_s
        assert r["full"].peak_memory_bytes < r[partial].peak_memory_bytes < r["none"].peak_memory_bytes
    # HFU counts the recomputed forward, MFU does not
    assert r["none"].hfu == r["none"].mfu
    assert r["none"].mfu > r["op"].mfu and r["op"].hfu > r["op"].mfu
    assert r["full"].hfu > r["op"].hfu > r["op"].mfu


def test_a_bad_selective_value_is_one_clear_line() -> None:
    with pytest.raises(
        UserError, match=r'checkpointing\.selective = 0 is not allowed; allowed: "op" or a positive'
    ):
        load_scenario(SEVEN_B, ["checkpointing.mode=selective", "checkpointing.selective=0"])


@pytest.mark.slow
def test_memory_matches_real_fsdp2_with_the_real_policy() -> None:
    """Real FSDP2 on llama-5m at 8 ranks (fake process group), torchtitan's policy applied to the
    real decoder layers: the simulated peak within 1 %."""
    cases = {name: [*MODES[name], "parallel.world_size=8"] for name in ("op", "every 2")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            n: pool.submit(measure_fake_memory_subprocess, FIVE_M, sets, 300.0) for n, sets in cases.items()
        }
        measured = {n: f.result() for n, f in futures.items()}
    for name, sets in cases.items():
        comparison = compare_memory(load_scenario(FIVE_M, sets), measured[name])
        peak = comparison.rows[0]
        assert peak.metric == "peak memory"
        assert abs(peak.error or 0.0) <= 0.01, (name, peak)
