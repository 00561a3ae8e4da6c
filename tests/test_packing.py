"""Packed rows (``training.avg_doc_len`` below ``seq_len``): documents whose positions restart at
each, as transformers' ``DataCollatorWithFlattening`` passes them. The collator's int64
``position_ids`` are held beside the token ids, the rotary tables are made per row, and without a
KV cache transformers finds the packed sequences in the positions and gives SDPA their
block-diagonal causal mask: ``is_causal`` off, k and v copied to every query head, and on a GPU
memory-efficient attention over every pair (``AttentionShape.document_mask``)."""

from dataclasses import replace
from pathlib import Path

import pytest
from simtest import real_step_peak, tiny_with_config

from sim.errors import UserError
from sim.hardware.registry import builtin_devices, load_profile
from sim.scenario.loader import load_scenario
from sim.simulate import _workload
from sim.workload.forward import COLLATOR_INPUT_TENSOR, layer_ops
from sim.workload.layer_op import LayerKind
from sim.workload.layers import stack_masks
from sim.workload.shapes import AttentionShape, Workload, row_masks_for

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "scenarios" / "tiny.toml")
PACKING = str(ROOT / "scenarios" / "packing-vs-padding-7b.toml")
B, S, D = 2, 64, 16  # scenarios/tiny.toml: 2 x 64 tokens, head dimension 16, fp32
PACKED = ("training.avg_doc_len=16",)


def _ops(scenario: str, *sets: str) -> tuple[tuple, Workload]:
    s = load_scenario(scenario, list(sets))
    w = _workload(s, load_profile(s.cluster.profile, where="test"))
    return layer_ops(s.model, w), w


def _rotary_saved(ops: tuple) -> int:
    return sum(op.saved_bytes for op in ops if op.kind is LayerKind.ROTARY)


def test_packed_rows_are_checked_in_one_line() -> None:
    """avg_doc_len within [1, seq_len]; not beside padding (packed rows are full); not for an
    encoder-decoder (T5's positions are its relative bias)."""
    for bad in ("training.avg_doc_len=0", "training.avg_doc_len=65"):
        with pytest.raises(
            UserError, match=r"training\.avg_doc_len must be in \[1, training\.seq_len = 64\]"
        ):
            load_scenario(TINY, [bad])
    with pytest.raises(UserError, match="exclude each other"):
        load_scenario(TINY, [*PACKED, "training.avg_seq_len=40"])
    with pytest.raises(UserError, match="encoder-decoder"):
        load_scenario(str(ROOT / "scenarios" / "seed-t5-fsdp1.toml"), ["training.avg_doc_len=64"])
    whole = load_scenario(TINY, ["training.avg_doc_len=64"])  # one document a row: not packed
    assert not whole.training.packed and not whole.document_mask


def test_the_document_mask_needs_no_cache_and_a_current_transformers() -> None:
    """transformers looks for packed sequences only without a KV cache, and before 4.36 (the
    legacy output format) never: there the rows' attention crosses their documents."""
    assert load_scenario(TINY, list(PACKED)).document_mask
    assert not load_scenario(TINY, [*PACKED, "model.use_cache=true"]).document_mask
    legacy = [*PACKED, "model.output_format=legacy", "training.attention=eager"]
    assert not load_scenario(TINY, legacy).document_mask
    w = Workload(
        micro_batch=B, seq_len=S, act_bytes=4, attention_kernel="flash", packed=True, document_mask=True
    )
    assert row_masks_for(w, bias=False, softcap=False) == (False, True)
    assert row_masks_for(w, bias=True, softcap=False) == (False, False)
    assert row_masks_for(w, bias=False, softcap=True) == (False, False)
    assert row_masks_for(replace(w, document_mask=False), bias=False, softcap=False) == (False, False)


def test_the_positions_and_the_rotary_tables_come_per_row() -> None:
    """The preset: cos and sin of B rows of positions (2 x 2 x 64 x 16 x 4 B) where unpacked rows
    share one; the collator's positions (B x S int64) the embedding's first kept tensor; one
    boolean mask of B x S x S for both blocks, and every call given it."""
    plain, _ = _ops(TINY)
    packed, w = _ops(TINY, *PACKED)
    assert w.packed and w.document_mask and w.position_rows == B
    assert _rotary_saved(plain) == 2 * S * D * 4 and _rotary_saved(packed) == B * _rotary_saved(plain)
    embed = next(op for op in packed if op.kind is LayerKind.EMBED)
    plain_embed = next(op for op in plain if op.kind is LayerKind.EMBED)
    assert embed.saved_bytes - plain_embed.saved_bytes == B * S * 8 == embed.saved_pieces[0]
    model = load_scenario(TINY, []).model
    masks = stack_masks(model, packed, w)
    assert [(m.bytes, sorted(m.blocks)) for m in masks] == [(B * S * S, [0, 1])]
    calls = [op.attention for op in packed if op.attention is not None]
    assert calls and all(a.document_mask and a.sdpa_bool_mask and not a.padding_mask for a in calls)
    assert stack_masks(model, plain, _ops(TINY)[1]) == ()


def test_a_described_models_measured_rotary_op_scales_with_the_rows(tmp_path: Path) -> None:
    """tiny-llama described: every figure and request of the measured rotary op times B; the
    collator's positions are the first request of the embedding."""
    pytest.importorskip("transformers")
    scenario = tiny_with_config(tmp_path, "tiny-llama.json")
    plain, _ = _ops(scenario)
    packed, _ = _ops(scenario, *PACKED)
    (one,) = [op for op in plain if op.kind is LayerKind.ROTARY]
    (rows,) = [op for op in packed if op.kind is LayerKind.ROTARY]
    assert (
        rows.saved_bytes == B * one.saved_bytes
        and rows.forward_transient_bytes == B * one.forward_transient_bytes
    )
    assert rows.forward_requests == tuple((t, B * n) for t, n in one.forward_requests)
    embed = next(op for op in packed if op.kind is LayerKind.EMBED)
    assert embed.forward_requests[0] == (COLLATOR_INPUT_TENSOR, -B * S * 8)


