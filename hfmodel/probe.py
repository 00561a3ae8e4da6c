"""The attention probe: an attention implementation registered with ``transformers`` that records
each call's shape and returns an output of the right shape while saving nothing.

What the attention kernel itself computes and keeps (q, k, v, the output and its log-sum-exp for
a fused kernel; the s² scores on the math path) depends on the kernel the hardware runs, not on
the model, so the simulator adds it per kernel (``sim.workload.attention_kernel.attention_kernel_figures``); the probe
lets the model's own work around it (projections, RoPE, q/k norms, the output copy) be measured
without the CPU kernel's choices leaking in.

A learned additive bias (T5's relative position bias, ``position_bias``) is the model's, not the
kernel's: the probe builds the float mask from it as transformers' SDPA path does
(``create_position_bias_mask``: the bias, with the causal triangle filled in a causal call),
hands it to the empty kernel and returns a gradient of its shape, so that the bias's gradient
accumulates over a stack's blocks in backward, as it does in training.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

PROBE = "fsdpsim_probe"


@dataclass(frozen=True, kw_only=True)
class AttentionCall:
    module: str
    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    causal: bool
    window: int | None
    kv_seq_len: int | None = None  # keys per query where they differ (cross-attention)
    dropout: float = 0.0  # attention dropout probability (T5 trains with its dropout_rate)
    bias: bool = False  # an additive float bias (T5's relative position bias) masks the scores
    bias_grad: bool = False  # and it needs a gradient (learned; T5's cross-attention bias is zeros)
    softcap: bool = False  # the scores are tanh soft-capped (Gemma 2's attn_logit_softcapping)
    # the query is not laid out as (batch, seq, heads, dim) in memory (GPT-NeoX's, concatenated
    # after its partial rotary): a kernel whose output takes the query's layout makes one that
    # transformers' ``transpose(1, 2).contiguous()`` copies (``sim.workload.described``)
    query_not_bshd: bool = False


class _Empty(torch.autograd.Function):
    """Output of the attention's shape; gradients of q, k, v of theirs; nothing saved."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        backward_started: Callable[[], None],
    ) -> torch.Tensor:
        # shapes only: holding q, k, v would keep them alive to the end of the trace, where they
        # would count as every later op's transient (the kernel's own saved q, k, v are added
        # by the simulator)
        ctx.shapes = tuple((t.shape, t.dtype) for t in (q, k, v))
        ctx.bias = None if bias is None else (bias.shape, bias.dtype)
        ctx.backward_started = backward_started
        b, h, s, _ = q.shape
        return q.new_empty(b, s, h, v.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.backward_started()  # before the kernel's gradients exist: what the model holds
        # q, k and v's gradients always (a fused kernel's backward makes all three, needed or
        # not: a frozen projection's k under LoRA); the bias's only where it needs one, as SDPA's
        # kernels make it (T5's zero cross-attention bias needs none)
        grads = tuple(grad.new_empty(shape, dtype=dtype) for shape, dtype in ctx.shapes)
        wanted = ctx.bias is not None and ctx.needs_input_grad[3]
        bias = grad.new_empty(ctx.bias[0], dtype=ctx.bias[1]) if wanted else None
        return (*grads, bias, None)


class ProbeRecorder:
    """Registers the probe; ``calls`` lists every attention call of the traced forward."""

    def __init__(self, tracer: Any, paths: dict[int, str]):
        self.tracer = tracer
        self.paths = paths  # id(module) -> module path
        self.calls: list[AttentionCall] = []
        self.outputs: list[int | None] = []  # each call's output storage (the tracer's uid)
        # each call's q, k, v: (storage uid, storage bytes, the view's bytes); a fused kernel saves
        # them, and a view into a larger storage (a fused qkv projection's value) keeps all of it
        self.inputs: list[list[tuple[int | None, int, int]]] = []
        # each call's tracer step when its backward began (None: it never ran backward)
        self.backward_steps: list[int | None] = []
        self.ops: list[int] = []  # each call's op (the tracer's index)

    def attention(
        self,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ):
        path = self.paths.get(id(module), "attention")
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        self.calls.append(
            AttentionCall(
                module=path,
                batch=query.shape[0],
                seq_len=query.shape[2],
                heads=query.shape[1],
                kv_heads=key.shape[1],
                head_dim=query.shape[-1],
                v_head_dim=value.shape[-1],
                causal=bool(getattr(module, "is_causal", True)),
                window=int(window) if window else None,
                kv_seq_len=key.shape[2] if key.shape[2] != query.shape[2] else None,
                dropout=float(kwargs.get("dropout") or 0.0),
                bias=kwargs.get("position_bias") is not None,
                bias_grad=bool(getattr(kwargs.get("position_bias"), "requires_grad", False)),
                softcap=bool(kwargs.get("softcap")),
                query_not_bshd=not _bshd(query),
            )
        )
        self.inputs.append(
            [
                (self.tracer.uid_of(t), t.untyped_storage().nbytes(), t.numel() * t.element_size())
                for t in (query, key, value)
            ]
        )
        self.tracer.probe_owner = f"attention:{path}"
        try:
            bias = _bias_mask(module, query, key, kwargs)
            out = _Empty.apply(query, key, value, bias, self._backward_marker(len(self.backward_steps)))
            self.backward_steps.append(None)
            self.outputs.append(self.tracer.uid_of(out))
            self.ops.append(self.tracer.ops[-1].index if self.tracer.ops else 0)
            if out.grad_fn is not None and self.tracer.ops:
                self.tracer.node_op[out.grad_fn] = self.tracer.ops[-1].index
        finally:
            self.tracer.probe_owner = None
        return out, None

    def _backward_marker(self, call: int) -> Callable[[], None]:
        """Notes the tracer's step as call ``call``'s backward begins (storages freed by then
        swept), so that what the model's backward holds at that moment can be read off the
        tracer's storage lives (``hfmodel.trace_figures.backward_live_bytes``)."""

        def started() -> None:
            self.tracer._sweep()
            self.backward_steps[call] = self.tracer.step

        return started

    def register(self) -> None:
        """Make this recorder the one the registered probe reports to."""
        ACTIVE[:] = [self]


ACTIVE: list[ProbeRecorder] = []


def _bshd(t: torch.Tensor) -> bool:
    """Whether a (batch, heads, seq, dim) tensor is laid out as (batch, seq, heads, dim) in memory,
    read off its strides (no torch call: the tracer would count one as the model's host work)."""
    b, h, s, d = t.shape
    expected = (s * h * d, d, h * d, 1)
    return all(
        n == 1 or stride == want for n, stride, want in zip((b, h, s, d), t.stride(), expected, strict=True)
    )


def _bias_mask(module: Any, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """The float mask transformers' SDPA path builds from a ``position_bias``
    (``integrations/sdpa_attention.py``), for one sequence per row (no padding mask: the
    training step passes none); None without a bias."""
    bias = kwargs.get("position_bias")
    if bias is None:
        return None
    from transformers.integrations.sdpa_attention import create_position_bias_mask

    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal) and query.shape[2] > 1
    return create_position_bias_mask(bias, None, causal, query, key)


def probe_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
):
    """The function registered as ``attn_implementation = "fsdpsim_probe"``."""
    if not ACTIVE:
        raise RuntimeError("the attention probe runs only inside hfmodel.describe")
    return ACTIVE[0].attention(module, query, key, value, *args, **kwargs)


def register_probe() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE, probe_attention)
