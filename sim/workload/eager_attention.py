"""What a model's own *eager* attention keeps and allocates, op by op, per score (query-key pair).

HF's ``eager_attention_forward`` (transformers 5.24, ``modeling_gemma2.py``; ``modeling_llama.py``
is the same without soft-capping), as torch 2.13 runs it. With ``a`` the activation dtype's bytes
and every s² tensor counted per score:

=====================================  =========  ==========================================
forward op                             bytes      kept for backward
=====================================  =========  ==========================================
``q @ k_repᵀ``, ``* scaling``          a, a       no (a multiply by a Python scalar saves nothing)
soft-capping ``/ cap``, ``tanh``,      a, a, a    tanh's output (its backward reads it)
``* cap``
``+ attention_mask``                   a          no
``softmax(dim=-1, dtype=float32)``     4 + 4      the fp32 output; the first 4 is the input's fp32
                                                  copy (``toType`` then ``_softmax``; none for an
                                                  fp32 input)
``.to(query.dtype)``                   a          by the ``@ v`` matmul (none for fp32: the softmax
                                                  output is the same tensor)
``dropout`` (p > 0)                    a, a       ``input * noise`` (the CPU composite,
                                                  ``at::_dropout``): the noise and the output, which
                                                  the ``@ v`` matmul keeps instead of the cast
=====================================  =========  ==========================================

The s² tensors not kept are freed as soon as the next op has run, so the forward's peak is the
softmax (the capped scores, the masked scores, the fp32 copy and the fp32 output live at once)
or, with dropout, the dropout (its input, the noise and the output beside the kept ones). The
backward, reversed: the ``@ v`` matmul's backward makes the probabilities' gradient (a) and then
releases what it kept; the dropout's multiply makes the input's gradient (a) and releases the
noise; the cast's backward its fp32 copy (4); the softmax backward the fp32 gradient of its
input (4), releasing its output afterwards; what follows (the cast back, soft-capping, the scale,
``q @ kᵀ``) is smaller than what has been released by then.

Measured on this CPU with saved-tensor hooks and the live storages of every aten call
(``tests/test_eager_attention.py`` runs the installed transformers' function and checks these
figures byte for byte, bf16 and fp32, with and without soft-capping and dropout). The same ATen
composites run on a GPU for bf16 (``softmax``'s fused ``half_to_float`` path is CUDA fp16 only);
a CUDA dropout is ``native_dropout`` instead (a 1-byte mask), not modelled.
"""

from dataclasses import dataclass

from sim.dtypes import FP32_BYTES


@dataclass(frozen=True, kw_only=True)
class EagerScoreBytes:
    """Bytes per score of the eager path: kept for backward; the forward's peak above what is kept;
    the backward's peak above what was live when it started (all that is kept included); and the
    first step of the backward, the probabilities' gradient the ``@ v`` matmul's backward makes
    while the value-sized gradients it makes beside it are alive."""

    saved: int
    forward_peak: int
    backward_peak: int
    av_backward: int


def eager_score_saved_pieces(a: int, *, softcap: bool, dropout: bool) -> tuple[int, ...]:
    """The tensors behind ``EagerScoreBytes.saved``, per score, in the order the forward makes
    them: tanh's output (soft-capping), the fp32 softmax, then the dropout's noise and output, or
    the cast back (none for fp32)."""
    upcast = a < FP32_BYTES
    pieces = ((a,) if softcap else ()) + (FP32_BYTES,)
    if dropout:
        return pieces + (a, a)
    return pieces + ((a,) if upcast else ())


def eager_score_bytes(a: int, *, softcap: bool, dropout: bool) -> EagerScoreBytes:
    """The table above for activation bytes ``a``, op by op (see the module docstring)."""
    upcast = a < FP32_BYTES  # softmax copies its input to fp32, and its output is cast back
    capped = a if softcap else 0  # tanh's output, kept
    copy = FP32_BYTES if upcast else 0
    cast = a if upcast else 0
    av_kept = a if dropout else cast  # what the ``@ v`` matmul keeps of the s² (beside the softmax's)
    saved = capped + FP32_BYTES + (2 * a if dropout else cast)
    forward = (
        capped + 2 * a,  # the mask add: its input and output
        capped + a + copy + FP32_BYTES,  # the softmax: masked scores, their fp32 copy, its output
        capped + a + FP32_BYTES + cast,  # the cast back, the masked scores still referenced
        capped + FP32_BYTES + cast + 2 * a if dropout else 0,  # the dropout: input, noise, output
    )
    # the backward as a running total over what was live at its start
    steps = [a]  # the probabilities' gradient; then the ``@ v`` matmul releases what it kept
    running = a - av_kept
    if dropout:  # the multiply by the noise: the input's gradient; then the noise and the
        steps.append(running + a)  # output's gradient are freed
        running -= a
    if upcast:  # the cast's backward: the gradient's fp32 copy; the low-precision one is freed
        steps.append(running + FP32_BYTES)
        running += FP32_BYTES - a
    steps.append(running + FP32_BYTES)  # the softmax backward: its input's fp32 gradient
    return EagerScoreBytes(
        saved=saved,
        forward_peak=max(0, max(forward) - saved),
        backward_peak=max(steps),
        av_backward=a,
    )