@pytest.mark.parametrize(
    ("config", "sets", "masked"),
    [
        ("tiny-llama.json", (), True),
        ("tiny-gemma3.json", (), True),
        ("tiny-llama.json", ("model.use_cache=true",), False),
        ("tiny-llama.json", ("checkpointing.mode=full",), True),
    ],
)
def test_the_real_packed_step_grows_as_simulated(
    tmp_path: Path, config: str, sets: tuple, masked: bool
) -> None:
    """The real FSDP2 step (fake process group, FakeTensorMode; 2 ranks, fp32, 2 x 64, documents
    of 16 tokens) against the same step unpacked: what packing adds to the peak is the
    simulator's to the byte (2026-12-07: tiny-llama 140,288 B, the mask, copies, converted masks,
    the collator's positions and the rotary tables per row; Gemma 3 82,944 B; with a KV cache
    no mask, 9,216 B, and SDPA keeps ``is_causal``). Under full checkpointing the unpacked step's
    blocks also hold the model's own ``arange`` positions (1 x 64 int64) among their recompute's
    inputs, which the simulator does not count (part of that step's -0.06 %): the packed step
    makes none, so the measured growth is that much smaller than the predicted."""
    pytest.importorskip("transformers")
    scenario = tiny_with_config(tmp_path, config)
    packed, measured = real_step_peak(scenario, [*sets, *PACKED])
    plain, measured_plain = real_step_peak(scenario, list(sets))
    assert (measured["kernels"]["attention_mask"] == ["mask"]) == masked
    assert "is_causal" in measured_plain["kernels"]["attention_mask"]
    own_positions = S * 8 if "checkpointing.mode=full" in sets else 0
    assert packed.measured > plain.measured
    assert packed.predicted - plain.predicted == packed.measured - plain.measured + own_positions
    assert abs(packed.predicted / packed.measured - 1) <= 1e-3


def test_on_a_gpu_packed_documents_run_memory_efficient_attention_like_padding() -> None:
    """Llama-2-7B at 1 x 2,048 on the H100: a call given the documents' mask is timed as a padded
    one (memory-efficient attention over every pair), slower than flash's causal call; the
    report says why and the packing."""
    from sim.costs.gpu import kernel_model
    from sim.outputs.report import build_report
    from sim.simulate import simulate

    model = kernel_model(builtin_devices()["h100-sxm"], "bf16", builtin_devices())
    causal = AttentionShape(batch=1, seq_len=2048, heads=32, kv_heads=32, head_dim=128)
    documents = model.attention_s(replace(causal, document_mask=True), "flash")
    assert documents == model.attention_s(replace(causal, padding_mask=True), "flash")
    assert documents[0] > 2 * model.attention_s(causal, "flash")[0]
    sets = ["training.micro_batch=1", "training.avg_seq_len=2048"]
    scenario = load_scenario(PACKING, [*sets, "training.avg_doc_len=512"])
    built = build_report(simulate(scenario, load_profile(scenario.cluster.profile, where="test")))
    report = built.to_json()
    from sim.outputs.report_text import format_table

    text = format_table(built)
    assert "packing       4.0 documents of 512 tokens per row, positions restarting: SDPA given their" in text
    assert "32 of 32 calls given a mask (documents): memory-efficient attention over every pair" in text
    assert report["attention"]["masked_by"] == ["documents"] and report["attention"]["masked_calls"] == 32
    assert report["packing"]["documents_per_row"] == 4.0 and report["packing"]["document_mask"]
    cached = load_scenario(PACKING, [*sets, "training.avg_doc_len=512", "model.use_cache=true"])
    cached_report = build_report(
        simulate(cached, load_profile(cached.cluster.profile, where="test"))
    ).to_json()
    assert not cached_report["packing"]["document_mask"] and cached_report["attention"]["masked_calls"] == 0
    assert "crosses the documents" in cached_report["packing"]["note"]


def test_the_tuners_halved_sequence_keeps_the_documents_within_the_rows() -> None:
    """The fix-it search halves seq_len; a mean document or real length above the half is halved
    with it, so that the changed scenario loads (its documents within its rows)."""
    from sim.study.tune.fix import candidate_changes

    base = load_scenario(TINY, ["training.avg_doc_len=48"])
    (halved,) = [c for c in candidate_changes(base) if c.what.startswith("sequence length")]
    assert halved.overrides == ("training.seq_len=32", "training.avg_doc_len=32")
    assert load_scenario(TINY, ["training.avg_doc_len=48", *halved.overrides]).training.seq_len == 32
    short = load_scenario(TINY, ["training.avg_doc_len=16"])
    (kept,) = [c for c in candidate_changes(short) if c.what.startswith("sequence length")]
    assert kept.overrides == ("training.seq_len=32",)


def test_a_model_without_rotary_tables_is_refused_packed_rows() -> None:
    """Packing scales the rotary tables per row; a model whose positions take another path (a
    learned embedding) is refused in one line rather than simulated without it."""
    s = load_scenario(TINY, list(PACKED))
    w = _workload(s, load_profile(s.cluster.profile, where="test"))
    from sim.workload.forward import _with_row_positions

    ops = tuple(op for op in layer_ops(s.model, replace(w, packed=False)) if op.kind is not LayerKind.ROTARY)
    with pytest.raises(UserError, match=r"training\.avg_doc_len: .* model tiny has none"):
        _with_row_positions(ops, w, "tiny")
