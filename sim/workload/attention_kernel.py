"""The attention kernel's own share of an attention op: its FLOPs, what it saves for backward and
what it holds beside that in forward and backward, the tensors those bytes are made of and the
order in which it makes and frees them (the caching allocator's replay, ``sim.outputs.allocator``).

One function per figure, for every kernel a scenario names: fused kernels (flash,
memory-efficient, cuDNN: the log-sum-exp and an fp32 dq accumulator), the math path of
``F.scaled_dot_product_attention`` (fp32 copies and the s² softmax, measured here) and a model's
own eager attention, op by op (``sim.workload.eager_attention``). ``sim.workload.layers`` builds
the Llama ops on it; ``sim.workload.described`` a described model's attention op.
"""

from sim.dtypes import FP32_BYTES
from sim.workload.eager_attention import (
    eager_score_backward_requests,
    eager_score_bytes,
    eager_score_requests,
    eager_score_saved_pieces,
)
from sim.workload.shapes import AttentionShape, Request, Workload

# The math path of ``F.scaled_dot_product_attention`` (torch 2.13 ``_scaled_dot_product_attention_math``,
# measured here with saved-tensor hooks and live storages on bf16 and fp32 inputs, 64-1,024
# tokens): it upcasts q, k and v to fp32 (its default, ``allow_fp16_bf16_reduction_math_sdp``
# off) and saves them and the fp32 softmax; with dropout also the fp32 dropout mask and the
# dropped probabilities. Its forward's peak above what it saves (the simulator holds an op's
# transient on top of its saved bytes) is one low-precision copy of the scores (2 B per score for
# bf16 inputs, none for fp32: the fp32 scores are gone by the time the saved softmax and dropout
# tensors exist); its backward holds 4 B per score above where it starts (the fp32 score gradient,
# net of the saves it releases). A learned additive bias adds nothing to that: its gradient (the
# score gradient summed over the batch, then cast to the bias's dtype) is made after the softmax
# backward, once the dropout's and softmax's saves are gone (measured 2026-12-07 on the math path
# with a bf16 [1, 4, 512, 512] bias, 16-wide heads, dropout 0.1, batch 1 and 2: 4.25 B per score
# above the start with and without the bias needing a gradient, q, k and v's gradients included;
# the 4 B of fp32 per bias element the model held before put t5's checkpointed encoder blocks
# 12-16 % high, tiny-t5 at 1 × 512 with a 128-token decoder).
MATH_SAVED_BYTES_PER_SCORE = FP32_BYTES
MATH_DROPOUT_SAVED_BYTES_PER_SCORE = 2 * FP32_BYTES
MATH_BACKWARD_TRANSIENT_BYTES_PER_SCORE = FP32_BYTES


def _math_figures(shape: AttentionShape, w: Workload, output_saved: bool) -> tuple[int, int, int]:
    """(saved, forward transient, backward transient bytes) of the math path (see above)."""
    t, t_kv = shape.batch * shape.seq_len, shape.batch * shape.kv_len
    q_dim = shape.heads * shape.head_dim
    kv_dim = shape.kv_heads * (shape.head_dim + (shape.v_head_dim or shape.head_dim))
    out_dim = shape.heads * (shape.v_head_dim or shape.head_dim)
    scores = t * shape.heads * shape.kv_len
    per_score = MATH_SAVED_BYTES_PER_SCORE + (MATH_DROPOUT_SAVED_BYTES_PER_SCORE if shape.dropout else 0)
    saved = FP32_BYTES * (t * q_dim + t_kv * kv_dim) + scores * per_score
    saved += t * out_dim * w.act_bytes if output_saved else 0
    forward = _math_forward_beyond_saved(shape, w) + folded_bias_bytes(shape, w.act_bytes)
    return saved, forward, scores * MATH_BACKWARD_TRANSIENT_BYTES_PER_SCORE


