"""Padded rows (``training.avg_seq_len`` below ``seq_len``) with the ``attention_mask`` a padding
collator passes: transformers' SDPA path builds a batch x 1 x queries x keys boolean mask, so
``is_causal`` is off, k and v are ``repeat_kv`` copies at every query head, the kernel keeps the
converted mask, and on a GPU SDPA runs memory-efficient attention over every pair; the collator's
int64 mask is held beside the token ids (``AttentionShape.padding_mask``)."""

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from simtest import real_step_peak, tiny_with_config

from sim.costs.attention_curves import attention_curves, curve_rate, derived_efficient
from sim.costs.gpu import FA_BACKWARD_OVER_FORWARD, kernel_model
from sim.hardware.registry import builtin_devices
from sim.scenario.loader import load_scenario
from sim.simulate import _workload
from sim.workload.attention_kernel import attention_kernel_figures, attention_saved_pieces, mask_path_bytes
from sim.workload.forward import COLLATOR_INPUT_TENSOR, layer_ops
from sim.workload.layer_op import LayerKind
from sim.workload.layers import stack_masks
from sim.workload.model import ModelConfig
from sim.workload.shapes import AttentionShape, Workload, row_masks_for

B, S, H, KV, D = 2, 64, 4, 2, 16  # tiny-llama: 4 query heads, 2 key/value heads
CAUSAL = AttentionShape(batch=B, seq_len=S, heads=H, kv_heads=KV, head_dim=D)
PADDED = replace(CAUSAL, padding_mask=True)
ROOT = Path(__file__).resolve().parent.parent


def _workload_of(*, padded: bool, a: int = 4, kernel: str = "flash") -> Workload:
    return Workload(micro_batch=B, seq_len=S, act_bytes=a, attention_kernel=kernel, padded=padded)


def test_which_calls_are_given_the_padding_mask() -> None:
    """Every call of padded rows, T5's biased ones included (the padding folded into the bias, one
    per row, no boolean mask of the kernel's own), but a soft-capped one (not run through SDPA);
    none without padding, and no documents' mask either way."""
    padded, unpadded = _workload_of(padded=True), _workload_of(padded=False)
    assert row_masks_for(padded, bias=False, softcap=False) == (True, False)
    assert row_masks_for(padded, bias=True, softcap=False) == (True, False)
    assert row_masks_for(padded, bias=False, softcap=True) == (False, False)
    assert row_masks_for(unpadded, bias=False, softcap=False) == (False, False)
    biased = replace(PADDED, bias=True, bias_grad=True)
    assert biased.bias_rows == B and not biased.sdpa_bool_mask and biased.sdpa_given_mask
    assert replace(CAUSAL, bias=True).bias_rows == 1 and PADDED.bias_rows == 1
    assert PADDED.sdpa_bool_mask and PADDED.sdpa_given_mask and not PADDED.sdpa_window_mask
    assert not CAUSAL.sdpa_bool_mask and not replace(PADDED, softcap=True).sdpa_bool_mask


@pytest.mark.parametrize("a", [2, 4])
def test_a_padded_call_keeps_the_copies_and_the_converted_mask(a: int) -> None:
    """Flash (SDPA's kernel): k and v at 4 heads instead of 2 and B x S x S of mask in the
    activation dtype, every pair computed; the mask path moves the conversion and the copies."""
    w = _workload_of(padded=True, a=a)
    flops, saved, _, _ = attention_kernel_figures(PADDED, w)
    flops_causal, saved_causal, _, _ = attention_kernel_figures(CAUSAL, w)
    copies = 2 * B * S * (H - KV) * D * a
    mask = B * S * S * a
    assert saved - saved_causal == copies + mask
    assert flops == 2 * flops_causal == 4.0 * B * S * S * H * D
    qkv, own, _ = attention_saved_pieces(PADDED, w)
    assert qkv[1:] == (B * S * H * D * a,) * 2 and own == (B * S * H * 4, mask)
    repeat = B * S * 2 * D * (KV + H) * a
    assert mask_path_bytes(PADDED, w) == (B * S * S * (1 + a) + repeat, repeat)
    assert mask_path_bytes(CAUSAL, w) == (0, 0)
    eager = _workload_of(padded=True, a=a, kernel="eager")  # eager's float mask was there already
    assert attention_kernel_figures(PADDED, eager)[1] == attention_kernel_figures(CAUSAL, eager)[1]


