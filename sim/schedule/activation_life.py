"""Where a step's long-lived activations begin and end, as pure functions of the step: the output
a kept-outputs loop holds from the previous micro-batch, a KV cache's appends under checkpointing
and the checkpoint region that holds it, the segment that runs a block's attention, the eager
attention masks' first and last segment, a stack bias's accumulated gradient.
``sim.schedule.base.ScheduleBuilder`` allocates and frees at the points these name.
"""

from sim.core.events import MemoryCategory
from sim.core.program import Alloc
from sim.schedule.step import StepConfig
from sim.workload.layer_op import LayerKind


def cache_appends(cfg: StepConfig) -> bool:
    """Whether each recompute appends its block's K/V to the cache again: a ``DynamicCache``
    (every block is given it) under checkpointing."""
    return bool(cfg.kv_cache_bytes and cfg.checkpoint.blocks and cfg.kv_cache_in_block_inputs)


def previous_output(cfg: StepConfig) -> list[Alloc]:
    """training.keep_outputs: the output the previous micro-batch left the loop holding, as
    this one will leave it (steady state): its logits, and a KV cache's every block's K/V
    (twice a checkpointed block's where a ``DynamicCache`` took each recompute's again)."""
    if not cfg.kept_output_bytes:
        return []
    cache = sum(cfg.kv_cache_bytes)
    if cache_appends(cfg):
        cache += sum(b for block, b in enumerate(cfg.kv_cache_bytes) if cfg.checkpoint.covers(block))
    nbytes = cfg.kept_output_bytes + cache
    return [Alloc(label="previous_output", category=MemoryCategory.ACTIVATIONS, bytes=nbytes, carried=True)]


def attention_segment(cfg: StepConfig, block: int | None) -> int | None:
    """The segment of ``block`` that runs its (first) attention op, else its last segment."""
    if block is None:
        return None
    mine = [i for i, s in enumerate(cfg.segments) if s.block == block]
    runs = (i for i in mine if any(op.kind is LayerKind.ATTENTION for op in cfg.segments[i].ops))
    return next(runs, mine[-1])


def cache_holder(cfg: StepConfig) -> int | None:
    """model.use_cache with checkpointing: the block whose checkpoint region holds the
    ``DynamicCache`` longest. Non-reentrant checkpointing keeps each region's inputs, the
    cache object among its keyword arguments, until the region's backward: the cache (every
    block's K/V) lives to the end of the first checkpointed block's backward (transformers
    5.24, measured in fake mode). None: no cache or no checkpointed block; a legacy cache
    (transformers < 4.36: each block returns its (k, v), which no block is given again; it
    dies with the model's output at the forward's end, after the loss, measured on 4.31); or
    a kept output, which holds the cache longer (``training.keep_outputs``)."""
    if not cache_appends(cfg) or cfg.kept_output_bytes:
        return None
    return min(cfg.checkpoint.blocks)


def next_region_checkpointed(cfg: StepConfig, i: int) -> bool:
    """Whether the ops right after segment ``i``'s block are a checkpoint region too (the
    next block checkpointed): then they keep nothing of the block, only their own input."""
    segs = cfg.segments
    block = segs[i].block
    after = next((s for s in segs[i + 1 :] if s.block != block), None)
    return after is not None and cfg.checkpoint.covers(after.block)


def held_block_input_bytes(cfg: StepConfig, block: int) -> int:
    """What the regions right before checkpointed ``block`` keep of its input among their own
    saves (``SegmentFigures.next_block_input_bytes``: a described model's embedding output, or an
    unchecked block's output, that the block's first op saves as it is): the checkpoint holds
    that tensor already, not a second copy of it."""
    segs = cfg.segments
    first = next(j for j, s in enumerate(segs) if s.block == block)
    region = segs[first - 1].block if first else None
    if not first or (region is not None and cfg.checkpoint.covers(region)):
        return 0  # nothing before it, or a checkpointed region, which keeps none of its saves
    held, j = 0, first - 1
    while j >= 0 and segs[j].block == region:
        held += cfg.figures[j].next_block_input_bytes
        j -= 1
    return held


def first_of_block(cfg: StepConfig, i: int) -> bool:
    """Whether segment ``i`` is its block's first (or the step's first segment)."""
    segs = cfg.segments
    return i == 0 or segs[i - 1].block != segs[i].block


def last_of_block(cfg: StepConfig, i: int) -> bool:
    """Whether segment ``i`` is its block's last (the first of it backward runs)."""
    segs = cfg.segments
    return i == len(segs) - 1 or segs[i + 1].block != segs[i].block


def bias_grads_begun(cfg: StepConfig, i: int) -> list[int]:
    """The stack biases (by their place in ``StepConfig.stack_biases``) whose accumulated
    gradient begins as segment ``i``'s backward ends: the last block given the bias, at the end of
    its backward (its first segment's), where the block's own gradient becomes the buffer the
    others add into (``StackBias.accumulates``)."""
    segs = cfg.segments
    return [
        k
        for k, bias in enumerate(cfg.stack_biases)
        if bias.accumulates and segs[i].block == bias.last_user and first_of_block(cfg, i)
    ]


def bias_grads_ended(cfg: StepConfig, i: int) -> list[int]:
    """The stack biases whose accumulated gradient goes as segment ``i``'s backward starts: the
    backward of the block that made the bias (the stack's first, right before the first user),
    whose own figures hold that gradient until its attention consumes it (after its recompute,
    through which the real step holds it too)."""
    segs = cfg.segments
    return [
        k
        for k, bias in enumerate(cfg.stack_biases)
        if bias.accumulates and segs[i].block == bias.first_user - 1 and last_of_block(cfg, i)
    ]


def stack_mask_made(cfg: StepConfig, mask: int, i: int) -> bool:
    """Whether HF's attention mask ``mask`` (of ``StepConfig.stack_masks``) is built as segment
    ``i``'s forward starts: its stack's first segment inside a block (a stack builds its masks
    before its first block; an encoder-decoder's decoder its own as its stack starts)."""
    first = cfg.stack_masks[mask].stack_first
    return next((j for j, s in enumerate(cfg.segments) if s.block == first), None) == i


def stack_mask_end(cfg: StepConfig, mask: int, i: int, *, backward: bool) -> bool:
    """Whether HF's attention mask ``mask`` (of ``StepConfig.stack_masks``) goes at the end
    of segment ``i``'s forward (or, with ``backward``, its backward). Where no block given it
    keeps it, it goes when its stack returns (after its stack's last block's forward); else each
    checkpoint region keeps the mask its blocks are given among the inputs its recomputation is
    called with, so it goes with the first such region, whose backward ends last (measured with a
    weak reference on transformers 5.24's Llama, full and every-2nd-block checkpointing; Gemma 2
    gives each layer its own type's mask), and a mask the blocks' own ops keep for backward
    (``StackMask.kept_for_backward``) goes with its first block's backward, checkpointed or
    not."""
    segs, m = cfg.segments, cfg.stack_masks[mask]
    holder = min((b for b in m.blocks if m.kept_for_backward or cfg.checkpoint.covers(b)), default=None)
    if backward:
        return holder is not None and segs[i].block == holder and first_of_block(cfg, i)
    return holder is None and i == max(j for j, s in enumerate(segs) if s.block == m.stack_last)
