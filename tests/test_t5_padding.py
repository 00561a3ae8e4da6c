"""T5 with padded rows (``training.avg_seq_len`` below ``seq_len``): transformers' SDPA path folds
the collator's boolean mask into the float bias (``create_position_bias_mask``'s
``torch.where``), one per row, for the encoder's self-attention and the decoder's
cross-attention (whose keys are the encoder's tokens); the decoder's own causal calls, over the
labels, are not padded. The boolean masks are the stacks' (``stack_masks``); the encoder's, folded
into a learned bias, is kept by ``torch.where``'s backward until the encoder's first block has
run backward."""

from dataclasses import replace

import pytest
from simtest import real_step_peak, tiny_with_config

from sim.dtypes import FP32_BYTES
from sim.scenario.loader import load_scenario
from sim.schedule.activation_life import stack_mask_end, stack_mask_made
from sim.simulate import _workload, build_step
from sim.workload.attention_kernel import attention_kernel_figures, folded_bias_bytes, mask_path_bytes
from sim.workload.forward import layer_ops
from sim.workload.layers import StackMask, stack_masks
from sim.workload.shapes import AttentionShape, Workload

B, S, H, D = 2, 64, 4, 16  # scenarios/tiny.toml's 2 x 64 tokens; tiny-t5's 4 heads of 16
REAL = 40  # real tokens a row
PADDED = [f"training.avg_seq_len={REAL}"]
ENCODER, DECODER = [0, 1, 2], [3, 4]  # tiny-t5's blocks: 3 encoder, 2 decoder