def _tiny_ops(tmp_path: Path, sets: list[str]) -> tuple[tuple, Workload, ModelConfig]:
    scenario = load_scenario(tiny_with_config(tmp_path, "tiny-llama.json"), sets)
    from sim.hardware.registry import load_profile

    w = _workload(scenario, load_profile(scenario.cluster.profile, where="test"))
    return layer_ops(scenario.model, w), w, scenario.model


def test_the_stack_holds_one_mask_per_row_and_the_embedding_the_collators(tmp_path: Path) -> None:
    """tiny-llama described, 2 x 64, 40 real tokens a row: one boolean mask for both blocks of B x S
    x S bytes (one row per sequence, unlike a window's expanded view), and the collator's int64
    mask (B x S x 8 B) the embedding's first kept tensor; none of it without padding."""
    pytest.importorskip("transformers")
    ops, w, model = _tiny_ops(tmp_path, ["training.avg_seq_len=40"])
    plain, w_plain, _ = _tiny_ops(tmp_path, [])
    assert w.padded and not w_plain.padded
    assert [(m.bytes, sorted(m.blocks)) for m in stack_masks(model, ops, w)] == [(B * S * S, [0, 1])]
    assert stack_masks(model, plain, w_plain) == ()
    embed, embed_plain = (next(op for op in o if op.kind is LayerKind.EMBED) for o in (ops, plain))
    assert embed.saved_bytes - embed_plain.saved_bytes == B * S * 8
    assert embed.saved_pieces == (B * S * 8, *embed_plain.saved_pieces)
    assert embed.forward_requests is not None and embed_plain.forward_requests is not None
    assert embed.forward_requests == ((COLLATOR_INPUT_TENSOR, -B * S * 8), *embed_plain.forward_requests)
    assert all(op.attention.padding_mask for op in ops if op.attention is not None)
    assert not any(op.attention.padding_mask for op in plain if op.attention is not None)
    full, w_full, _ = _tiny_ops(tmp_path, ["training.avg_seq_len=64"])  # no padding: no mask
    assert not w_full.padded and stack_masks(model, full, w_full) == ()


def test_a_subclassed_embedding_takes_the_token_ids_and_the_collators_mask(tmp_path: Path) -> None:
    """Gemma 3's scaled word embedding (an ``nn.Embedding`` subclass) is an embedding op: in the
    embedding's calibration group, and holding the collator's mask beside the token ids (before,
    an elementwise op of the head's group, and the padded real step 1,024 B above the simulator)."""
    pytest.importorskip("transformers")
    from sim.workload.layer_op import CalibrationGroup

    scenario = load_scenario(tiny_with_config(tmp_path, "tiny-gemma3.json"), ["training.avg_seq_len=40"])
    from sim.hardware.registry import load_profile

    w = _workload(scenario, load_profile(scenario.cluster.profile, where="test"))
    first = layer_ops(scenario.model, w)[0]
    assert first.name == "model.embed_tokens" and first.kind is LayerKind.EMBED
    assert first.group is CalibrationGroup.EMBED
    assert first.saved_pieces[0] == B * S * 8


