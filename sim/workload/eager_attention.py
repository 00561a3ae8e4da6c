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

FP32_BYTES = 4


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
