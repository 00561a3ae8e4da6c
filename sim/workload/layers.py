"""The forward computation of a Llama step as a list of layer ops, with FLOPs and activation bytes.

Activation bytes follow what HF ``LlamaForCausalLM`` saves for backward in eager PyTorch
(per token, ``a`` = activation dtype bytes, fp32 internals of RMSNorm and the loss):
- RMSNorm: the fp32 copy of its input (4h; the input itself when it already is fp32), the
  normalized input cast back (a*h) that the weight multiply saves, the fp32 rsqrt (4), and its
  output (a*h), which the following projections save and release in their backward. Its own
  backward peaks at four fp32 tensors of the input's shape (16h), beside the residual's gradient
  (a*h) in a block (``_norm_backward_bytes``), as ``hfmodel.trace`` measures HF's module. In
  fp32 the saved copy is the input itself: first in a checkpointed block, the block's kept input
  (``LayerOp.saved_input_bytes``), which its recompute does not make again.
- Rotary embedding: the cos and sin tables (seq * head_dim * a each), once per forward.
- Attention: RoPE'd q and k, v and the output (a*(2*q_dim + 2*kv_dim)) plus the fp32 log-sum-exp
  (4*n_heads) with flash/memory-efficient kernels; the math path adds the fp32 softmax and its
  cast (n_heads*seq*(4 + a)) — Korthikanti et al. 2022, "Reducing Activation Recomputation", Sec. 4;
  a model's own eager attention what ``sim.workload.eager_attention`` lists, op by op.
- SwiGLU MLP: gate output, SiLU output, up output and their product (4*a*ffn); the product goes
  with down_proj's backward, and the MLP's own backward peaks at three ffn-wide gradients beside
  the residual's (``_mlp_act``); the head's backward holds the logits' gradient and its input's.
- Loss: the fp32 log-softmax (4*vocab) and the shifted int64 labels. The logits are not saved;
  they live only while the loss is computed (a training loop that keeps ``outputs.logits``
  through backward holds a*vocab more per token).
Residual adds save nothing (their traffic, 3·a·h per token each, is counted with the op that
follows them in a block: the post-attention norm and the MLP's activation). Linear layers save
their input, which is counted at its producer.
Memory traffic is what eager PyTorch moves (every op reads its inputs and writes its output,
no fusion), per element, read from HF ``modeling_llama.py`` with ``a`` the activation bytes
(``eager_bytes``): RMSNorm to(fp32) a+4, pow 8, mean 4, mul 8, to(dtype) 4+a, weight mul 2a
(casts vanish in fp32); RoPE per q/k element q*cos 2a, neg a, cat 2a, *sin 2a, add 3a; the
attention output's transpose().contiguous() 2a; SiLU 2a and the product 3a per ffn element; the
embedding gather 2a; the loss's logits.float() a+4 and log_softmax 12 (two reads, a write) per
vocab element. Backward moves twice the forward's bytes (autograd runs each op's backward), but
the loss's about 1.2× (nll and log_softmax backward and the cast back: 22 against 18 B).
Forward FLOPs are 2*in*out per token for a linear; attention is 4*seq*q_dim per token, halved
for causal masking with flash kernels; backward is twice the forward (Narayanan et al. 2021).

Each op also carries what the GPU model (``sim.costs.gpu``) needs: a linear's GEMM shape
(M tokens, N out, K in), the attention's shape, and ``host_ops``, the Python-level PyTorch calls
its forward makes in eager mode (counted in HF ``modeling_llama.py``, ``HOST_OPS``), each of
which costs the host one eager dispatch, and the kernels it launches (``sim.workload.op_counts``).
The loss's logits and Liger's fused linear cross-entropy: ``sim.workload.loss``.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

from sim.dtypes import FP32_BYTES, INDEX_BYTES
from sim.workload.attention_kernel import attention_kernel_figures, mask_path_bytes
from sim.workload.layer_op import LayerKind, LayerOp
from sim.workload.loss import fused_linear_cross_entropy
from sim.workload.model import ModelConfig, ParamSpec, layer_params, layer_prefix, param_specs
from sim.workload.op_counts import FUSED_NORM_HOST_OPS, FUSED_NORM_LAUNCHES, HOST_OPS, LAUNCHES
from sim.workload.options import LossKernel, NormKernel
from sim.workload.shapes import AttentionShape, Workload, row_masks_for


@dataclass(frozen=True, kw_only=True)
class StackMask:
    """One of the attention masks HF's stack builds before its first block (eager: an additive
    float mask; SDPA given a window or a collator's padding: a boolean one): its bytes, the blocks
    it is given to, its stack's first and last blocks (it is built as the first one's forward
    starts and, unless something keeps it, goes as the last one's ends) and whether the ops of the
    blocks given it keep it for their backward (T5's learned bias with padding folded in:
    ``torch.where``'s backward takes the condition)."""

    bytes: int
    blocks: frozenset[int]
    stack_first: int
    stack_last: int
    kept_for_backward: bool


def _cast_bytes(a: int) -> int:
    """A cast to fp32 and back: nothing where the activations already are fp32."""
    return 0 if a == FP32_BYTES else 2 * (a + FP32_BYTES)


def _norm_bytes_per_element(a: int) -> int:
    """Eager RMSNorm: the casts, pow, mean, the rsqrt multiply and the weight multiply."""
    return _cast_bytes(a) + 8 + 4 + 8 + 2 * a


def _residual_add_bytes(h: int, w: Workload) -> float:
    """A residual add reads two activations and writes one."""
    return 3.0 * w.tokens * h * w.act_bytes


def _norm(
    name: str,
    params: tuple[ParamSpec, ...],
    h: int,
    w: Workload,
    block: int | None,
    *,
    after_add: bool = False,
) -> LayerOp:
    t, a = w.tokens, w.act_bytes
    where = "norm" if block is not None else "final_norm"
    first_in_block = int(block is not None and not after_add)
    if w.norm is NormKernel.FUSED:
        # reads x and writes y; backward reads x and dy and writes dx (the weight's per-SM fp32
        # partial sums, sm_count x h, are left out: a few MiB). It keeps x, rstd (fp32 per row) and
        # its output, which the next matmuls keep (``save_for_backward(x, weight, rstd)``)
        return LayerOp(
            name=name,
            module=name,
            kind=LayerKind.NORM,
            block=block,
            params=params,
            flops=0.0,
            memory_bytes=float(2 * t * h * a),
            backward_memory_factor=1.5,
            saved_bytes=t * (2 * h * a + FP32_BYTES),
            saved_input_bytes=t * h * a,  # x as it came in
            host_ops=FUSED_NORM_HOST_OPS + first_in_block,
            launches=(FUSED_NORM_LAUNCHES[where][0] + first_in_block, FUSED_NORM_LAUNCHES[where][1]),
            fused_kernel=True,
        )
    return LayerOp(
        name=name,
        module=name,
        kind=LayerKind.NORM,
        block=block,
        params=params,
        flops=0.0,
        memory_bytes=t * h * _norm_bytes_per_element(a) + (_residual_add_bytes(h, w) if after_add else 0.0),
        saved_bytes=t * (h * (FP32_BYTES + 2 * a) + FP32_BYTES),
        # its output is saved by the projections after it (q, k, v; gate, up; the head), and
        # goes once the first of them (the next op) has run its backward, before this op's own
        saved_released_ahead=((1, t * h * a),),
        saved_input_bytes=t * h * FP32_BYTES if a == FP32_BYTES else 0,
        backward_transient_bytes=_norm_backward_bytes(t * h, a, in_block=block is not None),
        host_ops=HOST_OPS["norm"],
        launches=LAUNCHES[where],
    )


def _norm_backward_bytes(elements: int, a: int, *, in_block: bool) -> int:
    """What eager RMSNorm's backward holds at its peak (the autograd formulas of HF's
    ``LlamaRMSNorm``, their aten calls as ``hfmodel.trace`` records them): as the pow's gradient
    is made, four fp32 tensors of the input's shape are alive: the rsqrt multiply's gradient of
    the input, the mean's expanded gradient (``div``), ``2·x`` and their product. In a block the
    residual stream's gradient (activation dtype) is alive beside them; with fp32 activations
    the cast is the identity, so the first of the four is already summed into it."""
    residual = elements * a if in_block and a != FP32_BYTES else 0
    return 4 * elements * FP32_BYTES + residual


def _residual_add(name: str, h: int, w: Workload, block: int) -> LayerOp:
    """The residual add before a fused norm, its own eager kernel (an eager norm's op counts it)."""
    return LayerOp(
        name=name,
        module=name.rpartition(".")[0],
        kind=LayerKind.ELEMENTWISE,
        block=block,
        params=(),
        flops=0.0,
        memory_bytes=_residual_add_bytes(h, w),
        saved_bytes=0,
        host_ops=1,
        launches=(1, 0),
    )


def _linear(spec: ParamSpec, w: Workload, block: int | None) -> LayerOp:
    out_features, in_features = spec.shape
    return LayerOp(
        name=spec.module,
        module=spec.module,
        kind=LayerKind.LINEAR,
        block=block,
        params=(spec,),
        flops=2.0 * w.tokens * in_features * out_features,
        memory_bytes=0.0,
        saved_bytes=0,
        gemm=(w.tokens, out_features, in_features),
        host_ops=HOST_OPS["linear"],
        launches=LAUNCHES["linear"],
    )


def stack_masks(cfg: ModelConfig, ops: Sequence[LayerOp], w: Workload) -> tuple[StackMask, ...]:
    """The attention masks HF's stacks build once per forward before their first block
    (``masking_utils``: one per causal pattern, ``create_causal_mask`` and, for sliding-window
    layers, ``create_sliding_window_causal_mask``), each with the blocks whose attention is given
    it (a pattern: the call's stack, window and lengths; Gemma 2's full and sliding-window layers,
    each layer given its own type's mask, ``causal_mask_mapping[config.layer_types[i]]``; T5's
    encoder and its decoder's cross-attention, ``create_bidirectional_mask``).

    Eager: an additive float mask per causal pattern (``eager_mask`` never skips one), batch × 1 ×
    queries × keys in the activation dtype. SDPA's kernels: a causal flag and no mask, but for a
    window its keys reach, a collator's padding or packed documents (``AttentionShape.sdpa_bool_mask``,
    and T5's padded biased calls, ``AttentionShape.bias_rows``): a boolean
    mask, one byte per query and key, its batch an expanded view where only the window makes it
    (measured: 4,096 B at 64 tokens, held by the checkpointed blocks like the float one), one row
    per sequence where padding or packing does (measured: 8,192 B at 2 × 64). None for a
    bidirectional call without padding. T5's encoder calls, whose bias is learned, fold the mask
    into it with ``torch.where``, whose backward keeps the mask until the first of them has run
    (measured on tiny-t5 at 2 × 64 with 40 real tokens a row: 8,192 B more at the loss's backward,
    16,384 B with the decoder's cross-attention mask under full checkpointing)."""
    eager = w.attention_kernel == "eager"
    d = cfg.description
    stacks = d.stacks if d is not None else ("",) * cfg.n_layers
    patterns: dict[tuple[str, int | None, int, int], tuple[int, set[int], bool]] = {}
    for op in ops:
        a = op.attention
        if a is None or op.block is None:
            continue
        folded = a.folds_mask  # T5's padding folded into its bias
        if not ((eager and (a.causal or a.row_mask)) or a.sdpa_bool_mask or folded):
            continue
        key = (stacks[op.block], a.window, a.seq_len, a.kv_len)
        rows = a.batch if eager or a.row_mask else 1
        nbytes = rows * a.seq_len * a.kv_len * (w.act_bytes if eager else 1)
        _, blocks, kept = patterns.setdefault(key, (nbytes, set(), False))
        blocks.add(op.block)
        patterns[key] = (nbytes, blocks, kept or (folded and a.bias_grad))
    masks = []
    for (stack, *_), (n, blocks, kept) in patterns.items():
        in_stack = [b for b, s in enumerate(stacks) if s == stack]
        masks.append(
            StackMask(
                bytes=n,
                blocks=frozenset(blocks),
                stack_first=in_stack[0],
                stack_last=in_stack[-1],
                kept_for_backward=kept,
            )
        )
    return tuple(masks)


def _attention(cfg: ModelConfig, i: int, w: Workload) -> LayerOp:
    t, a = w.tokens, w.act_bytes
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_dim
    padding_mask, document_mask = row_masks_for(w, bias=False, softcap=False)
    shape = AttentionShape(
        batch=w.micro_batch,
        seq_len=w.seq_len,
        heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        padding_mask=padding_mask,
        document_mask=document_mask,
    )
    flops, saved, fwd_transient, bwd_transient = attention_kernel_figures(shape, w)
    return LayerOp(
        name=f"{layer_prefix(i)}.self_attn.attention",
        module=f"{layer_prefix(i)}.self_attn",
        kind=LayerKind.ATTENTION,
        block=i,
        params=(),
        flops=flops,
        memory_bytes=10.0 * t * (q_dim + kv_dim) * a
        + 2.0 * t * q_dim * a  # RoPE on q and k, the output's copy
        + mask_path_bytes(shape, w)[0],
        saved_bytes=saved,
        forward_transient_bytes=fwd_transient,
        backward_transient_bytes=bwd_transient,
        attention=shape,
        host_ops=HOST_OPS["attention"],
        launches=LAUNCHES["attention"],
    )


def _mlp_act(cfg: ModelConfig, i: int, w: Workload) -> LayerOp:
    t, a, f = w.tokens, w.act_bytes, cfg.ffn_hidden
    return LayerOp(
        name=f"{layer_prefix(i)}.mlp.act",
        module=f"{layer_prefix(i)}.mlp",
        kind=LayerKind.MLP_ACT,
        block=i,
        params=(),
        flops=0.0,
        memory_bytes=5.0 * t * f * a + _residual_add_bytes(cfg.hidden, w),
        saved_bytes=4 * t * f * a,
        # the product is saved by down_proj, and goes once down_proj's backward has run
        saved_released_ahead=((1, t * f * a),),
        # its backward peaks as the product's gradient (down_proj's) makes the gradients of the
        # SiLU output and of up's (three t x f tensors), beside the residual's gradient; SiLU's
        # backward then makes gate's as the first is dropped (``hfmodel.trace``: HF's LlamaMLP)
        backward_transient_bytes=3 * t * f * a + t * cfg.hidden * a,
        host_ops=HOST_OPS["mlp_act"],
        launches=LAUNCHES["mlp_act"],
    )


def _sac_kept(ops: list[LayerOp], w: Workload) -> list[LayerOp]:
    """Mark what torchtitan's op-level policy keeps in one block (``_apply_ac_to_transformer_block``,
    ``_save_list``): the output of every mm but every second one (counted from 1 in forward order:
    q, v, gate and down are kept, k, o and up recomputed) and the attention kernel's output with its
    fp32 log-sum-exp."""
    kept, mm = [], 0
    for op in ops:
        if op.gemm is not None:
            mm += 1
            m, n, _ = op.gemm
            op = replace(op, sac_kept_bytes=m * n * w.act_bytes) if mm % 2 else op
        elif op.attention is not None:
            a = op.attention
            out = a.batch * a.seq_len * (a.heads * a.head_dim * w.act_bytes + a.heads * FP32_BYTES)
            op = replace(op, sac_kept_bytes=out)
        kept.append(op)
    return kept


def block_ops(cfg: ModelConfig, i: int, w: Workload) -> list[LayerOp]:
    """Decoder layer ``i`` in HF execution order."""
    q, k, v, o, gate, up, down, norm1, norm2 = layer_params(cfg, i)
    p = layer_prefix(i)
    return _sac_kept(
        [
            _norm(f"{p}.input_layernorm", (norm1,), cfg.hidden, w, i),
            _linear(q, w, i),
            _linear(k, w, i),
            _linear(v, w, i),
            _attention(cfg, i, w),
            _linear(o, w, i),
            *([_residual_add(f"{p}.residual_add", cfg.hidden, w, i)] if w.norm is NormKernel.FUSED else []),
            _norm(f"{p}.post_attention_layernorm", (norm2,), cfg.hidden, w, i, after_add=True),
            _linear(gate, w, i),
            _linear(up, w, i),
            _mlp_act(cfg, i, w),
            _linear(down, w, i),
        ],
        w,
    )


def model_buffer_bytes(cfg: ModelConfig) -> int:
    """HF's LlamaRotaryEmbedding keeps ``inv_freq`` and ``original_inv_freq`` (head_dim/2 fp32 each);
    FSDP does not shard buffers. A described model: the buffers ``transformers`` built."""
    if cfg.description is not None:
        return cfg.description.buffer_bytes
    return 2 * (cfg.head_dim // 2) * FP32_BYTES


@cache
def llama_layer_ops(cfg: ModelConfig, w: Workload) -> tuple[LayerOp, ...]:
    """Every op of one forward pass in execution order: embedding, blocks, final norm, head, loss."""
    specs = {s.name: s for s in param_specs(cfg)}
    embed = specs["model.embed_tokens.weight"]
    ops = list(_input_ops(cfg, w, embed))
    for i in range(cfg.n_layers):
        ops += block_ops(cfg, i, w)
    ops.append(_norm("model.norm", (specs["model.norm.weight"],), cfg.hidden, w, None))
    head = _linear(specs.get("lm_head.weight", embed), w, None)
    head_params = () if cfg.tie_embeddings else head.params
    if w.loss is LossKernel.FUSED:
        ops.append(fused_linear_cross_entropy(head, cfg, w, head_params))
        return tuple(ops)
    ops.append(
        LayerOp(
            name="lm_head",
            module="lm_head",
            kind=LayerKind.LINEAR,
            block=None,
            params=head_params,
            flops=head.flops,
            memory_bytes=0.0,
            saved_bytes=0,
            # its backward holds the logits' gradient (activation dtype) while it makes its input's
            backward_transient_bytes=w.tokens * (cfg.vocab + cfg.hidden) * w.act_bytes,
            gemm=head.gemm,
            host_ops=HOST_OPS["linear"],
            launches=LAUNCHES["linear"],
        )
    )
    ops.append(_eager_loss(cfg, w))
    return tuple(ops)


def _input_ops(cfg: ModelConfig, w: Workload, embed: ParamSpec) -> tuple[LayerOp, LayerOp]:
    """The token embedding and the rotary tables the blocks share, before the first block."""
    t, a = w.tokens, w.act_bytes
    return (
        LayerOp(
            name="model.embed_tokens",
            module="model.embed_tokens",
            kind=LayerKind.EMBED,
            block=None,
            params=(embed,),
            flops=0.0,
            memory_bytes=float(2 * t * cfg.hidden * a),
            saved_bytes=t * INDEX_BYTES,  # the token ids
            host_ops=HOST_OPS["embed"],
            launches=LAUNCHES["embed"],
        ),
        LayerOp(
            name="model.rotary_emb",
            module="model.rotary_emb",
            kind=LayerKind.ROTARY,
            block=None,
            params=(),
            flops=0.0,
            memory_bytes=float(2 * w.seq_len * cfg.head_dim * a),
            # cos and sin of one row of positions, shared by every layer (packed rows' per row:
            # ``sim.workload.forward``)
            saved_bytes=2 * w.seq_len * cfg.head_dim * a,
            host_ops=HOST_OPS["rotary"],
            launches=LAUNCHES["rotary"],
        ),
    )


def _eager_loss(cfg: ModelConfig, w: Workload) -> LayerOp:
    """HF's eager cross-entropy over the head's logits: their fp32 copy, the log-softmax it keeps,
    and the two fp32 gradients of its backward."""
    t, a, vocab = w.tokens, w.act_bytes, cfg.vocab
    upcast = 0 if a == FP32_BYTES else t * vocab * FP32_BYTES
    return LayerOp(
        name="loss",
        module="loss",
        kind=LayerKind.LOSS,
        block=None,
        params=(),
        flops=0.0,
        memory_bytes=float(t * vocab * (_cast_bytes(a) // 2 + 3 * FP32_BYTES)),
        backward_memory_factor=22 / 18,
        saved_bytes=t * vocab * FP32_BYTES + t * INDEX_BYTES,  # log-softmax output, labels
        forward_transient_bytes=t * vocab * a + upcast,  # the logits and their fp32 copy
        # the fp32 grads of the log-softmax output and of its input; the cast back to ``a`` comes
        # after the first is freed, so it never adds to the peak
        backward_transient_bytes=2 * t * vocab * FP32_BYTES,
        host_ops=HOST_OPS["loss"],
        launches=LAUNCHES["loss"],
    )
