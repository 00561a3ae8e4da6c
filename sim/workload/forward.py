"""The forward pass of any model as layer ops: the hand-written Llama ops
(``sim.workload.layers``) or a described model's measured ones (``sim.workload.described``)."""

import dataclasses

from sim.dtypes import INDEX_BYTES
from sim.errors import UserError
from sim.workload.described import described_layer_ops
from sim.workload.layer_op import LayerKind, LayerOp
from sim.workload.layers import llama_layer_ops
from sim.workload.model import ModelConfig
from sim.workload.options import LossKernel, NormKernel
from sim.workload.shapes import Workload

# the tensor number of the collator's own input in the embedding's requests (apart from the
# model's storages, the attention kernel's and QLoRA's dequantized weights)
COLLATOR_INPUT_TENSOR = -2000


def layer_ops(cfg: ModelConfig, w: Workload) -> tuple[LayerOp, ...]:
    """Every op of one forward pass in execution order."""
    return _with_collator_input(_with_row_positions(_model_ops(cfg, w), w, cfg.name), w)


def _with_collator_input(ops: tuple[LayerOp, ...], w: Workload) -> tuple[LayerOp, ...]:
    """Padded rows (``Workload.padded``) come with the collator's ``attention_mask``, packed rows
    (``Workload.packed``) with its ``position_ids``: batch × sequence int64 like the token ids,
    which the training loop holds beside them (measured: the real step's 1,024 B at 2 × 64);
    counted with the ids the token embedding keeps, as its first tensor."""
    first = next((i for i, op in enumerate(ops) if op.kind is LayerKind.EMBED), None)
    if not (w.padded or w.packed) or first is None:
        return ops
    op, given = ops[first], w.tokens * INDEX_BYTES
    pieces = (given, *(op.saved_pieces or (op.saved_bytes,)))
    requests = (
        None if op.forward_requests is None else ((COLLATOR_INPUT_TENSOR, -given), *op.forward_requests)
    )
    with_input = dataclasses.replace(
        op, saved_bytes=op.saved_bytes + given, saved_pieces=pieces, forward_requests=requests
    )
    return (*ops[:first], with_input, *ops[first + 1 :])


def _with_row_positions(ops: tuple[LayerOp, ...], w: Workload, model: str) -> tuple[LayerOp, ...]:
    """Packed rows' positions are the collator's, one row per sequence (``Workload.position_rows``),
    where the model's own are one ``arange`` row broadcast over the batch: its rotary tables, each
    of the positions' shape (HF's rotary ``forward``: the positions in fp32, the frequencies
    ``inv_freq`` times them, their ``cat``, ``cos`` and ``sin`` and the cast), are made per row.
    Every figure of a rotary op, measured or hand-written at one row, scales with the rows."""
    rows = w.position_rows
    if rows == 1:
        return ops
    if not any(op.kind is LayerKind.ROTARY for op in ops):
        # a learned position embedding would take the batch's positions too (GPT-2's ``wpe``)
        raise UserError(
            "training.avg_doc_len: packed rows are modelled for models with rotary position "
            f"embeddings (their tables made per row); model {model} has none"
        )
    return tuple(_per_row(op, rows) if op.kind is LayerKind.ROTARY else op for op in ops)


def _per_row(op: LayerOp, rows: int) -> LayerOp:
    def scaled(requests: tuple[tuple[int, int], ...] | None) -> tuple[tuple[int, int], ...] | None:
        return None if requests is None else tuple((t, n * rows) for t, n in requests)

    return dataclasses.replace(
        op,
        memory_bytes=op.memory_bytes * rows,
        saved_bytes=op.saved_bytes * rows,
        forward_transient_bytes=op.forward_transient_bytes * rows,
        backward_transient_bytes=op.backward_transient_bytes * rows,
        saved_pieces=tuple(n * rows for n in op.saved_pieces),
        forward_transient_pieces=tuple(n * rows for n in op.forward_transient_pieces),
        backward_transient_pieces=tuple(n * rows for n in op.backward_transient_pieces),
        forward_requests=scaled(op.forward_requests),
        backward_requests=scaled(op.backward_requests),
        backward_memory_bytes=None if op.backward_memory_bytes is None else op.backward_memory_bytes * rows,
    )


def _model_ops(cfg: ModelConfig, w: Workload) -> tuple[LayerOp, ...]:
    if cfg.description is not None:
        if w.loss is not LossKernel.EAGER:
            raise UserError(
                f"training.loss = {w.loss.value!r} is modelled for the Llama presets only, not for a model from a "
                'config.json yet; use training.loss = "eager"'
            )
        if w.norm is not NormKernel.EAGER:
            raise UserError(
                f"training.norm = {w.norm.value!r} is modelled for the Llama presets only, not for a model from a "
                'config.json (whose norms run as its code runs them); use training.norm = "eager"'
            )
        return described_layer_ops(cfg.description, w)
    return llama_layer_ops(cfg, w)