@pytest.mark.parametrize(
    ("config", "mode"),
    [("tiny-llama.json", "none"), ("tiny-llama.json", "full"), ("tiny-gemma3.json", "none")],
)
def test_the_real_padded_step_grows_as_simulated(tmp_path: Path, config: str, mode: str) -> None:
    """The real FSDP2 step (fake process group, FakeTensorMode, the CPU's flash kernel given the
    mask; 2 ranks, fp32, 2 x 64, 40 real tokens a row) against the same step unpadded: what the
    padding adds to the peak is the simulator's to the byte (2026-12-07, tiny-llama: 132,096 B
    without checkpointing, the mask, copies, converted masks and the collator's mask; Gemma 3,
    whose global layer's mask comes with padding, 66,560 B), and SDPA is given a mask in every
    call where the unpadded step passes ``is_causal`` (in Gemma 3's global layer)."""
    pytest.importorskip("transformers")
    scenario = tiny_with_config(tmp_path, config)
    ckpt = [f"checkpointing.mode={mode}"]
    padded, measured = real_step_peak(scenario, [*ckpt, "training.avg_seq_len=40"])
    plain, measured_plain = real_step_peak(scenario, ckpt)
    assert measured["kernels"]["attention_mask"] == ["mask"]
    assert "is_causal" in measured_plain["kernels"]["attention_mask"]
    assert padded.measured > plain.measured
    assert padded.predicted - plain.predicted == padded.measured - plain.measured
    assert abs(padded.predicted / padded.measured - 1) <= 1e-3


def test_on_a_gpu_a_padded_call_runs_memory_efficient_attention_over_every_pair() -> None:
    """Llama-2-7B's shape at 4 x 2,048 on the A100: the memory-efficient kernel's non-causal rate
    (the xformers bars, 95 TFLOP/s at 2k, head dim 128) over all s² pairs, against flash's causal
    rate over half of them unpadded."""
    model = kernel_model(builtin_devices()["a100-sxm-80g"], "bf16", builtin_devices())
    causal = AttentionShape(batch=4, seq_len=2048, heads=32, kv_heads=32, head_dim=128)
    forward, backward = model.attention_s(replace(causal, padding_mask=True), "flash")
    flops = 4.0 * 4 * 2048 * 2048 * 32 * 128
    assert forward == pytest.approx(flops / 95e12, rel=1e-9)
    assert backward == pytest.approx(FA_BACKWARD_OVER_FORWARD * forward, rel=1e-9)
    causal_forward, _ = model.attention_s(causal, "flash")
    assert causal_forward == pytest.approx(flops / 2 / model.attention_rate(causal, "flash"), rel=1e-9)
    assert forward > 3 * causal_forward  # twice the pairs at about 0.6 of the rate


def _profile_curves(name: str) -> dict[tuple[str, int, bool], dict[int, float]]:
    data = json.loads((ROOT / "sim" / "hardware" / "profiles" / f"{name}.json").read_text())
    return {
        (c["kernel"], c["head_dim"], c["causal"]): dict(zip(c["seq_lens"], c["fwd_bwd_flops"], strict=True))
        for c in data["device"]["attention"]
    }


def test_the_h100s_memory_efficient_curve_is_the_a100s_times_flashattention_2s_speedup() -> None:
    """Derived from the profile files' published figures: at every length, head dimension and
    causality, the A100's memory-efficient rate times the H100's FlashAttention-2 rate over the
    A100's; the A100 keeps its own, published curve."""
    devices = builtin_devices()
    a100, h100 = _profile_curves("a100-sxm-80g"), _profile_curves("h100-sxm")
    derived = derived_efficient(devices["h100-sxm"].attention, devices)
    assert {(c.head_dim, c.causal) for c in derived} == {(64, False), (128, False), (64, True), (128, True)}
    for curve in derived:
        key = (curve.head_dim, curve.causal)
        for s, rate in zip(curve.seq_lens, curve.fwd_bwd_flops, strict=True):
            expected = a100[("efficient", *key)][s] * h100[("flash", *key)][s] / a100[("flash", *key)][s]
            assert rate == pytest.approx(expected, rel=1e-12)
            assert rate < curve_rate(
                next(
                    c
                    for c in devices["h100-sxm"].attention
                    if (c.head_dim, c.causal) == key and c.kernel == "flash"
                ),
                s,
            )
    assert derived_efficient(devices["a100-sxm-80g"].attention, devices) == ()


