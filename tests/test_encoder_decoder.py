"""Encoder-decoder models (T5) from their config: two stacks of wrap units, cross-attention, the
decoder's own sequence length, the shared embedding, the encoder output kept once (issue 14)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from simtest import make_profile, make_scenario

from sim.dtypes import FP32_BYTES
from sim.errors import UserError
from sim.scenario.loader import load_scenario
from sim.simulate import simulate
from sim.workload.attention_kernel import attention_kernel_figures
from sim.workload.checkpointing import block_input_bytes
from sim.workload.description import parse_description
from sim.workload.forward import layer_ops
from sim.workload.layers import stack_masks
from sim.workload.model import ModelConfig
from sim.workload.options import WrapPolicy
from sim.workload.shapes import AttentionShape, Workload
from sim.workload.units import ROOT, build_segments, build_units, gradient_params

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parent / "data" / "hf"
CONFIG = DATA / "tiny-t5.json"  # 3 encoder and 2 decoder T5Blocks, d_model 64, 4 heads of 16
B, S, T, H, D, A = 2, 32, 16, 4, 64, 2  # micro-batch, encoder and decoder tokens, heads, d_model, bf16
ENCODER = [f"encoder.block.{i}" for i in range(3)]
DECODER = [f"decoder.block.{i}" for i in range(2)]


@pytest.fixture(scope="module")
def t5() -> ModelConfig:
    from hfmodel.describe import describe

    data = describe(
        json.loads(CONFIG.read_text()),
        micro_batch=B,
        seq_len=S,
        dtype="bf16",
        name="tiny-t5",
        decoder_seq_len=T,
    )
    return ModelConfig.of(parse_description(json.loads(json.dumps(data)), str(CONFIG)))


def _workload(kernel: str = "flash") -> Workload:
    return Workload(micro_batch=B, seq_len=S, decoder_seq_len=T, act_bytes=A, attention_kernel=kernel)


def test_two_stacks_of_units_in_forward_order(t5: ModelConfig) -> None:
    """The wrap units are the T5Blocks, the encoder's then the decoder's; the root holds the rest,
    whose ops run before, between (the encoder's final norm, the decoder's embedding) and after them."""
    units = build_units(t5, WrapPolicy.BLOCK)
    assert [u.name for u in units] == [*ENCODER, *DECODER, ROOT]
    segments = build_segments(layer_ops(t5, _workload()), units)
    assert [s.unit for s in segments] == [ROOT, *ENCODER, ROOT, *DECODER, ROOT]
    between = [op.module for op in segments[4].ops]
    assert between[0] == "encoder.final_layer_norm" and "decoder.embed_tokens" in between
    assert t5.n_layers == 5 and [s.block for s in segments if s.unit != ROOT] == [0, 1, 2, 3, 4]


def test_attention_calls_have_their_own_queries_and_keys(t5: ModelConfig) -> None:
    """Encoder self-attention over the encoder's tokens (bidirectional, learned bias), decoder
    self-attention over the decoder's (causal), cross-attention from the decoder's queries to the
    encoder's keys (its zero bias needs no gradient); T5 trains with attention dropout 0.1."""
    calls = {}
    for op in layer_ops(t5, _workload()):
        if op.attention is not None:
            kind = op.module.rsplit(".", 1)[-1]
            calls.setdefault((op.block, kind), op.attention)
    enc, dec, cross = calls[(0, "SelfAttention")], calls[(3, "SelfAttention")], calls[(3, "EncDecAttention")]
    assert (enc.seq_len, enc.kv_len, enc.causal, enc.bias_grad) == (S, S, False, True)
    assert (dec.seq_len, dec.kv_len, dec.causal, dec.bias_grad) == (T, T, True, True)
    assert (cross.seq_len, cross.kv_len, cross.causal, cross.bias, cross.bias_grad) == (
        T,
        S,
        False,
        True,
        False,
    )
    assert enc.dropout == dec.dropout == cross.dropout == pytest.approx(0.1)
    assert len(calls) == 3 + 2 * 2