def eager_score_requests(a: int, *, softcap: bool, dropout: bool) -> tuple[tuple[int, int], ...]:
    """The table above as the forward allocates and frees it, per score: ``(tensor, bytes)`` pairs
    (``sim.workload.description.DescribedOp.forward_requests``: bytes > 0 a tensor the forward
    frees, < 0 one kept for backward, 0 the free of the tensor), tensors numbered -1, -2, ... (a
    kernel's own, apart from the model's storages). Each op's output is made before the input it
    was the last to read is freed; the masked scores stay referenced through the cast back (the
    softmax and the cast are one expression), the fp32 copy only through the softmax."""
    upcast = a < FP32_BYTES
    out: list[tuple[int, int]] = [(-1, a), (-2, a), (-1, 0)]  # q @ kᵀ, then its scaled copy
    scores = -2
    if softcap:  # / cap, tanh (kept), * cap
        out += [(-3, a), (scores, 0), (-4, -a), (-3, 0), (-5, a)]
        scores = -5
    out += [(-6, a), (scores, 0)]  # + attention_mask
    if upcast:  # softmax's fp32 copy of its input, its fp32 output (kept), the cast back
        out += [(-7, FP32_BYTES), (-8, -FP32_BYTES), (-7, 0), (-9, a if dropout else -a), (-6, 0)]
    else:
        out += [(-8, -FP32_BYTES), (-6, 0)]
    if dropout:  # the noise and the output, kept; the cast (low precision) freed
        out += [(-10, -a), (-11, -a)] + ([(-9, 0)] if upcast else [])
    return tuple(out)


def eager_score_backward_requests(a: int, *, softcap: bool, dropout: bool) -> tuple[tuple[int, int], ...]:
    """The table's backward as it allocates and frees, per score: ``(tensor, bytes)`` pairs,
    bytes > 0 a gradient it makes (numbered -21, -22, ...), 0 the free of one, or the release of a
    tensor the forward kept (``eager_score_requests``' numbers): autograd drops a saved tensor once
    the backward that read it has run. The ``@ v`` matmul's backward makes the probabilities'
    gradient, then releases what it kept (the cast, or the dropout's output); the dropout's
    multiply the input's gradient, then releases the noise; the cast's backward the fp32 copy; the
    softmax backward its input's fp32 gradient, then releases its output; then the cast back, the
    soft-capping's three steps (releasing tanh's output) and the scale each make a gradient as
    large as the scores and free the one before, and ``q @ kᵀ``'s backward reads the last."""
    upcast = a < FP32_BYTES
    out: list[tuple[int, int]] = [(-21, a)]
    if dropout:
        out.append((-11, 0))  # the @ v matmul kept the dropout's output
    elif upcast:
        out.append((-9, 0))  # ... or the cast back
    current = -21
    if dropout:  # * noise: the input's gradient; the noise and the output's gradient go
        out += [(-22, a), (current, 0), (-10, 0)]
        current = -22
    if upcast:  # the cast's backward: the gradient's fp32 copy
        out += [(-23, FP32_BYTES), (current, 0)]
        current = -23
    out += [(-24, FP32_BYTES), (current, 0), (-8, 0)]  # softmax backward; its output released
    current = -24
    following = [-25] if upcast else []  # the cast back to the scores' dtype
    following += [-26, -27, -28] if softcap else []  # * cap, tanh, / cap
    following.append(-29)  # the scale
    for tensor in following:
        out += [(tensor, a), (current, 0)]
        if tensor == -27:
            out.append((-4, 0))  # tanh's backward read its output
        current = tensor
    out.append((current, 0))  # q @ kᵀ's backward reads it
    return tuple(out)
