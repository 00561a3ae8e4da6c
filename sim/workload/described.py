"""The layer ops of a described model (``sim.workload.description``), for the same consumers as
the hand-written Llama ops: the GPU kernel model (matmul shapes), the memory ledger (saved bytes
and transients), the host stream (Python-level calls) and selective checkpointing (kept outputs).

Each measured op becomes one ``LayerOp``; an attention op adds the attention kernel's own
FLOPs, saved bytes and transients for the kernel the profile runs
(``sim.workload.attention_kernel.attention_kernel_figures``). Ops were measured at one micro-batch,
sequence length and dtype; the scenario loader measures at the scenario's.
"""

from collections.abc import Sequence
from dataclasses import replace
from functools import cache

from sim.errors import UserError
from sim.workload.attention_kernel import (
    attention_kernel_backward_requests,
    attention_kernel_figures,
    attention_kernel_requests,
    attention_saved_pieces,
    mask_path_bytes,
)
from sim.workload.description import AttentionCall, DescribedOp, ModelDescription
from sim.workload.finetune import FinetuneFacts, dequant_bytes, dequant_transient_bytes
from sim.workload.layer_op import LayerKind, LayerOp
from sim.workload.layers import _sac_kept
from sim.workload.params import ParamSpec
from sim.workload.shapes import AttentionShape, Request, Workload, row_masks_for

KINDS = {k.value: k for k in LayerKind}
# the first number QLoRA's dequantized weights take as tensors of an op's requests (counting down,
# apart from the model's storages and the attention kernel's)
DEQUANT_TENSOR_IDS = -1000


def _check_workload(d: ModelDescription, w: Workload) -> None:
    measured = (d.micro_batch, d.seq_len, d.decoder_seq_len)
    decoder = None if d.decoder_seq_len is None else (w.decoder_seq_len or w.seq_len)
    if measured != (w.micro_batch, w.seq_len, decoder):
        raise UserError(
            f"model {d.name}: described at micro-batch {d.micro_batch} and sequence length {d.seq_len} "
            f"(decoder {d.decoder_seq_len}), asked for {w.micro_batch} and {w.seq_len} (decoder {decoder})"
        )


def _kernel_shape(a: AttentionCall, w: Workload, *, encoder_decoder: bool) -> AttentionShape:
    """The attention call the tracer recorded, as the kernel model's shape (given the collator's
    padding mask where ``w``'s rows are padded: the tracer's forward is given none). In an
    encoder-decoder the causal calls are its decoder's self-attention, over the labels' tokens,
    which the collator does not pad."""
    padding_mask, document_mask = row_masks_for(
        w, bias=a.bias, softcap=a.softcap, over_labels=encoder_decoder and a.causal
    )
    return AttentionShape(
        batch=a.batch,
        seq_len=a.seq_len,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        causal=a.causal,
        v_head_dim=a.v_head_dim if a.v_head_dim != a.head_dim else None,
        window=a.window,
        kv_seq_len=a.kv_seq_len,
        dropout=a.dropout,
        bias=a.bias,
        bias_grad=a.bias_grad,
        softcap=a.softcap,
        padding_mask=padding_mask,
        document_mask=document_mask,
        backward_start_bytes=a.backward_start_bytes,
    )


# kernels whose output takes the query's layout (torch 2.13's meta registrations: flash's and the
# CPU flash kernel's ``torch.empty_like(query)``, cuDNN's ``alloc_with_matching_layout(query, ...)``;
# memory-efficient attention's is ``empty(B, M, heads, Kv).transpose(1, 2)`` whatever the query's)
OUTPUT_AS_QUERY = frozenset({"flash", "cudnn"})


def kernel_output_saved(a: AttentionCall, w: Workload) -> bool:
    """Whether the kernel's saved output is a tensor of its own: the model's ops do not save it
    (``output_counted``), or they save transformers' ``transpose(1, 2).contiguous()`` copy of it,
    which copies where the kernel's output took a query not laid out as (batch, seq, heads, dim)
    (measured: GPT-NeoX on the CPU's flash kernel, one tokens x hidden tensor per block)."""
    return not a.output_counted or (a.query_not_bshd and w.attention_kernel in OUTPUT_AS_QUERY)


