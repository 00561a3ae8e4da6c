"""Tensor-sized allocations (issue 11, reserved memory): every byte figure of a described model
carries the tensors it is made of, the schedule allocates a segment's saved activations and
transients as those tensors, and the caching allocator's replay serves them one by one."""

import math
from pathlib import Path

import pytest
from simtest import elementwise_op

from sim.core.events import MemoryCategory, OpKind
from sim.scenario.loader import load_scenario
from sim.simulate import simulate

DATA = Path(__file__).parent / "data" / "hf"
FIGURES = ("saved", "forward_transient", "backward_transient", "checkpointed_forward")


def _eager_ckpt(tmp_path_factory, extra: str = ""):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("pieces")
    path = tmp / "s.toml"
    path.write_text(
        f'[model]\nconfig = "{DATA / "tiny-llama.json"}"\n[training]\nmicro_batch = 2\nseq_len = 256\n'
        'attention = "eager"\n[parallel]\nworld_size = 4\n[precision]\nparam_dtype = "bf16"\n'
        'reduce_dtype = "fp32"\n[checkpointing]\nmode = "full"\n' + extra
    )
    return simulate(load_scenario(path))


@pytest.fixture(scope="module")
def eager_ckpt(tmp_path_factory):  # type: ignore[no-untyped-def]
    """tiny-llama (4 heads, 2 KV heads), 2 x 256 tokens, bf16, eager attention, every block
    checkpointed."""
    return _eager_ckpt(tmp_path_factory)