def test_cross_attention_kernel_bytes() -> None:
    """The fused kernel keeps q and the output at the decoder's tokens, k and v at the encoder's,
    the fp32 log-sum-exp per query and head, and the bias (its keys padded to 16); the math path
    fp32 q, k, v, the fp32 softmax and, with dropout, its mask and the dropped probabilities."""
    cross = AttentionShape(
        batch=B,
        seq_len=T,
        heads=H,
        kv_heads=H,
        head_dim=16,
        causal=False,
        kv_seq_len=S,
        dropout=0.1,
        bias=True,
    )
    tq, tk, scores = B * T, B * S, B * H * T * S
    flops, saved, fwd, bwd = attention_kernel_figures(cross, _workload())
    assert flops == 4.0 * tq * S * H * 16
    assert saved == tq * (A * 64 + A * 64 + FP32_BYTES * H) + tk * A * 2 * 64 + H * T * S * A
    assert (fwd, bwd) == (0, tq * 64 * FP32_BYTES)  # no bias gradient: T5's cross-attention bias is zeros
    _, saved, fwd, bwd = attention_kernel_figures(cross, _workload("math"), output_saved=False)
    assert saved == FP32_BYTES * (tq * 64 + tk * 2 * 64) + scores * 3 * FP32_BYTES
    # forward: the low-precision copy of the scores and, with dropout, fp32 q (the decoder's
    # tokens), k (the encoder's) and the output (the decoder's) beside it
    assert (fwd, bwd) == (scores * A + FP32_BYTES * (tq * 64 + tk * 64 + tq * 64), scores * FP32_BYTES)
    learned = AttentionShape(batch=B, seq_len=S, heads=H, kv_heads=H, head_dim=16, bias=True, bias_grad=True)
    _, _, _, bwd = attention_kernel_figures(learned, _workload("math"), output_saved=False)
    # the bias's gradient is made after the score gradient's peak, when the saves are gone
    assert bwd == B * H * S * S * FP32_BYTES


def test_the_encoder_output_is_kept_once_for_every_decoder_block(t5: ModelConfig) -> None:
    """Every decoder block's cross-attention k and v projections save the encoder's output; it is
    one storage, counted once where the encoder made it, and freed after the decoder's backward."""
    d = t5.description
    assert d is not None
    kv = [op for op in d.ops if op.module.endswith(("EncDecAttention.k", "EncDecAttention.v"))]
    assert len(kv) == 4 and all(op.saved_bytes == 0 for op in kv)
    encoder_tail = [op for op in d.ops if op.block is None and op.module.startswith("encoder.")]
    assert sum(op.saved_bytes for op in encoder_tail) >= B * S * D * A


def test_the_shared_embedding_is_one_root_parameter_with_its_gradient_at_the_head(t5: ModelConfig) -> None:
    """T5 ties the encoder's and decoder's embeddings and the head to ``shared``: one parameter
    of the root unit, owned by the first op that uses it (the encoder's lookup); its gradient
    appears at the head's backward, the first that reaches it."""
    units = build_units(t5, WrapPolicy.BLOCK)
    assert "shared.weight" in [p.name for p in units[-1].params]
    segments = build_segments(layer_ops(t5, _workload()), units)
    assert "shared.weight" in [p.name for p in segments[0].params]
    grads = gradient_params(segments)
    assert "shared.weight" in [p.name for p in grads[-1]] and "shared.weight" not in [
        p.name for p in grads[0]
    ]
    assert sum(len(g) for g in grads) == len({p.name for s in segments for p in s.params})


def test_checkpointed_blocks_keep_their_stacks_tokens_and_the_biases_once(t5: ModelConfig) -> None:
    kept = block_input_bytes(t5, _workload())
    enc, dec = B * S * D * A, B * T * D * A
    assert kept == (enc, enc + H * S * S * A, enc, dec, dec + H * T * T * A + H * T * S * A)


def _scenario(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "config.json").write_text(CONFIG.read_text())
    path = tmp_path / "s.toml"
    path.write_text(
        f'[model]\nconfig = "config.json"\n[training]\nmicro_batch = {B}\nseq_len = {S}\n{extra}'
        '[parallel]\nworld_size = 2\n[precision]\nparam_dtype = "bf16"\n'
    )
    return path


