"""The attention biases a stack's first block makes and every later block of the stack takes as an
input (an encoder-decoder's: T5's relative position bias, ``position_bias``, and the decoder's zero
cross-attention bias), once per stack and kind of attention: one source for their bytes, which a
checkpointed block keeps among its inputs (``sim.workload.checkpointing.block_input_bytes``) and
whose gradient, where the bias is learned, the stack accumulates across its blocks' backwards
(``StackBias.accumulates``).
"""

from dataclasses import dataclass

from sim.workload.model import ModelConfig
from sim.workload.shapes import Workload


@dataclass(frozen=True, kw_only=True)
class StackBias:
    """One bias a stack's first block made: its bytes (heads × queries × keys in the activation
    dtype, one for the whole micro-batch: T5 broadcasts it over the batch), the first and last
    blocks given it (the stack's second and last), and whether it needs a gradient (learned: the
    self-attention's relative position bias; not the cross-attention's zeros)."""

    bytes: int
    first_user: int
    last_user: int
    needs_grad: bool

    @property
    def accumulates(self) -> bool:
        """Whether autograd accumulates its gradient across blocks whose figures do not hold it.

        Every block given the bias adds its gradient into one buffer, which lives from the last
        block's backward, where the first gradient arrives, until the first block's, which
        consumes it (T5 ``compute_bias``; the real FSDP2 step holds it, an ``add.Tensor``
        storage, from decoder block 11's backward to block 0's, 24 MiB at t5-base's 1 × 1,024).
        A described model traces one block of each kind and copies its figures: the traced
        stack's second block is also its last, so its figures hold its own gradient only while
        its backward runs, and the stack's first block's figures already hold the accumulated
        one. The blocks in between lack it when the stack has more than two blocks."""
        return self.needs_grad and self.last_user > self.first_user


def stack_biases(cfg: ModelConfig, w: Workload) -> tuple[StackBias, ...]:
    """The biases of a described model's stacks (none for a preset or a decoder-only model): per
    stack and attention call of its blocks (self-attention, then a decoder's cross-attention), from
    the attention calls of the blocks after the stack's first that take a bias
    (``AttentionCall.bias``)."""
    d = cfg.description
    if d is None:
        return ()
    stacks, firsts = d.stacks, d.stack_firsts
    found: dict[tuple[str, int], StackBias] = {}
    calls = [0] * len(d.blocks)  # attention calls met so far in each block
    for op in d.ops:
        a, b = op.attention, op.block
        if a is None or b is None:
            continue
        nth, calls[b] = calls[b], calls[b] + 1
        if not a.bias or b in firsts:
            continue  # no bias, or the stack's first block, which makes it
        # the kind of attention: its place in the block (a T5 decoder block's self-attention, then
        # its cross-attention; the two have the same lengths where the decoder is as long)
        key = (stacks[b], nth)
        nbytes = a.heads * a.seq_len * (a.kv_seq_len or a.seq_len) * w.act_bytes
        seen = found.get(key)
        found[key] = StackBias(
            bytes=nbytes,
            first_user=b if seen is None else min(seen.first_user, b),
            last_user=b if seen is None else max(seen.last_user, b),
            needs_grad=a.bias_grad,
        )
    return tuple(found.values())
