"""QLoRA's 4-bit matmul as the CUDA path runs it at training's token counts, op by op, so that a
tensor-level tracker sees what it allocates.

bitsandbytes' ``matmul_4bit`` calls one fused custom op (``bitsandbytes::gemm_4bit``); on a GPU
with more than 1,536 rows (and on sm90/sm100 far fewer) that op falls back to dequantizing the
weight and calling ``F.linear`` (``backends/cuda/ops.py`` ``_dequant_linear_fallback``), and the
dequantized weight is a real allocation. On this CPU the same op runs as one call whose
temporaries no ``TorchDispatchMode`` sees, so ``FSDPMemTracker`` would miss them. Inside
``unfused_4bit_matmul()`` the forward runs the fallback's own steps as separate ops (the nested
absmax dequantized to fp32 and the offset added, both kept while the weight is dequantized and
multiplied, as locals of the fallback are), and the backward is bitsandbytes' own
(``MatMul4Bit.backward``: the weight dequantized again for the input's gradient).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class _Unfused(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None, state: Any
    ) -> torch.Tensor:
        ops = torch.ops.bitsandbytes
        absmax = state.absmax
        if state.nested:
            dequantized = ops.dequantize_blockwise.default(
                state.absmax, state.state2.absmax, state.state2.code, state.state2.blocksize, torch.float32
            )
            absmax = dequantized + state.offset
        weight = ops.dequantize_4bit.default(
            B, absmax, state.blocksize, state.quant_type, state.shape, A.dtype
        )
        ctx.state, ctx.B, ctx.has_bias = state, B, bias is not None
        return torch.nn.functional.linear(A, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        import bitsandbytes.functional as F

        grad_a = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        if ctx.needs_input_grad[0]:
            grad_a = torch.matmul(grad, F.dequantize_4bit(ctx.B, ctx.state).to(grad.dtype))
        return grad_a, None, grad_bias, None


def _matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    quant_state: Any,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    result = _Unfused.apply(A, B.view(-1, 1), bias, quant_state)
    if out is not None:
        return out.copy_(result)
    return result


@contextlib.contextmanager
def unfused_4bit_matmul() -> Iterator[None]:
    """``bitsandbytes.matmul_4bit`` (what ``Linear4bit.forward`` calls) run op by op."""
    import bitsandbytes

    original = bitsandbytes.matmul_4bit
    bitsandbytes.matmul_4bit = _matmul_4bit
    try:
        yield
    finally:
        bitsandbytes.matmul_4bit = original
