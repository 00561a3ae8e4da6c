"""The loss end of a causal LM: the logits it returns (what a training loop that keeps
``outputs`` holds) and the head and loss as Liger-Kernel's fused linear cross-entropy runs them.
"""

import math
from dataclasses import replace

from sim.dtypes import FP32_BYTES, INDEX_BYTES
from sim.workload.layer_op import LayerKind, LayerOp
from sim.workload.model import ModelConfig, ParamSpec
from sim.workload.op_counts import HOST_OPS
from sim.workload.options import LossKernel
from sim.workload.shapes import Workload


def output_logits_bytes(cfg: ModelConfig, w: Workload, *, fp32: bool = False) -> int:
    """The logits a causal LM returns for one micro-batch (HF's ``outputs.logits``): lm_head's
    output in the activation dtype (the loss's fp32 copy is its own), or, with ``fp32``, the
    upcast copy transformers < 4.36 returned (``logits = logits.float()``); none from a fused
    loss (Liger returns no logits when it computes the loss)."""
    if w.loss is LossKernel.FUSED:
        return 0
    tokens = w.micro_batch * (w.decoder_seq_len or w.seq_len)
    return tokens * cfg.vocab * (FP32_BYTES if fp32 else w.act_bytes)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def fused_linear_cross_entropy(
    head: LayerOp, cfg: ModelConfig, w: Workload, params: tuple[ParamSpec, ...]
) -> LayerOp:
    """The head and the loss as Liger-Kernel's fused linear cross-entropy runs them
    (``liger_kernel/ops/fused_linear_cross_entropy.py``): the tokens go through the lm_head a
    chunk at a time, chunk = next power of two of ceil(BT / ceil(V / H)) tokens (so a chunk's
    logits are about as large as the input); per chunk the cross-entropy kernel turns the logits
    into their gradient in place, and the input's and the weight's gradients are accumulated right
    away (``grad_input = zeros_like(input)``, ``grad_weight = zeros_like(weight)``, in the weight's
    dtype). Forward runs the three matmuls; what it keeps for backward is those two gradients,
    which backward only scales by the loss's gradient; nothing of the vocabulary's size outlives a
    chunk."""
    t, a, vocab, hidden = w.tokens, w.act_bytes, cfg.vocab, cfg.hidden
    chunk = min(t, _next_power_of_two(math.ceil(t / math.ceil(vocab / hidden))))
    gradients = t * hidden * a + vocab * hidden * a  # grad_input and grad_weight, from the start
    return replace(
        head,
        name="lm_head+loss (fused)",
        kind=LayerKind.LOSS,
        params=params,
        memory_bytes=float(2 * t * vocab * a),  # the CE kernel reads the logits and writes their gradient
        backward_memory_factor=(2 * t * hidden * a + 2 * vocab * hidden * a) / (2 * t * vocab * a),
        saved_bytes=gradients + t * INDEX_BYTES,
        # while it runs: the two gradients, one chunk's logits and the per-token losses
        forward_transient_bytes=gradients + chunk * vocab * a + t * FP32_BYTES,
        backward_transient_bytes=0,
        host_ops=HOST_OPS["linear"] + 4 * math.ceil(t / chunk),  # per chunk: mm, CE kernel, two mms
        # the two gradients zeroed, four kernels a chunk; backward scales the two by the loss's
        # gradient (``element_mul_kernel``)
        launches=(2 + 4 * math.ceil(t / chunk), 2),
        gradients_in_forward=True,
    )