def _math_forward_beyond_saved(shape: AttentionShape, w: Workload) -> int:
    """The math path's forward peak beyond what it saves, for low-precision inputs (none for
    fp32): the low-precision copy of the scores and, with dropout, beside it the fp32 copies of q
    and k before their scaling (held to the call's end) and the fp32 output before its cast
    (measured 2026-12-08 with live storages on bf16 inputs, a learned bias and dropout 0.1, to the
    byte: batch 1-2, 4 heads, head dims 16-32, values 16-32 wide, 128-256 queries over 256 keys,
    ``tests/test_math_attention_memory.py``). Without dropout the peak differs (about 4 B per
    score: not modelled); GQA's ``enable_gqa`` expansion adds k and v at the key/value heads (not
    modelled: transformers repeats them before a masked call)."""
    if w.act_bytes >= FP32_BYTES:
        return 0
    t, t_kv = shape.batch * shape.seq_len, shape.batch * shape.kv_len
    scores = t * shape.heads * shape.kv_len
    beside = 0
    if shape.dropout:
        q_k = (t + t_kv) * shape.head_dim
        beside = FP32_BYTES * shape.heads * (q_k + t * (shape.v_head_dim or shape.head_dim))
    return scores * w.act_bytes + beside


def _eager_figures(shape: AttentionShape, w: Workload, output_saved: bool) -> tuple[int, int, int]:
    """(saved, forward transient, backward transient bytes) of a model's eager attention, op by op
    (``sim.workload.eager_attention``): q; k and v as ``repeat_kv`` copies them to every query
    head (the matmuls keep the copies); the s² tensors per score. Beside them in forward the
    ``@ v`` matmul's output before its ``transpose().contiguous()`` copy; in backward, the
    output's gradient made contiguous and the copied values' gradient with the probabilities'
    (the first step), or the s² peak. In a model (``backward_start_bytes`` known) the backward
    is ``_eager_backward_in_model``'s."""
    t, t_kv = shape.batch * shape.seq_len, shape.batch * shape.kv_len
    a, dv = w.act_bytes, shape.v_head_dim or shape.head_dim
    scores = t * shape.heads * shape.kv_len
    out = t * shape.heads * dv * a
    per = eager_score_bytes(a, softcap=shape.softcap, dropout=shape.dropout > 0)
    saved = t * shape.heads * shape.head_dim * a + t_kv * shape.heads * (shape.head_dim + dv) * a
    saved += scores * per.saved + (out if output_saved else 0)
    if shape.backward_start_bytes is not None:
        return saved, max(scores * per.forward_peak, out), _eager_backward_in_model(shape, w)
    # with as many key/value heads as query heads the values' gradient is the model's (the probe's)
    repeated_v_grad = t_kv * shape.heads * dv * a if shape.kv_heads < shape.heads else 0
    backward = max(scores * per.backward_peak, scores * per.av_backward + out + repeated_v_grad)
    return saved, max(scores * per.forward_peak, out), backward


def _eager_backward_in_model(shape: AttentionShape, w: Workload) -> int:
    """The eager attention's backward peak inside the model, above everything its op saved: what
    the model holds as it starts (``backward_start_bytes``: the output's gradient, the residual
    stream's), less the op's output, which its consumer's backward (the output projection's) has
    released by then; then the kernel's steps. First the ``@ v`` matmul's backward: the
    gradient's contiguous copy, the probabilities' gradient and the values' gradient (as
    ``repeat_kv`` copied them). Then it releases the probabilities' cast and the values it kept
    (as large as their gradient), and the output's gradient and its copy are gone: from there the
    s² steps of ``eager_score_bytes`` (the softmax backward's two fp32 gradients). Measured in
    fake mode on transformers' Llama (tests/test_eager_ac.py)."""
    assert shape.backward_start_bytes is not None
    t, t_kv = shape.batch * shape.seq_len, shape.batch * shape.kv_len
    a, dv = w.act_bytes, shape.v_head_dim or shape.head_dim
    scores = t * shape.heads * shape.kv_len
    out, v_grad = t * shape.heads * dv * a, t_kv * shape.heads * dv * a
    per = eager_score_bytes(a, softcap=shape.softcap, dropout=shape.dropout > 0)
    start = shape.backward_start_bytes - out  # the op's output released
    return max(start + out + scores * per.av_backward + v_grad, start - out + scores * per.backward_peak)


