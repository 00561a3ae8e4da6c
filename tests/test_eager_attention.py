"""A model's own eager attention (Gemma 2's soft-capped ``eager_attention_forward``), op by op:
the simulator's bytes against the installed transformers' function run here on real tensors, and
Gemma 2's description (soft-capped calls, its two masks, the final-logit soft-capping's saved
logits), issue 14."""

import json
from pathlib import Path

import pytest

from sim.dtypes import FP32_BYTES
from sim.workload.attention_kernel import attention_kernel_figures
from sim.workload.description import parse_description
from sim.workload.eager_attention import eager_score_bytes
from sim.workload.forward import layer_ops
from sim.workload.layer_op import LayerKind
from sim.workload.layers import stack_masks
from sim.workload.model import ModelConfig
from sim.workload.shapes import AttentionShape, Workload

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parent / "data" / "hf"
B, H, S, D = 2, 4, 64, 16  # batch, query heads, tokens, head dim of the measured calls


class _Live(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage the calls inside create, and the bytes of those alive after each call."""

    def __init__(self, outside: set[int], tracked: dict | None = None):
        super().__init__()
        self.outside, self.storages = outside, dict(tracked or {})
        self.moments: list[dict[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                k = _key(t)
                if k not in self.outside and (k not in self.storages or self.storages[k][0].expired()):
                    self.storages[k] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        self.moments.append({k: n for k, (ref, n) in self.storages.items() if not ref.expired()})
        return out


def _key(t):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


def _measure(
    dtype, softcap: float | None, kv_heads: int, dropout: float, family: str = "gemma2"
) -> tuple[int, int, int]:
    """(saved, forward transient, backward transient) of one real call, as the simulator counts
    them: saved storages (q, k and v among them when kept); the forward's most alive of what the
    call made, less what it keeps, its output (the model's: its projection keeps it) excepted;
    the backward's most alive above its start, the gradients it hands back for q, k and v (the
    model's) excepted."""
    if family == "llama":  # no soft-capping argument
        from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

        def eager_attention_forward(*args, softcap, **kwargs):
            assert softcap is None
            return llama_eager(*args, **kwargs)
    else:
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim = H // kv_heads, D
    q, k, v = (torch.randn(B, n, S, D, dtype=dtype, requires_grad=True) * 1 for n in (H, kv_heads, kv_heads))
    mask = torch.zeros(B, 1, S, S, dtype=dtype)
    outside = {_key(t) for t in (q, k, v, mask)}
    saved: set[int] = set()
    model_grads: set[int] = set()
    for t in (q, k, v):
        t.register_hook(lambda g: model_grads.add(_key(g)))
    forward = _Live(outside)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.add(_key(t)) or t, lambda t: t), forward:
        out, weights = eager_attention_forward(
            module, q, k, v, mask, dropout=dropout, scaling=0.25, softcap=softcap
        )
    del weights  # the decoder layer drops them (``hidden_states, _ = self.self_attn(...)``)
    sizes = {key: n for m in forward.moments for key, n in m.items()}
    inner_saved = sum(n for key, n in sizes.items() if key in saved)
    kept_inputs = sum(t.untyped_storage().nbytes() for t in (q, k, v) if _key(t) in saved)
    peak = max(sum(n for key, n in m.items() if key != _key(out)) for m in forward.moments)
    grad = torch.randn_like(out)
    tracked = {key: ref for key, ref in forward.storages.items() if key != _key(out)}
    backward = _Live(outside | {_key(grad)}, tracked)
    start = sum(n for key, (ref, n) in tracked.items() if not ref.expired())
    with backward:
        out.backward(grad)
    after = max(sum(n for key, n in m.items() if key not in model_grads) for m in backward.moments)
    return inner_saved + kept_inputs, peak - inner_saved, after - start


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("kv_heads", [H, H // 2])
def test_llamas_eager_bytes_equal_the_real_call(dtype: str, kv_heads: int) -> None:
    """``training.attention = "eager"`` on a Llama: transformers' Llama eager attention (no
    soft-capping) keeps, peaks and peaks in backward what the simulator's eager figures say."""
    torch_dtype, a = {"bf16": (torch.bfloat16, 2), "fp32": (torch.float32, 4)}[dtype]
    shape = AttentionShape(batch=B, seq_len=S, heads=H, kv_heads=kv_heads, head_dim=D)
    w = Workload(micro_batch=B, seq_len=S, act_bytes=a, attention_kernel="eager")
    _, saved, fwd, bwd = attention_kernel_figures(shape, w, output_saved=False)
    assert (saved, fwd, bwd) == _measure(torch_dtype, None, kv_heads, 0.0, family="llama")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("softcap", [50.0, None])
@pytest.mark.parametrize("kv_heads", [H, H // 2])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_eager_bytes_equal_the_real_call(
    dtype: str, softcap: float | None, kv_heads: int, dropout: float
) -> None:
    """The installed transformers' eager attention, run here: what it keeps, its forward peak and
    its backward peak equal the simulator's figures to the byte."""
    torch_dtype, a = {"bf16": (torch.bfloat16, 2), "fp32": (torch.float32, 4)}[dtype]
    shape = AttentionShape(
        batch=B,
        seq_len=S,
        heads=H,
        kv_heads=kv_heads,
        head_dim=D,
        softcap=softcap is not None,
        dropout=dropout,
    )
    w = Workload(micro_batch=B, seq_len=S, act_bytes=a, attention_kernel="eager")
    _, saved, fwd, bwd = attention_kernel_figures(shape, w, output_saved=False)
    assert (saved, fwd, bwd) == _measure(torch_dtype, softcap, kv_heads, dropout)


def test_soft_capping_keeps_tanhs_output() -> None:
    """Per score, bf16: tanh's output (2), the fp32 softmax (4) and its bf16 cast (2); the
    forward peaks at the softmax 4 B above that (the masked scores and their fp32 copy, less the
    cast not yet made), the backward at the softmax's two fp32 gradients less the released cast."""
    capped = eager_score_bytes(2, softcap=True, dropout=False)
    assert (capped.saved, capped.forward_peak, capped.backward_peak) == (8, 4, 6)
    assert eager_score_bytes(2, softcap=False, dropout=False).saved == 2 + FP32_BYTES


@pytest.fixture(scope="module")
def gemma2() -> ModelConfig:
    return _describe(json.loads((DATA / "tiny-gemma2.json").read_text()))


def _describe(config: dict) -> ModelConfig:
    from hfmodel.describe import describe

    data = describe(config, micro_batch=B, seq_len=S, dtype="bf16", name="tiny-gemma2")
    return ModelConfig.of(parse_description(json.loads(json.dumps(data)), "tiny-gemma2"))


def test_gemma2_calls_are_soft_capped_and_build_two_masks(gemma2: ModelConfig) -> None:
    """Its layers alternate sliding-window (256 keys) and full attention, every call soft-capped:
    eager builds one float mask per pattern (the schedule holds them), and each eager call keeps q, k and v as repeat_kv
    copies them to the 4 query heads, and 8 B per score."""
    assert gemma2.description is not None
    calls = [op.attention for op in gemma2.description.ops if op.attention is not None]
    assert [c.window for c in calls] == [256, None] and all(c.softcap for c in calls)
    w = Workload(micro_batch=B, seq_len=S, act_bytes=2, attention_kernel="eager")
    flash = Workload(micro_batch=B, seq_len=S, act_bytes=2, attention_kernel="flash")
    eager_op, flash_op = (
        next(op for op in layer_ops(gemma2, x) if op.kind is LayerKind.ATTENTION) for x in (w, flash)
    )
    t, scores, d = B * S, B * H * S * S, 32  # Gemma 2's head_dim is its own (not hidden / heads)
    kernel_saved = t * H * d * 2 * 3 + scores * 8  # q, the repeated k and v, the s² tensors
    flash_kept = t * (H * d * 2 + H * FP32_BYTES) + t * 2 * d * 2 * 2  # q, lse, k and v (2 heads)
    assert eager_op.saved_bytes - flash_op.saved_bytes == kernel_saved - flash_kept
    assert eager_op.forward_transient_bytes - flash_op.forward_transient_bytes == scores * 4
    # the two masks are the schedule's, each given to its own layer type's blocks (block 0
    # sliding-window, block 1 full)
    masks = stack_masks(gemma2, layer_ops(gemma2, w), w)
    assert sorted((m.bytes, sorted(m.blocks)) for m in masks) == [(t * S * 2, [0]), (t * S * 2, [1])]
    assert stack_masks(gemma2, layer_ops(gemma2, flash), flash) == ()


def test_final_logit_soft_capping_keeps_the_capped_logits(gemma2: ModelConfig) -> None:
    """Gemma 2's head caps the logits (divide, tanh, multiply) before the loss: tanh's bf16
    output is kept, tokens × vocabulary × 2 bytes more than the same model uncapped."""
    config = json.loads((DATA / "tiny-gemma2.json").read_text())
    uncapped = _describe({**config, "final_logit_softcapping": None})

    def head_saved(m: ModelConfig) -> int:
        assert m.description is not None
        return sum(
            op.saved_bytes for op in m.description.ops if op.block is None and op.name.startswith("loss")
        )

    assert head_saved(gemma2) - head_saved(uncapped) == B * S * config["vocab_size"] * 2