def _attention_op(
    op: DescribedOp, base: LayerOp, w: Workload, *, encoder_decoder: bool, makes_bias: bool
) -> LayerOp:
    assert op.attention is not None
    a = op.attention
    shape = _kernel_shape(a, w, encoder_decoder=encoder_decoder)
    output_saved = kernel_output_saved(a, w)
    flops, saved, fwd, bwd = attention_kernel_figures(
        shape, w, output_saved=output_saved, model_backward_bytes=base.backward_transient_bytes
    )
    qkv, own, out = attention_saved_pieces(shape, w, output_saved=output_saved)
    # the kernel's own tensors before the probe's (its output), which the kernel makes last
    kernel, kernel_checkpointed = attention_kernel_requests(shape, w, output_saved=output_saved)
    given = _given_bytes(shape, w, output_saved)
    kernel_backward = attention_kernel_backward_requests(shape, w, output_saved=output_saved)
    mask_fwd_bytes, mask_bwd_bytes = mask_path_bytes(shape, w)
    overlap = min(bwd, _bias_grads_after_kernel(shape, w, makes_bias=makes_bias))
    # the kernel's backward: twice its forward FLOPs (the convention of ``sim.costs.compute``)
    backward_flops = None if base.backward_flops is None else base.backward_flops + 2.0 * flops
    return LayerOp(
        name=base.name,
        module=base.module,
        kind=LayerKind.ATTENTION,
        block=base.block,
        params=base.params,
        flops=base.flops + flops,
        memory_bytes=base.memory_bytes + mask_fwd_bytes,
        saved_bytes=base.saved_bytes + saved + a.extra_saved_bytes,
        saved_pieces=_joined(base.saved_bytes, base.saved_pieces, *qkv, *own, *out, a.extra_saved_bytes),
        forward_transient_bytes=base.forward_transient_bytes + fwd,
        forward_transient_pieces=_joined(base.forward_transient_bytes, base.forward_transient_pieces, fwd),
        recompute_transient_bytes=None
        if base.recompute_transient_bytes is None
        else base.recompute_transient_bytes + fwd,
        recompute_transient_pieces=_joined(
            base.recompute_transient_bytes, base.recompute_transient_pieces, fwd
        ),
        # checkpointed: what the kernel makes and keeps or holds while it runs; its inputs as the
        # model hands them (q, k and v at the KV heads) and its output are already the block's
        checkpointed_forward_bytes=None
        if base.checkpointed_forward_bytes is None
        else base.checkpointed_forward_bytes + saved + fwd - given,
        checkpointed_forward_pieces=_joined(
            base.checkpointed_forward_bytes,
            base.checkpointed_forward_pieces,
            *_kernel_own_pieces(own, saved - given),
            fwd,
        ),
        backward_transient_bytes=base.backward_transient_bytes + bwd - overlap,
        backward_transient_pieces=_joined(
            base.backward_transient_bytes, base.backward_transient_pieces, bwd - overlap
        ),
        backward_requests=None
        if base.backward_requests is None
        else (*kernel_backward, *base.backward_requests),
        forward_requests=None if base.forward_requests is None else (*kernel, *base.forward_requests),
        checkpointed_forward_requests=None
        if base.checkpointed_forward_requests is None
        else (*kernel_checkpointed, *base.checkpointed_forward_requests),
        attention=shape,
        host_ops=base.host_ops,
        launches=base.launches,
        backward_gemms=base.backward_gemms,
        backward_flops=backward_flops,
        backward_memory_bytes=None
        if base.backward_memory_bytes is None
        else base.backward_memory_bytes + mask_bwd_bytes,
    )