def _fused_bias_bytes(shape: AttentionShape, a: int) -> tuple[int, int]:
    """A fused kernel given an additive bias (T5's relative position bias; flash takes none, so
    SDPA runs memory-efficient attention): it keeps the bias, one per call broadcast over the
    batch or, with padding folded in, one per row (``AttentionShape.bias_rows``), its last
    dimension padded to 16, and, when the bias is learned, its backward allocates the bias's
    gradient in the broadcast shape, batch × heads × queries × padded keys (torch 2.13
    ``_efficient_attention_backward``, ``grad_bias = at::empty(bias->sizes())``).
    Not validated: no GPU here (the CPU runs the math path)."""
    padded = 16 * ((shape.kv_len + 15) // 16)
    per_batch = shape.heads * shape.seq_len * padded * a
    return shape.bias_rows * per_batch, shape.batch * per_batch if shape.bias_grad else 0


def folded_bias_bytes(shape: AttentionShape, a: int) -> int:
    """What a call whose padding is folded into its bias (``AttentionShape.bias_rows``) holds
    beyond the unpadded call while its kernel runs: ``create_position_bias_mask``'s batch ×
    heads × queries × keys ``torch.where`` output (or its ``contiguous()`` copy), less the
    heads × queries × keys copy the unpadded call made of a learned bias, which reaches it as
    ``compute_bias``'s permuted view (the decoder's zero cross-attention bias is contiguous:
    nothing copied). Measured on tiny-t5 at 1 × 512 with a 128-token decoder, fp32, on the
    CPU's math path: the encoder's calls one 4 MiB ``where`` output and its copy in place of the
    unpadded 4 MiB copy, the cross-attention's one 1 MiB ``where`` output more. Freed as the
    call returns (the math path saves neither; a fused kernel keeps it, ``_fused_bias_bytes``).
    The ``where`` backward's batch-sized gradient comes after the kernel's backward has freed
    more (measured: below the math path's backward peak), so it adds nothing there."""
    if not shape.folds_mask:
        return 0
    return (shape.bias_rows - (1 if shape.bias_grad else 0)) * shape.heads * shape.seq_len * shape.kv_len * a


def fused_kernel(kernel: str) -> bool:
    """Whether ``kernel`` is one of SDPA's fused kernels (flash, memory-efficient, cuDNN), not the
    math path or a model's eager attention."""
    return kernel not in ("math", "eager")


def _fused(w: Workload) -> bool:
    return fused_kernel(w.attention_kernel)


def converted_mask_bytes(shape: AttentionShape, w: Workload) -> int:
    """The additive mask a fused kernel keeps where transformers' SDPA path gives it a boolean one
    (``AttentionShape.sdpa_bool_mask``: a reached window, a collator's padding): the boolean mask
    converted for each call, batch × queries × keys in the query's dtype (measured: Mistral's
    window and Llama's padding on the CPU's flash kernel, one per block). Memory-efficient attention, which SDPA runs on a GPU given a mask, pads the keys to a
    multiple of 16 where they are not one: not counted (a training length is one)."""
    if not _fused(w) or not shape.sdpa_bool_mask:
        return 0
    return shape.batch * shape.seq_len * shape.kv_len * w.act_bytes


def mask_path_bytes(shape: AttentionShape, w: Workload) -> tuple[int, int]:
    """(forward, backward) bytes moved around a fused kernel that transformers' SDPA path gives a
    boolean mask (``AttentionShape.sdpa_bool_mask``), beyond what the model's ops move without
    one: forward, the mask's conversion to the query's dtype (reads a byte, writes one element
    per query and key) and ``repeat_kv``'s copies of k and v (reads them at the key/value heads,
    writes them at every query head); backward, the copies' gradients summed back to the
    key/value heads (the same bytes). A call whose padding is folded into its bias
    (``AttentionShape.bias_rows``): forward, ``torch.where`` reads the boolean mask and the bias
    and writes one per row, and a learned bias's ``contiguous()`` copy grows as large; backward,
    a learned bias's ``where`` reads the mask and the gradient and writes it masked."""
    if _fused(w) and shape.folds_mask:
        bias = shape.heads * shape.seq_len * shape.kv_len * w.act_bytes
        rows, mask = shape.bias_rows * bias, shape.batch * shape.seq_len * shape.kv_len
        copy_growth = 2 * (rows - bias) if shape.bias_grad else 0
        return mask + bias + rows + copy_growth, mask + 2 * rows if shape.bias_grad else 0
    if not _fused(w) or not shape.sdpa_bool_mask:
        return 0, 0
    convert = shape.batch * shape.seq_len * shape.kv_len * (1 + w.act_bytes)
    repeat = 0
    if (heads := _kept_kv_heads(shape, w)) > shape.kv_heads:
        dims = shape.head_dim + (shape.v_head_dim or shape.head_dim)
        repeat = shape.batch * shape.kv_len * dims * (shape.kv_heads + heads) * w.act_bytes
    return convert + repeat, repeat


def _kept_kv_heads(shape: AttentionShape, w: Workload) -> int:
    """The heads of the k and v the kernel keeps: every query head where they are ``repeat_kv``'s
    copies (the eager path; the SDPA path given a mask, ``use_gqa_in_sdpa`` false), else the
    model's key/value heads (SDPA's own GQA)."""
    repeated = w.attention_kernel == "eager" or (_fused(w) and shape.sdpa_bool_mask)
    return shape.heads if repeated else shape.kv_heads


def attention_saved_pieces(
    shape: AttentionShape, w: Workload, *, output_saved: bool = True
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The tensors behind ``attention_kernel_figures``' saved bytes, in the order they are made,
    as (q, k and v; the kernel's own; the output where counted here): q, k and v (the eager
    path's ``repeat_kv`` copies at the query heads), then a fused kernel's fp32 log-sum-exp (and
    a bias) or the eager path's s² tensors; the math path as one block of its own."""
    a, dv = w.act_bytes, shape.v_head_dim or shape.head_dim
    t, t_kv = shape.batch * shape.seq_len, shape.batch * shape.kv_len
    q = t * shape.heads * shape.head_dim * a
    out = (t * shape.heads * dv * a,) if output_saved else ()
    if w.attention_kernel == "eager":
        per = eager_score_saved_pieces(a, softcap=shape.softcap, dropout=shape.dropout > 0)
        scores = t * shape.heads * shape.kv_len
        kv = (t_kv * shape.heads * shape.head_dim * a, t_kv * shape.heads * dv * a)
        return (q, *kv), tuple(scores * n for n in per), out
    if w.attention_kernel == "math":
        return (), (attention_kernel_figures(shape, w, output_saved=output_saved)[1],), ()
    heads = _kept_kv_heads(shape, w)
    kv = (t_kv * heads * shape.head_dim * a, t_kv * heads * dv * a)
    bias = (_fused_bias_bytes(shape, a)[0],) if shape.bias else ()
    mask = (converted_mask_bytes(shape, w),) if shape.sdpa_bool_mask else ()
    return (q, *kv), (t * shape.heads * FP32_BYTES, *bias, *mask), out


# the first number the attention kernel's own tensors take (counting down, apart from the model's
# storages and from the eager per-score table's -1, -2, ...)
KERNEL_TENSOR_IDS = -100


def attention_kernel_requests(
    shape: AttentionShape, w: Workload, *, output_saved: bool = True
) -> tuple[tuple[Request, ...], tuple[Request, ...]]:
    """The order in which the attention kernel makes its own tensors in forward (those of
    ``attention_saved_pieces``' second and third parts; q, k and v are the model's, which the
    trace marks kept), and the same where its block is checkpointed (all freed once it has run).
    Eager: ``repeat_kv``'s copies where there are fewer key/value heads, the s² tensors op by op
    (``eager_score_requests``), then the ``@ v`` matmul's output before its contiguous copy; a
    fused kernel its log-sum-exp (and bias), given a mask by the SDPA path ``repeat_kv``'s copies
    first and the converted mask last; the math path its saved block (the output in it) and its
    low-precision copy. The output where the kernel counts it, kept, last."""
    a, dv = w.act_bytes, shape.v_head_dim or shape.head_dim
    t, t_kv = shape.batch * shape.seq_len, shape.batch * shape.kv_len
    out_bytes = t * shape.heads * dv * a
    ids = iter(range(KERNEL_TENSOR_IDS, KERNEL_TENSOR_IDS - 100, -1))
    requests: list[Request] = []
    if _kept_kv_heads(shape, w) > shape.kv_heads:
        requests += [
            (next(ids), -t_kv * shape.heads * shape.head_dim * a),
            (next(ids), -t_kv * shape.heads * dv * a),
        ]
    if w.attention_kernel == "eager":
        scores = t * shape.heads * shape.kv_len
        per = eager_score_requests(a, softcap=shape.softcap, dropout=shape.dropout > 0)
        requests += [(i, n * scores) for i, n in per]
        before_copy = next(ids)
        requests += [(before_copy, out_bytes), (before_copy, 0)]
    elif w.attention_kernel == "math":  # one saved block (its output included), as its figures
        saved, _, _ = _math_figures(shape, w, output_saved)
        beyond = _math_forward_beyond_saved(shape, w)
        folded = folded_bias_bytes(shape, a)
        folded_id = next(ids) if folded else 0
        requests += [(folded_id, folded)] if folded else []
        requests.append((next(ids), -saved))
        if beyond:
            low = next(ids)
            requests += [(low, beyond), (low, 0)]
        requests += [(folded_id, 0)] if folded else []
        output_saved = False
    else:
        requests.append((next(ids), -t * shape.heads * FP32_BYTES))
        if shape.bias:
            requests.append((next(ids), -_fused_bias_bytes(shape, a)[0]))
        if shape.sdpa_bool_mask:
            requests.append((next(ids), -converted_mask_bytes(shape, w)))
    if output_saved:
        requests.append((next(ids), -out_bytes))
    made = [i for i, n in requests if n != 0]
    freed = {i for i, n in requests if n == 0}
    checkpointed = [(i, abs(n)) if n else (i, 0) for i, n in requests]
    checkpointed += [(i, 0) for i in made if i not in freed]
    return tuple(requests), tuple(checkpointed)


def attention_kernel_backward_requests(
    shape: AttentionShape, w: Workload, *, output_saved: bool = True
) -> tuple[Request, ...]:
    """The attention kernel's backward as it makes and frees its own gradients, releasing the
    tensors its forward kept (``attention_kernel_requests``' numbers) once it has read them: the
    eager path op by op (``eager_score_backward_requests``), a fused kernel its fp32 dq
    accumulator, the math path its transient, each as one tensor; what is kept and not yet
    released goes as it ends."""
    forward, _ = attention_kernel_requests(shape, w, output_saved=output_saved)
    out: list[Request] = []
    if w.attention_kernel == "eager":
        scores = shape.batch * shape.seq_len * shape.heads * shape.kv_len
        per = eager_score_backward_requests(w.act_bytes, softcap=shape.softcap, dropout=shape.dropout > 0)
        out += [(tensor, n * scores) for tensor, n in per]
    else:
        t = shape.batch * shape.seq_len
        transient = (
            _math_figures(shape, w, output_saved)[2]
            if w.attention_kernel == "math"
            else t * shape.heads * shape.head_dim * FP32_BYTES
        )
        own = KERNEL_TENSOR_IDS - 50
        out += [(own, transient), (own, 0)] if transient else []
    released = {tensor for tensor, n in out if n == 0}
    out += [(tensor, 0) for tensor, n in forward if n < 0 and tensor not in released]
    return tuple(out)


def attention_kernel_figures(
    shape: AttentionShape, w: Workload, *, output_saved: bool = True, model_backward_bytes: int = 0
) -> tuple[float, int, int, int]:
    """(forward FLOPs, saved, forward transient, backward transient bytes) of the attention kernel:
    the transients are what it adds to the op's own (the model's work around it; its backward
    transient ``model_backward_bytes``).

    A fused kernel (flash, memory-efficient, cuDNN) keeps q, k, v, its output and the fp32
    log-sum-exp, and its backward an fp32 dq accumulator; causal masking halves its FLOPs and a
    sliding window skips the pairs outside it; its dropout keeps a random seed, not a mask. Given
    a mask by transformers' SDPA path (``AttentionShape.sdpa_given_mask``) it computes every pair
    (``is_causal`` off, the window or causality only in the mask); a boolean mask (a window's, a
    padding's) it keeps, with k and v as ``repeat_kv`` copies them to every query head
    (``sdpa_bool_mask``), a bias as
    ``_fused_bias_bytes`` says. The
    math path keeps fp32 copies and the s² softmax (``_math_figures``), a model's eager attention
    its s² tensors op by op (``_eager_figures``). ``output_saved=False``
    when the output is counted elsewhere (a described model measures it at the output
    projection). Queries and keys count the call's own tokens: an encoder-decoder's decoder
    attends over ``decoder_seq_len`` queries, its cross-attention over the encoder's ``seq_len`` keys.
    """
    a, s = w.act_bytes, shape.kv_len
    t, t_kv = shape.batch * shape.seq_len, shape.batch * s
    q_dim = shape.heads * shape.head_dim
    out_dim = shape.heads * (shape.v_head_dim or shape.head_dim)
    kv_dim = _kept_kv_heads(shape, w) * (shape.head_dim + (shape.v_head_dim or shape.head_dim))
    flash = _fused(w)
    if flash:
        saved = t * (a * (q_dim + (out_dim if output_saved else 0)) + FP32_BYTES * shape.heads)
        saved += t_kv * a * kv_dim + converted_mask_bytes(shape, w)
        fwd_transient, bwd_transient = 0, t * q_dim * FP32_BYTES  # the flash backward's fp32 dq
        if shape.bias:
            bias_saved, bias_grad = _fused_bias_bytes(shape, a)
            saved, bwd_transient = saved + bias_saved, bwd_transient + bias_grad
            if shape.folds_mask and shape.bias_grad:
                # padding folded into a learned bias: the ``where`` output beside the copy the
                # kernel keeps, and its backward's gradient beside the bias's once dq has gone
                where = shape.bias_rows * shape.heads * shape.seq_len * s * a
                fwd_transient = where
                bwd_transient = bias_grad + max(t * q_dim * FP32_BYTES, where)
    elif w.attention_kernel == "eager":
        saved, fwd_transient, bwd_transient = _eager_figures(shape, w, output_saved)
        if shape.backward_start_bytes is not None:  # a peak in the model, not on top of its own
            bwd_transient = max(0, bwd_transient - model_backward_bytes)
    else:
        saved, fwd_transient, bwd_transient = _math_figures(shape, w, output_saved)
    width = shape.heads * shape.flops_head_dim
    if flash and shape.sdpa_given_mask:  # every pair, the window or causality only in the mask
        flops = 4.0 * t * s * width
    elif flash and shape.window is not None and shape.window < s:  # keys attended per query, on average
        pairs = shape.window - shape.window**2 / (2.0 * s) if shape.causal else 2.0 * shape.window
        flops = 4.0 * t * pairs * width
    else:
        flops = 4.0 * t * s * width * (0.5 if flash and shape.causal else 1.0)
    return flops, saved, fwd_transient, bwd_transient