def test_every_built_in_nvidia_part_times_a_given_mask_with_a_fused_curve() -> None:
    """No NVIDIA part falls back to the math path for a masked call: the A100 family's own or
    borrowed curve, the H100 family's derived one (borrowed parts scaled by their matmul rate)."""
    devices = builtin_devices()
    for name, device in devices.items():
        if not device.architecture or not device.architecture.startswith("sm"):
            continue
        curves, _ = attention_curves(device, devices, "bf16")
        assert any(c.kernel == "efficient" for c in curves), name


def _report(*sets: str) -> Any:
    from sim.hardware.registry import load_profile
    from sim.outputs.report import build_report
    from sim.simulate import simulate

    scenario = load_scenario(str(ROOT / "scenarios" / "packing-vs-padding-7b.toml"), list(sets))
    return build_report(simulate(scenario, load_profile(scenario.cluster.profile, where="test")))


@pytest.mark.parametrize(
    ("sets", "curves", "masked"),
    [
        ((), {"efficient": "derived"}, 32),  # H100 SXM: masked, at the derived curve
        (("training.micro_batch=1", "training.avg_seq_len=2048"), {"flash": "measured"}, 0),  # packed
        (("cluster.profile=a100-sxm-80g",), {"efficient": "measured"}, 32),  # the A100's own
        (("cluster.profile=a100-pcie-80g",), {"efficient": "borrowed"}, 32),  # its family's
        (("training.attention=eager",), {"eager": None}, 0),  # eager: no curve, no SDPA mask
    ],
)
def test_the_report_says_how_attention_is_timed(sets: tuple[str, ...], curves: dict, masked: int) -> None:
    """The report's ``attention``: Llama-2-7B's 32 calls per forward, those SDPA is given the
    padding mask, the kernel they run and where each timed kernel's curve comes from; the text
    report names the assumption."""
    from sim.outputs.report_text import format_table

    report = _report(*sets)
    a = report.to_json()["attention"]
    assert a["calls"] == 32 and a["masked_calls"] == masked and a["curves"] == curves
    assert a["masked_by"] == (["padding"] if masked else []) and a["kernel"] in ("flash", "eager")
    text = format_table(report)
    line = next(x for x in text.splitlines() if x.startswith("attention") or "given a mask" in x)
    if masked:
        assert "32 of 32 calls given a mask (padding): memory-efficient attention over every pair" in text
        assert ("an assumption" in line) == (curves["efficient"] == "derived")


def test_a_calibrated_cpu_profile_reports_no_attention_timing() -> None:
    """The calibrated gloo profile times attention from its measured units, not from curves."""
    from sim.hardware.registry import load_profile
    from sim.outputs.report import build_report
    from sim.simulate import simulate

    scenario = load_scenario(str(ROOT / "scenarios" / "tiny.toml"), [])
    profile = load_profile(str(ROOT / "profiles" / "cpu-2x-gloo.json"), where="test")
    assert "attention" not in build_report(simulate(scenario, profile)).to_json()


def test_only_parts_that_run_the_sm80_kernels_on_a_newer_architecture_get_a_derived_curve() -> None:
    """Hopper (own curve or borrowed, as the H100 NVL) and Blackwell get one; a part of another
    architecture with a FlashAttention-2 curve of its own (an sm75 user profile) gets none: its
    masked calls are timed as the math path, with no curve to name."""
    from sim.costs.attention_curves import curve_origin

    devices = builtin_devices()
    for name in ("h100-sxm", "h100-nvl", "h200", "b200"):
        assert curve_origin(devices[name], devices, "bf16", "efficient") == "derived", name
    assert curve_origin(devices["a100-sxm-80g"], devices, "bf16", "efficient") == "measured"
    turing = replace(devices["h100-sxm"], architecture="sm75")
    curves, _ = attention_curves(turing, devices, "bf16")
    assert not any(c.kernel == "efficient" for c in curves)
    assert curve_origin(turing, devices, "bf16", "efficient") is None
    assert curve_origin(turing, devices, "bf16", "flash") == "measured"