def _bias_grads_after_kernel(shape: AttentionShape, w: Workload, *, makes_bias: bool) -> int:
    """Of the op's measured backward transient, the learned bias's gradients the math path makes
    only once its own backward has freed its s² gradients (``MATH_BACKWARD_TRANSIENT_BYTES_PER_SCORE``:
    the bias's gradient adds nothing to that peak): the call's own gradient, heads × queries × keys
    in the activation dtype, and in the block that made the bias (its stack's first) the sum of it
    and the gradient the later blocks accumulated, which the tracer's probe held beside it (the
    accumulated one is alive through the kernel's backward). The probe makes them while the
    model's other tensors are held, so the op's figure counted them on top of the kernel's
    gradients: t5's checkpointed encoder blocks, whose backward peaks there, read up to 10 % high
    (tiny-t5 at 2 × 512, fp32). A fused kernel's bias gradient is its own figure's."""
    if w.attention_kernel != "math" or not shape.bias_grad:
        return 0
    return (2 if makes_bias else 1) * shape.heads * shape.seq_len * shape.kv_len * w.act_bytes


def _joined(nbytes: int | None, pieces: tuple[int, ...], *more: int) -> tuple[int, ...]:
    """A measured figure's tensors (``pieces`` of its ``nbytes``) with what the formulas add to
    it, each a tensor; none where the figure's own are unknown (it then stays one block)."""
    if nbytes and sum(pieces) != nbytes:
        return ()
    return (*pieces, *(n for n in more if n > 0))


def _kernel_own_pieces(own: tuple[int, ...], own_bytes: int) -> tuple[int, ...]:
    """What a checkpointed block adds for the kernel: its own saved tensors (q, k, v and the
    output are the block's), and where ``repeat_kv`` copied fewer key/value heads, the copies'
    excess over the block's k and v as one block more."""
    extra = own_bytes - sum(own)
    if extra < 0:
        return (own_bytes,) if own_bytes > 0 else ()
    return (*own, extra) if extra else own


def _given_bytes(shape: AttentionShape, w: Workload, output_saved: bool) -> int:
    """Of the kernel's saved bytes, the tensors the block's own ops made (measured with the
    block): q, k and v as the model hands them (k and v at the KV heads; ``repeat_kv``'s
    copies, eager's or those of SDPA given a mask, are the kernel's) and, where the kernel's figures count it, the output."""
    t, t_kv, a = shape.batch * shape.seq_len, shape.batch * shape.kv_len, w.act_bytes
    dv = shape.v_head_dim or shape.head_dim
    given = t * shape.heads * shape.head_dim * a + t_kv * shape.kv_heads * (shape.head_dim + dv) * a
    return given + (t * shape.heads * dv * a if output_saved else 0)


def _dequantized(op: LayerOp, facts: FinetuneFacts, w: Workload) -> LayerOp:
    """QLoRA: the op's 4-bit weights dequantized before its forward matmul and, when its backward
    computes the input's gradient (a matmul there), again before that one
    (``sim.workload.finetune``)."""
    numels = [p.quantized_numel for p in op.params if p.quantized_numel]
    if not numels:
        return op
    a, dq = w.act_bytes, facts.double_quant
    moved = sum(dequant_bytes(n, a, dq) for n in numels)
    backward = bool(op.backward_gemms)
    # PEFT's lora.Linear4bit clones the base layer's output ("defensively", bnb.py): one more
    # read and write of it (its peak is no higher than the add that follows in the bf16 trace)
    if op.module.endswith(".base_layer") and op.gemm is not None:
        moved += 2 * op.gemm[0] * op.gemm[1] * a
    forward_pieces = [dequant_transient_bytes(n, a, dq, backward=False) for n in numels]

    def around(requests: tuple[Request, ...] | None, pieces: list[int]) -> tuple[Request, ...] | None:
        """Each weight dequantized as the op (or its backward) starts, freed as it ends."""
        made = tuple((DEQUANT_TENSOR_IDS - k, n) for k, n in enumerate(pieces))
        return None if requests is None else (*made, *requests, *((i, 0) for i, _ in made))

    backward_pieces = [dequant_transient_bytes(n, a, dq, backward=True) for n in numels] if backward else []
    forward_dequant = sum(forward_pieces)
    return replace(
        op,
        memory_bytes=op.memory_bytes + moved,
        forward_transient_bytes=op.forward_transient_bytes + forward_dequant,
        forward_transient_pieces=_joined(
            op.forward_transient_bytes, op.forward_transient_pieces, *forward_pieces
        ),
        recompute_transient_bytes=None
        if op.recompute_transient_bytes is None
        else op.recompute_transient_bytes + forward_dequant,
        recompute_transient_pieces=_joined(
            op.recompute_transient_bytes, op.recompute_transient_pieces, *forward_pieces
        ),
        checkpointed_forward_bytes=None
        if op.checkpointed_forward_bytes is None
        else op.checkpointed_forward_bytes + forward_dequant,
        checkpointed_forward_pieces=_joined(
            op.checkpointed_forward_bytes, op.checkpointed_forward_pieces, *forward_pieces
        ),
        forward_requests=around(op.forward_requests, forward_pieces),
        checkpointed_forward_requests=around(op.checkpointed_forward_requests, forward_pieces),
        backward_requests=around(op.backward_requests, backward_pieces),
        backward_memory_bytes=(op.backward_memory_bytes or 0.0) + (moved if backward else 0.0),
        backward_transient_bytes=op.backward_transient_bytes + sum(backward_pieces),
        backward_transient_pieces=_joined(
            op.backward_transient_bytes, op.backward_transient_pieces, *backward_pieces
        ),
    )