@pytest.fixture(scope="module")
def t5_scenario(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("transformers")
    return tiny_with_config(tmp_path_factory.mktemp("t5"), "tiny-t5.json")


def _ops(scenario: str, sets: list[str], kernel: str = "math") -> tuple[tuple, Workload, object]:
    from validation.memory_only import matching_profile

    s = load_scenario(scenario, sets)
    w = _workload(s, matching_profile(s, kernel))
    return layer_ops(s.model, w), w, s.model


def test_the_encoders_and_the_cross_attentions_calls_fold_the_padding_into_their_bias(
    t5_scenario: str,
) -> None:
    """Every encoder and cross-attention call is given the padding, folded into a bias of one row
    per sequence; the decoder's causal self-attention, over the unpadded labels, keeps a bias
    broadcast over the batch; none is handed a boolean mask of its own (no converted mask)."""
    ops, w, _ = _ops(t5_scenario, PADDED)
    calls = {op.name: op.attention for op in ops if op.attention is not None}
    assert len(calls) == 7
    for name, a in calls.items():
        self_attn_of_decoder = name.startswith("decoder") and "SelfAttention" in name
        assert a.bias and not a.sdpa_bool_mask
        assert a.folds_mask is not self_attn_of_decoder
        assert a.bias_rows == (1 if self_attn_of_decoder else B)
    plain, _, _ = _ops(t5_scenario, [])
    assert all(op.attention.bias_rows == 1 for op in plain if op.attention is not None)


def test_the_stacks_build_one_boolean_mask_each(t5_scenario: str) -> None:
    """One B x S x S boolean mask for the encoder's blocks, kept for backward (its bias is
    learned: ``torch.where`` keeps the condition), and one for the decoder's cross-attention,
    built as the decoder starts and not kept (its zero bias needs no gradient); none unpadded."""
    ops, w, model = _ops(t5_scenario, PADDED)
    assert stack_masks(model, ops, w) == (
        StackMask(
            bytes=B * S * S, blocks=frozenset(ENCODER), stack_first=0, stack_last=2, kept_for_backward=True
        ),
        StackMask(
            bytes=B * S * S, blocks=frozenset(DECODER), stack_first=3, stack_last=4, kept_for_backward=False
        ),
    )
    plain, w_plain, _ = _ops(t5_scenario, [])
    assert stack_masks(model, plain, w_plain) == ()


@pytest.mark.parametrize("mode", ["none", "full"])
def test_each_mask_lives_from_its_stacks_start(t5_scenario: str, mode: str) -> None:
    """The schedule's rules on the padded step: the encoder's mask is built as block 0 starts and
    goes with block 0's backward, checkpointed or not; the cross-attention's is built as the
    decoder's first block starts and goes, unless a checkpointed block keeps it among its inputs,
    as the decoder's last block's forward ends (then with decoder block 0's backward)."""
    from validation.memory_only import matching_profile

    s = load_scenario(t5_scenario, [*PADDED, f"checkpointing.mode={mode}"])
    step, _, _ = build_step(s, matching_profile(s, "math"))
    segs = step.segments
    first = {b: min(i for i, g in enumerate(segs) if g.block == b) for b in ENCODER + DECODER}
    last = {b: max(i for i, g in enumerate(segs) if g.block == b) for b in ENCODER + DECODER}
    made = [[i for i in range(len(segs)) if stack_mask_made(step, k, i)] for k in (0, 1)]
    assert made == [[first[0]], [first[3]]]
    forward_end = [
        [i for i in range(len(segs)) if stack_mask_end(step, k, i, backward=False)] for k in (0, 1)
    ]
    backward_end = [
        [i for i in range(len(segs)) if stack_mask_end(step, k, i, backward=True)] for k in (0, 1)
    ]
    assert forward_end[0] == [] and backward_end[0] == [first[0]]
    if mode == "none":
        assert forward_end[1] == [last[4]] and backward_end[1] == []
    else:
        assert forward_end[1] == [] and backward_end[1] == [first[3]]


def test_a_call_holds_the_where_output_beyond_the_unpadded_calls_copy() -> None:
    """The math path (the CPU's): a learned bias's padded call holds B - 1 more heads x S x S
    (its ``where`` output's copy replaces the unpadded call's copy of the permuted bias); the zero
    cross-attention bias's call holds all B of them (nothing was copied before); at batch 1 the
    learned one holds nothing more. A fused kernel (the GPU's) keeps the bias one per row and
    holds the ``where`` output beside it in forward and its gradient beside the bias's in
    backward; the mask path moves the ``where``'s bytes."""
    learned = AttentionShape(
        batch=B, seq_len=S, heads=H, kv_heads=H, head_dim=D, causal=False, bias=True, bias_grad=True
    )
    zeros = replace(learned, bias_grad=False)
    per_row = H * S * S
    for a in (2, 4):
        assert folded_bias_bytes(replace(learned, padding_mask=True), a) == (B - 1) * per_row * a
        assert folded_bias_bytes(replace(zeros, padding_mask=True), a) == B * per_row * a
        assert folded_bias_bytes(replace(learned, padding_mask=True, batch=1), a) == 0
        assert folded_bias_bytes(replace(zeros, padding_mask=True, batch=1), a) == per_row * a
        assert folded_bias_bytes(learned, a) == folded_bias_bytes(zeros, a) == 0
        math = Workload(micro_batch=B, seq_len=S, act_bytes=a, attention_kernel="math", padded=True)
        for shape in (learned, zeros):
            padded = replace(shape, padding_mask=True)
            _, saved, fwd, bwd = attention_kernel_figures(padded, math)
            _, saved0, fwd0, bwd0 = attention_kernel_figures(shape, math)
            assert (saved, bwd) == (saved0, bwd0) and fwd - fwd0 == folded_bias_bytes(padded, a)
    fused = Workload(micro_batch=B, seq_len=S, act_bytes=2, attention_kernel="efficient", padded=True)
    padded = replace(learned, padding_mask=True)
    _, saved, fwd, bwd = attention_kernel_figures(padded, fused)
    _, saved0, fwd0, bwd0 = attention_kernel_figures(learned, fused)
    where = B * per_row * 2
    dq = B * S * H * D * FP32_BYTES
    assert saved - saved0 == (B - 1) * per_row * 2 and fwd - fwd0 == where
    assert bwd0 == dq + B * per_row * 2 and bwd == B * per_row * 2 + max(dq, where)
    forward, backward = mask_path_bytes(padded, fused)
    assert (
        forward == B * S * S + per_row * 2 + where + 2 * (where - per_row * 2)
        and backward == B * S * S + 2 * where
    )
    assert mask_path_bytes(learned, fused) == (0, 0)


def test_the_real_padded_t5_step_peaks_as_simulated(t5_scenario: str) -> None:
    """The real FSDP2 step (fake process group, FakeTensorMode, the CPU's math path; 2 ranks,
    fp32, 2 x 64 with a 64-token decoder, 40 real tokens a row), its peak at the loss's
    backward: the simulator's within 1,000 B (2026-12-07: 9,145,352 against 9,145,572 B, where
    the masks alone are 8,192 B each; before, 8,192 B low), and SDPA is handed no boolean mask."""
    padded, measured = real_step_peak(t5_scenario, PADDED)
    assert measured["kernels"]["attention_kernel"] == "math" and measured["kernels"]["attention_mask"] == []
    assert abs(padded.predicted - padded.measured) <= 1_000


def test_the_real_padded_t5_step_checkpointed_grows_as_simulated(t5_scenario: str) -> None:
    """Full checkpointing, where every block keeps its stack's mask among its inputs: what the
    padding adds to the peak is the simulator's to the byte (2026-12-07: 17,408 B, the two
    boolean masks and the collator's int64 mask; before, 1,024 B)."""
    ckpt = ["checkpointing.mode=full"]
    padded, _ = real_step_peak(t5_scenario, [*ckpt, *PADDED])
    plain, _ = real_step_peak(t5_scenario, ckpt)
    assert padded.measured - plain.measured == 2 * B * S * S + B * S * 8
    assert padded.predicted - plain.predicted == padded.measured - plain.measured
