"""FSDP2 gradient accumulation without sync (``training.sync_every_microbatch = false``,
``set_requires_gradient_sync(False)``): where the simulated step keeps the gradients across
micro-batches (``sim.schedule.fsdp2_reduce``), and the real step (fake process group,
FakeTensorMode, 2 ranks of llama-5m, 2 micro-batches of 1 x 32, checkpointed, fused AdamW)
against it.

Without a cast to ``reduce_dtype`` the kept gradients are the unsharded parameters' own
``.grad``, to which autograd adds each later micro-batch's gradient in place; with one (bf16
reduced in fp32) they are an fp32 copy, and each later backward's bf16 gradients live until its
post-backward adds them in."""

from pathlib import Path

import pytest

from sim.core.events import MemoryCategory
from sim.scenario.loader import load_scenario
from sim.simulate import simulate
from validation.fake_memory_child import measure_fake_memory_subprocess
from validation.memory_only import compare_memory

ROOT = Path(__file__).resolve().parent.parent
FIVE_M = str(ROOT / "scenarios" / "validate-cpu.toml")  # llama-5m (hidden 256, vocab 4096)
NO_SYNC = [
    "parallel.world_size=2",
    "training.micro_batch=1",
    "training.seq_len=32",
    "training.grad_accum=2",
    "training.sync_every_microbatch=false",
    "checkpointing.mode=full",
    "optimizer.implementation=fused",
]
BF16_FP32 = ["precision.param_dtype=bf16", "precision.reduce_dtype=fp32"]
FP32 = ["precision.param_dtype=fp32", "precision.reduce_dtype=fp32"]
BF16 = ["precision.param_dtype=bf16", "precision.reduce_dtype=bf16"]


def _grad_records(sets: list[str]) -> list[tuple[str, int, int]]:
    """Rank 0's gradient allocations and frees: (label prefix, micro-batch, bytes)."""
    result = simulate(load_scenario(FIVE_M, [*NO_SYNC, *sets]))
    return [
        (m.label.split(":")[0], int(m.label.split(":")[2].removeprefix("mb")), m.delta_bytes)
        for m in result.events.memory_of(0)
        if m.category is MemoryCategory.GRADS and m.label.split(":")[0] != "sharded_grads"
    ]


def test_without_a_cast_the_first_backwards_gradients_are_kept_and_later_ones_add_in_place() -> None:
    records = _grad_records(FP32)
    made = [(kind, mb) for kind, mb, delta in records if delta > 0]
    assert {kind for kind, _ in made} == {"unsharded_grads", "held_grad"}  # no copy to accumulate into
    assert {mb for _, mb in made} == {0}  # the second backward makes no gradient buffer of its own
    freed = sum(-delta for _, _, delta in records if delta < 0)
    assert freed == sum(delta for _, _, delta in records if delta > 0)  # each freed once, at the reduction
    # every parameter's gradient, in fp32: 4096 x 256 twice (embedding, head), the final norm, 4 blocks
    blocks = 4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256)
    assert sum(delta for _, _, delta in records if delta > 0) == 4 * (2 * 4096 * 256 + 256 + blocks)


def test_with_a_cast_the_kept_gradients_are_a_copy_and_each_backward_makes_its_own() -> None:
    records = _grad_records(BF16_FP32)
    made = {(kind, mb) for kind, mb, delta in records if delta > 0}
    assert ("accumulated_grads", 0) in made and ("unsharded_grads", 1) in made
    assert not any(kind == "accumulated_grads" and mb == 1 for kind, mb in made)


# the head's backward makes the peak: its new weight gradient beside the logits' and its input's,
# before autograd adds it into the kept one
HEAD_PEAK = ["checkpointing.mode=none", "training.micro_batch=2", "training.seq_len=64"]


@pytest.mark.parametrize(
    "sets",
    [BF16_FP32, FP32, BF16, [*FP32, *HEAD_PEAK]],
    ids=["bf16-fp32-reduce", "fp32", "bf16", "fp32-head-peak"],
)
def test_the_real_no_sync_step_peaks_as_simulated(sets: list[str]) -> None:
    """Within 0.1 % of the real step (2026-12-07: -0.028, -0.046, -0.033 and -0.002 %). Before,
    -0.24 % (the preset's RMSNorm backward held nothing beyond what it freed; the peak is in a
    checkpointed block's backward), +0.44 and +1.76 % (a later backward's gradients held as buffers
    of their own until post-backward, where autograd adds them in place) and -0.17 % (the gradient
    being added in place not held while its op runs, nor the head's backward its logits')."""
    sets = [*NO_SYNC, *sets]
    measured = measure_fake_memory_subprocess(FIVE_M, sets, 300.0)
    row = compare_memory(load_scenario(FIVE_M, sets), measured).rows[0]
    assert abs(row.predicted / row.measured - 1) <= 1e-3
