"""Which blocks activation checkpointing wraps, and with which policy, as torchtitan applies it
(``torchtitan/models/llama3/infra/parallelize.py`` ``_apply_ac_to_transformer_block``).

- ``full``: every decoder block is a checkpoint region; only its input is kept.
- ``selective`` with ``"op"``: every block is a region under the op-level policy, which keeps the
  outputs of the matmuls but every second one, and of attention (``sim.workload.layers._sac_kept``).
- ``selective`` with N: every N-th block is a full region (torchtitan counts blocks from 1 and
  wraps those whose count is divisible by N); the others keep everything.
"""

from dataclasses import dataclass

from sim.workload.model import ModelConfig
from sim.workload.options import CheckpointMode
from sim.workload.shapes import Workload
from sim.workload.stack_bias import stack_biases


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    blocks: frozenset[int] = frozenset()  # decoder blocks that are checkpoint regions
    selective_op: bool = False  # the op-level policy inside each region

    @property
    def active(self) -> bool:
        return bool(self.blocks)

    def covers(self, block: int | None) -> bool:
        return block is not None and block in self.blocks


def checkpoint_plan(mode: CheckpointMode, selective: str | int, n_layers: int) -> CheckpointPlan:
    if mode is CheckpointMode.NONE:
        return CheckpointPlan()
    every = range(n_layers)
    if mode is CheckpointMode.FULL:
        return CheckpointPlan(blocks=frozenset(every))
    if selective == "op":
        return CheckpointPlan(blocks=frozenset(every), selective_op=True)
    n = int(selective)
    return CheckpointPlan(blocks=frozenset(i for i in every if (i + 1) % n == 0))


def block_input_bytes(cfg: ModelConfig, w: Workload) -> tuple[int, ...]:
    """What each block keeps as a checkpoint region (non-reentrant checkpointing holds the inputs
    its recomputation needs): its hidden states, tokens × hidden, and, of an encoder-decoder's
    blocks after the first of a stack, the attention biases the stack's first block made and
    every later block takes as an input (T5's relative position bias, ``position_bias``, and the
    decoder's zero cross-attention bias; ``sim.workload.stack_bias``), once per stack. A
    decoder's blocks all take the micro-batch's tokens; an encoder-decoder's decoder blocks its
    decoder's."""
    d = cfg.description
    if d is None:
        return (w.tokens * cfg.hidden * w.act_bytes,) * cfg.n_layers
    tokens = [w.tokens] * len(d.blocks)
    for op in d.ops:
        a, b = op.attention, op.block
        if a is not None and b is not None and a.kv_seq_len is None:  # a self-attention: its tokens
            tokens[b] = a.batch * a.seq_len
    out = [t * cfg.hidden * w.act_bytes for t in tokens]
    for bias in stack_biases(cfg, w):
        out[bias.first_user] += bias.bytes
    return tuple(out)


def kv_cache_bytes(cfg: ModelConfig, w: Workload) -> tuple[int, ...]:
    """What HF's KV cache (``model.use_cache``) holds of each block to the forward's end: its
    self-attention's key and value states (after RoPE; a GQA model's kv heads, before
    ``repeat_kv``). A described model's from the attention calls its tracer recorded (their heads
    and head dims), a preset's from its dimensions, 2 × tokens × kv_dim × activation bytes."""
    d = cfg.description
    if d is None:
        return (2 * w.tokens * cfg.kv_dim * w.act_bytes,) * cfg.n_layers
    out = [0] * len(d.blocks)
    for op in d.ops:
        a, b = op.attention, op.block
        if a is None or b is None or a.kv_seq_len is not None:
            continue
        out[b] += a.batch * a.seq_len * a.kv_heads * (a.head_dim + a.v_head_dim) * w.act_bytes
    return tuple(out)