def test_forward_runs_the_encoder_then_the_decoder_and_backward_the_reverse(t5: ModelConfig) -> None:
    base = make_scenario(model={"preset": "tiny"}, training={"micro_batch": B, "seq_len": S})
    scenario = replace(base, model=t5, training=replace(base.training, decoder_seq_len=T))
    result = simulate(scenario, make_profile(overlap=False))
    ops = sorted(result.events.ops_of(0), key=lambda o: (o.start_s, o.op_id))
    order = lambda kind: list(dict.fromkeys(o.unit for o in ops if o.kind.value == kind and o.unit != ROOT))  # noqa: E731
    assert order("forward") == [*ENCODER, *DECODER]
    assert order("backward") == [*reversed(DECODER), *reversed(ENCODER)]


def test_decoder_seq_len_is_its_own_measurement(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("FSDPSIM_CACHE_DIR", str(cache))
    path = _scenario(tmp_path)
    default = load_scenario(path)
    assert default.model.description is not None and default.model.description.decoder_seq_len == S
    same = load_scenario(path, [f"training.decoder_seq_len={S}"])  # the default, spelled out
    assert same.model == default.model and len(list(cache.iterdir())) == 1
    shorter = load_scenario(path, [f"training.decoder_seq_len={T}"])
    assert shorter.model.description is not None and shorter.model.description.decoder_seq_len == T
    assert len(list(cache.iterdir())) == 2


def test_decoder_seq_len_is_refused_for_a_decoder(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[model]\npreset = "tiny"\n[training]\nseq_len = 32\ndecoder_seq_len = 16\n')
    with pytest.raises(UserError, match="decoder_seq_len is for encoder-decoder models"):
        load_scenario(path)


@pytest.mark.slow
def test_t5_memory_matches_real_fsdp2_in_fake_mode(tmp_path: Path) -> None:
    """PyTorch's FSDP2 on the real T5ForConditionalGeneration, one rank of 4 under the fake process
    group, the decoder half the encoder's length: the predicted peak within 1 % of the measured
    one (−0.0 % when measured, VALIDATION.md)."""
    from validation.memory_only import validate_memory_only

    path = tmp_path / "s.toml"
    path.write_text(
        f'[model]\nconfig = "{CONFIG}"\n[training]\nmicro_batch = 2\nseq_len = 256\ndecoder_seq_len = 128\n'
        '[parallel]\nworld_size = 4\n[precision]\nparam_dtype = "bf16"\nreduce_dtype = "fp32"\n'
    )
    comparison, measured = validate_memory_only(str(path), [], timeout_s=300)
    peak = next(r for r in comparison.rows if r.metric == "peak memory")
    assert abs(peak.predicted / peak.measured - 1) < 0.01
    assert measured["kernels"]["attention_kernel"] == "math"  # the float bias: SDPA's math path on a CPU


def test_eager_builds_a_float_mask_for_the_decoders_causal_calls_alone(t5: ModelConfig) -> None:
    """``stack_masks``' own rule on a model with bidirectional calls: the encoder's and the
    cross-attention's are unpadded, so no mask; the decoder's self-attention is causal: one
    batch × 1 × T × T mask in bf16, given to both decoder blocks (3 and 4). (A scenario refuses
    T5 with eager attention, whose position bias has no eager description; the rule is what
    any bidirectional model's eager path gets.)"""
    w = _workload("eager")
    masks = stack_masks(t5, layer_ops(t5, w), w)
    assert [(m.bytes, sorted(m.blocks)) for m in masks] == [(B * T * T * A, [3, 4])]


def test_a_causal_call_given_the_bias_computes_every_pair() -> None:
    """The decoder's causal self-attention hands SDPA its bias with the causal triangle filled in
    (``create_position_bias_mask``), so ``is_causal`` is off: a fused kernel computes every pair,
    in the FLOPs as in the GPU kernel model's time (memory-efficient, non-causal); without a bias
    a causal call computes half of them."""
    causal = AttentionShape(batch=B, seq_len=T, heads=H, kv_heads=H, head_dim=16, causal=True)
    biased = replace(causal, bias=True, bias_grad=True)
    assert biased.sdpa_given_mask and not causal.sdpa_given_mask
    every_pair = 4.0 * B * T * T * H * 16
    assert attention_kernel_figures(biased, _workload())[0] == every_pair
    assert attention_kernel_figures(causal, _workload())[0] == every_pair / 2