@pytest.fixture(scope="module")
def zero3_ckpt(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The same under DeepSpeed ZeRO-3, whose schedule issues its own recompute."""
    return _eager_ckpt(tmp_path_factory, "[deepspeed]\nenabled = true\nstage = 3\n")


def test_every_figure_is_accounted_for_by_its_tensors(eager_ckpt) -> None:  # type: ignore[no-untyped-def]
    """The measured pieces sum to each figure to the byte (a mismatch would fall back to one
    block, so the check is on the pieces themselves), and a block's ops have them."""
    for op in eager_ckpt.layer_ops:
        for figure in FIGURES:
            nbytes = getattr(op, f"{figure}_bytes") or 0
            pieces = getattr(op, f"{figure}_pieces")
            assert all(n > 0 for n in pieces)
            if op.block is not None and nbytes:
                assert pieces and sum(pieces) == nbytes, (op.name, figure, nbytes, pieces)


def test_the_eager_attention_keeps_its_score_tensors_apart(eager_ckpt) -> None:  # type: ignore[no-untyped-def]
    """The eager path keeps the fp32 softmax (4 B a score) and its bf16 cast (2 B) as two tensors
    of 2 x 4 heads x 256 x 256 scores, not one 6-byte block; a checkpointed block's forward holds
    them as such."""
    scores = 2 * 4 * 256 * 256
    attention = next(op for op in eager_ckpt.layer_ops if op.attention is not None and op.block == 0)
    assert scores * 4 in attention.saved_pieces and scores * 2 in attention.saved_pieces
    assert scores * 4 in attention.checkpointed_forward_pieces
    segments = zip(eager_ckpt.step.segments, eager_ckpt.step.figures, strict=True)
    figure = next(f for s, f in segments if s.block == 0)
    assert scores * 4 in figure.tensors("checkpointed_forward")
    assert sum(figure.tensors("checkpointed_forward")) == figure.checkpointed_forward_bytes


def test_the_schedule_allocates_the_tensors(eager_ckpt) -> None:  # type: ignore[no-untyped-def]
    """Block 0's checkpointed forward allocates its activations as the measured tensors (the
    memory curve sees their sum), and the recompute its saves as the saved tensors."""
    scores = 2 * 4 * 256 * 256
    ops = eager_ckpt.program.ops
    forward = next(op for op in ops if op.kind.value == "forward" and "layers.0" in op.unit)
    acts = next(a for a in forward.allocs if a.label.startswith("activations"))
    assert len(acts.pieces) > 1 and scores * 4 in acts.pieces and acts.category is MemoryCategory.ACTIVATIONS
    recompute = next(op for op in ops if op.kind.value == "recompute" and "layers.0" in op.unit)
    saved = next(a for a in recompute.allocs if a.label.startswith("recomputed_activations"))
    assert sum(saved.pieces) == saved.bytes and scores * 2 in saved.pieces
    records = [m for m in eager_ckpt.events.memory_of(0) if m.label == acts.label and m.delta_bytes > 0]
    assert records and records[0].pieces == acts.pieces and records[0].delta_bytes == acts.bytes


def test_zero3s_recompute_allocates_the_tensors_too(zero3_ckpt) -> None:  # type: ignore[no-untyped-def]
    """ZeRO-3's own recompute saves each segment's activations and holds its transient as the
    measured tensors, as the shared schedule's does (and a block ending in a parameterless op, the
    residual add, is recomputed before that op's backward)."""
    assert zero3_ckpt.scenario.deepspeed.enabled and zero3_ckpt.scenario.deepspeed.stage == 3
    figures = {s.name: f for s, f in zip(zero3_ckpt.step.segments, zero3_ckpt.step.figures, strict=True)}
    recomputes = [op for op in zero3_ckpt.program.ops if op.kind.value == "recompute"]
    assert recomputes
    for op in recomputes:
        figure = figures[op.name]
        saved = next(a for a in op.allocs if a.label.startswith("recomputed_activations"))
        temp = next(a for a in op.allocs if a.label.startswith("recompute_temp"))
        assert saved.pieces == figure.tensors("saved") and sum(saved.pieces) == saved.bytes
        assert temp.pieces == figure.tensors("forward_transient")
    assert any(len(op.allocs[0].pieces) > 1 for op in recomputes)


def test_a_backward_holds_the_gradients_its_later_ops_made() -> None:
    """``SegmentFigures.backward_held``: at each op the transient beyond the saved bytes plus the
    gradients of the ops after it (already run in backward), at their share of what the system
    keeps; the largest wins, made of the op's tensors and one gradient per parameter."""
    from sim.costs.compute import BackwardStep, SegmentFigures

    fig = SegmentFigures(
        forward_s=0.0,
        backward_s=0.0,
        recompute_s=0.0,
        saved_bytes=0,
        forward_transient_bytes=0,
        backward_transient_bytes=900,
        backward_transient_pieces=(600, 300),
        backward_steps=(
            BackwardStep(beyond_saved_bytes=500, pieces=(500,), later_grad_numels=(100, 200)),
            BackwardStep(beyond_saved_bytes=900, pieces=(600, 300), later_grad_numels=(200,)),
            BackwardStep(beyond_saved_bytes=50, later_grad_numels=()),
        ),
        grad_numel=350,  # the last op's own 50 elements are not yet made at any step
    )
    # 2 bytes an element: step 0 holds 500 + 600, step 1 900 + 400, step 2 50
    assert fig.backward_held(700) == (1300, (600, 300, 400))
    assert fig.backward_held(0) == (900, (600, 300))  # no gradients kept (frozen, later micro-batch)
    # at 8 bytes an element the first op wins: one tensor for its transient, one per gradient
    assert fig.backward_held(2800) == (500 + 2400, (500, 800, 1600))


def test_saves_are_freed_by_their_first_savers_backward() -> None:
    """``ComputeCosts.figures``: the schedule holds a segment's saved bytes through its backward;
    beyond them, op j holds its transient less what backwards after it freed of those saves: its
    later ops' own saves, a save whose first saver is a later op of the segment from that op's
    backward on, and one whose first saver is in a later segment from the start."""
    from sim.costs.compute import ComputeCosts, Roofline
    from sim.workload.layer_op import LayerOp
    from sim.workload.units import Segment

    def op(name: str, saved: int, transient: int, ahead: tuple[tuple[int, int], ...] = ()) -> LayerOp:
        return elementwise_op(
            name, saved_bytes=saved, saved_released_ahead=ahead, backward_transient_bytes=transient
        )

    costs = ComputeCosts(
        kernels=Roofline(flops_per_s=1e12, hbm_Bps=1e12),
        attention_kernel="sdpa",
        copy_Bps=1e12,
        optimizer_s_per_element=0.0,
    )
    # a's 100 saved bytes: 60 its own, 30 freed by c's backward (2 ahead), 10 by an op past the end
    ops = (op("a", 100, 10, ((2, 30), (5, 10))), op("b", 20, 500), op("c", 40, 50))
    steps = costs.figures(Segment(unit="u", ops=ops)).backward_steps
    # c runs first: only the 10 freed elsewhere; b: c's 40 and the 30 too; a: b's 20 besides
    assert [s.beyond_saved_bytes for s in steps] == [10 - 10 - 30 - 40 - 20, 500 - 10 - 30 - 40, 50 - 10]
    assert costs.figures(Segment(unit="u", ops=ops)).backward_transient_bytes == 420
    # without the measurement each op's saves are its own: as the hand-written ops are counted
    plain = tuple(op(o.name, o.saved_bytes, o.backward_transient_bytes) for o in ops)
    assert [s.beyond_saved_bytes for s in costs.figures(Segment(unit="u", ops=plain)).backward_steps] == [
        10 - 60,
        500 - 40,
        50,
    ]


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_foreach_adamws_temporaries_are_one_per_tensor_it_steps(fsdp_version: int) -> None:
    """``torch._foreach_sqrt(exp_avg_sqs)``: one temporary per tensor, each its tensor's size:
    FSDP1's flat-parameter shards (one per unit), FSDP2's local shards (one per parameter)."""
    from sim.schedule.model_state import numel_per_rank

    root = Path(__file__).resolve().parent.parent
    result = simulate(
        load_scenario(root / "scenarios" / "tiny.toml", [f"parallel.fsdp_version={fsdp_version}"])
    )
    step = result.step
    (op,) = [o for o in result.program.ops if o.kind is OpKind.OPTIMIZER]
    (temp,) = op.allocs
    w = step.shard_size
    if fsdp_version == 1:
        expected = [step.padded_numel(u) // w * 4 for u in step.units]
    else:
        expected = [
            math.ceil(p.shape[0] / w) * w * math.prod(p.shape[1:]) // w * 4
            for u in step.units
            for p in u.params
        ]
    assert list(temp.pieces) == expected and len(expected) > 1
    assert temp.bytes == numel_per_rank(step) * 4
