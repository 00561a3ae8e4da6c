"""The forward pass of any model as layer ops: the hand-written Llama ops
(``sim.workload.layers``) or a described model's measured ones (``sim.workload.described``)."""

from sim.errors import UserError
from sim.workload.described import described_layer_ops
from sim.workload.layer_op import LayerOp
from sim.workload.layers import llama_layer_ops
from sim.workload.model import ModelConfig
from sim.workload.options import LossKernel, NormKernel
from sim.workload.shapes import Workload


def layer_ops(cfg: ModelConfig, w: Workload) -> tuple[LayerOp, ...]:
    """Every op of one forward pass in execution order."""
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
