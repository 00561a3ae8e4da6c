"""The math path of ``F.scaled_dot_product_attention`` with a learned additive bias (T5's relative
position bias), run for real on this CPU: what it saves and what its backward holds above where it
starts, against the kernel model's figures (``sim.workload.attention_kernel``)."""

import weakref

import pytest

from sim.workload.attention_kernel import attention_kernel_figures
from sim.workload.shapes import AttentionShape, Workload

torch = pytest.importorskip("torch")

H, S, D, A = 4, 256, 16, 2  # heads, tokens, head dim, bf16


class _LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of every storage an op made while the mode was on that is still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    def live(self) -> int:
        return sum(n for ref, n in list(self.storages.values()) if ref() is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref, _ = self.storages.get(storage.data_ptr(), (None, 0))
                if ref is None or ref() is None:
                    self.storages[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        self.peak = max(self.peak, self.live())
        return out


def _measure(batch: int, bias_needs_grad: bool) -> tuple[int, int]:
    """(bytes the call keeps after its forward, its output excepted; its backward's peak above where
    it starts, q, k and v's gradients excepted), bf16, dropout 0.1, a non-leaf [1, H, S, S] bias."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, H, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    weight = torch.randn(1, H, S, S, dtype=torch.bfloat16, requires_grad=bias_needs_grad)
    bias = weight * 1  # made by an op, as T5's compute_bias makes it
    mode = _LiveStorages()
    with mode:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.1)
        kept = mode.live() - out.untyped_storage().nbytes()
        grad = torch.ones_like(out)
        start, mode.peak = mode.live(), 0
        out.backward(grad)
    qkv_grads = 3 * batch * H * S * D * A
    return kept, mode.peak - start - qkv_grads


@pytest.mark.parametrize("batch", [1, 2])
def test_the_bias_gradient_adds_nothing_to_the_backward_peak(batch: int) -> None:
    """The backward peaks at the fp32 score gradient, before the bias's gradient is made (summed
    over the batch and cast once the softmax's and dropout's saves are gone): the same peak whether
    the bias needs a gradient or not, and the kernel model's figure for a learned bias that peak
    but for one bf16 tensor of q's size, which the model leaves out (D / (2 S) of the figure: 3 % at
    these 256 tokens, 0.4 % at T5's 1,024 with its 64-wide heads); what it saves, to the byte."""
    kept, backward = _measure(batch, bias_needs_grad=True)
    assert (kept, backward) == _measure(batch, bias_needs_grad=False)
    shape = AttentionShape(
        batch=batch,
        seq_len=S,
        heads=H,
        kv_heads=H,
        head_dim=D,
        dropout=0.1,
        causal=False,
        bias=True,
        bias_grad=True,
    )
    w = Workload(micro_batch=batch, seq_len=S, act_bytes=A, attention_kernel="math")
    _, saved, _, model_backward = attention_kernel_figures(shape, w, output_saved=False)
    assert saved == kept
    assert backward == model_backward + batch * H * S * D * A


@pytest.mark.parametrize(
    ("batch", "queries", "keys", "head_dim", "v_head_dim"),
    [(1, 256, 256, 16, 16), (2, 256, 256, 16, 32), (2, 128, 256, 32, 16)],
    ids=["square", "wider-values", "cross-attention"],
)
def test_the_forward_peak_beyond_the_saves_is_the_copy_and_fp32_q_k_and_output(
    batch: int, queries: int, keys: int, head_dim: int, v_head_dim: int
) -> None:
    """bf16 inputs, a learned bias, dropout 0.1: the forward's peak above what the call keeps once
    it returns (its saves and its output) is the low-precision copy of the scores and, beside it,
    fp32 q and k before their scaling and the fp32 output before its cast, to the byte, as the
    kernel model's forward transient says
    (2026-12-08; before, the copy alone: tiny-t5's checkpointed encoder recompute read 3.4 % low)."""
    torch.manual_seed(0)
    q = torch.randn(batch, H, queries, head_dim, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, H, keys, head_dim, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, H, keys, v_head_dim, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(1, H, queries, keys, dtype=torch.bfloat16, requires_grad=True) * 1
    mode = _LiveStorages()
    with mode:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.1)
        beyond = mode.peak - mode.live()
    assert out.shape[-1] == v_head_dim
    shape = AttentionShape(
        batch=batch,
        seq_len=queries,
        kv_seq_len=keys if keys != queries else None,
        heads=H,
        kv_heads=H,
        head_dim=head_dim,
        v_head_dim=v_head_dim if v_head_dim != head_dim else None,
        dropout=0.1,
        causal=False,
        bias=True,
        bias_grad=True,
    )
    w = Workload(micro_batch=batch, seq_len=queries, act_bytes=A, attention_kernel="math")
    assert beyond == attention_kernel_figures(shape, w)[2]
    copy = batch * H * queries * keys * A
    assert beyond > copy  # the fp32 tensors beside it are there
