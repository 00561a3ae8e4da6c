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

# the tensor number of the collator's attention mask in the embedding's requests (apart from the
# model's storages, the attention kernel's and QLoRA's dequantized weights)
COLLATOR_MASK_TENSOR = -2000


def layer_ops(cfg: ModelConfig, w: Workload) -> tuple[LayerOp, ...]:
    """Every op of one forward pass in execution order."""
    return _with_collator_mask(_model_ops(cfg, w), w)


def _with_collator_mask(ops: tuple[LayerOp, ...], w: Workload) -> tuple[LayerOp, ...]:
    """Padded rows (``Workload.padded``) come with the collator's ``attention_mask``, batch ×
    sequence int64 like the token ids, which the training loop holds beside them (measured: the
    real step's 1,024 B at 2 × 64); counted with the ids the token embedding keeps, as its first
    tensor."""
    first = next((i for i, op in enumerate(ops) if op.kind is LayerKind.EMBED), None)
    if not w.padded or first is None:
        return ops
    op, mask = ops[first], w.tokens * INDEX_BYTES
    pieces = (mask, *(op.saved_pieces or (op.saved_bytes,)))
    requests = None if op.forward_requests is None else ((COLLATOR_MASK_TENSOR, -mask), *op.forward_requests)
    masked = dataclasses.replace(
        op, saved_bytes=op.saved_bytes + mask, saved_pieces=pieces, forward_requests=requests
    )
    return (*ops[:first], masked, *ops[first + 1 :])


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