def _layer_op(
    op: DescribedOp, specs: dict[str, ParamSpec], w: Workload, *, encoder_decoder: bool, makes_bias: bool
) -> LayerOp:
    single = len(op.gemms) == 1 and op.gemms[0][3] == 1
    base = LayerOp(
        name=op.name,
        module=op.module,
        kind=KINDS.get(op.kind, LayerKind.ELEMENTWISE),
        block=op.block,
        params=tuple(specs[p] for p in op.params),
        flops=op.flops,
        memory_bytes=op.memory_bytes,
        saved_bytes=op.saved_bytes,
        saved_after_block_bytes=op.saved_after_block_bytes,
        next_block_input_bytes=op.next_block_input_bytes,
        saved_released_ahead=op.saved_released_ahead,
        forward_transient_bytes=op.forward_transient_bytes,
        backward_transient_bytes=op.backward_transient_bytes,
        checkpointed_forward_bytes=op.checkpointed_forward_bytes if op.block is not None else None,
        recompute_transient_bytes=op.recompute_transient_bytes if op.block is not None else None,
        recompute_transient_pieces=op.recompute_transient_pieces if op.block is not None else (),
        saved_pieces=op.saved_pieces,
        forward_transient_pieces=op.forward_transient_pieces,
        backward_transient_pieces=op.backward_transient_pieces,
        checkpointed_forward_pieces=op.checkpointed_forward_pieces if op.block is not None else (),
        forward_requests=op.forward_requests,
        checkpointed_forward_requests=op.checkpointed_forward_requests if op.block is not None else None,
        backward_requests=op.backward_requests,
        gemm=op.gemms[0][:3] if single else None,
        grouped_gemms=() if single else op.gemms,
        host_ops=op.host_ops,
        launches=(op.forward_launches, op.backward_launches),
        backward_gemms=op.backward_gemms,
        backward_flops=op.backward_flops,
        backward_memory_bytes=op.backward_memory_bytes,
        reuses=op.reuses,
    )
    if op.attention is None:
        return base
    return _attention_op(op, base, w, encoder_decoder=encoder_decoder, makes_bias=makes_bias)


def _with_sac(ops: Sequence[LayerOp], w: Workload) -> list[LayerOp]:
    """torchtitan's op-level policy applied block by block, as for the hand-written ops."""
    out: list[LayerOp] = []
    i = 0
    while i < len(ops):
        j = i
        while j < len(ops) and ops[j].block == ops[i].block:
            j += 1
        run = list(ops[i:j])
        out += _sac_kept(run, w) if ops[i].block is not None else run
        i = j
    return out


@cache
def described_layer_ops(d: ModelDescription, w: Workload) -> tuple[LayerOp, ...]:
    _check_workload(d, w)
    specs = {s.name: s for s in d.params}
    first_of_stack = d.stack_firsts
    ops = [
        _layer_op(
            op, specs, w, encoder_decoder=d.decoder_seq_len is not None, makes_bias=op.block in first_of_stack
        )
        for op in d.ops
    ]
    if d.finetune is not None and d.finetune.quantized:
        ops = [_dequantized(op, d.finetune, w) for op in ops]
    return tuple(_with_sac(ops, w))
