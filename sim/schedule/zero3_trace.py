"""The order in which DeepSpeed ZeRO-3's hooks see a Llama's modules: the coordinator's trace.

DeepSpeed registers a pre-forward and a pre-backward hook on every module
(``parameter_offload.py``), and each one calls ``fetch_sub_module``, which fetches the module's own
parameters and, from the trace, prefetches: containers (the model, each decoder layer, its
attention and MLP) and parameter-free leaves (the rotary embedding, the activation) are calls
too, with nothing of their own to fetch. The order was read from a real DeepSpeed 0.19.8 run of
``LlamaForCausalLM`` (``PartitionedParameterCoordinator.fetch_sub_module`` recorded on 2 ranks):

- forward: ``""`` (the CausalLM), ``model``, ``model.embed_tokens``, ``model.rotary_emb``, then per
  layer the layer, ``input_layernorm``, ``self_attn``, ``q/k/v/o_proj``, ``post_attention_layernorm``,
  ``mlp``, ``gate_proj``, ``act_fn``, ``up_proj``, ``down_proj``; then ``model.norm``, ``lm_head``;
- backward: ``""``, ``lm_head``, ``model``, ``model.norm``, then per layer from the last the layer,
  ``mlp``, ``down/up_proj``, ``act_fn``, ``gate_proj``, ``post_attention_layernorm``,
  ``self_attn``, ``o/v/k/q_proj``, ``input_layernorm``; last ``model.embed_tokens`` (the rotary
  embedding has no backward).

Here the forward order comes from the layer ops (a container is called when the first op inside
it runs), the backward order from the same rule on the reversed ops (a container is called when
the last op inside it is reached), with DeepSpeed's one exception: the activation runs right
after ``gate_proj`` in forward. A checkpointed layer is called twice going in (its
``CheckpointWrapper``, then the layer), and its recomputation calls the layer's forward hooks
again in the middle of its backward (after ``down_proj``'s pre-backward, as measured).
"""

from dataclasses import dataclass

from sim.core.events import OpKind
from sim.schedule.step import StepConfig
from sim.workload.layer_op import LayerKind, LayerOp
from sim.workload.model import ParamSpec


@dataclass(frozen=True, kw_only=True)
class ModuleCall:
    """One ``fetch_sub_module``: a module and its own parameters (none for a container or a
    parameter-free leaf)."""

    module: str
    params: tuple[ParamSpec, ...] = ()


@dataclass(frozen=True, kw_only=True)
class SegmentUse:
    """One segment's forward, recomputation or backward, and the module calls just before it."""

    segment: int
    phase: OpKind  # FORWARD, RECOMPUTE or BACKWARD
    calls: tuple[ModuleCall, ...]
    compute: bool = True  # False: the calls only (the segment's compute comes in a later use)


def _containers(module: str) -> list[str]:
    """The module's parents, outermost first: "" (the CausalLM), "model", a layer, its attention or MLP."""
    parts = module.split(".")
    chain = [""]
    if parts[0] == "model":
        chain.append("model")
        if len(parts) > 2 and parts[1] == "layers":
            chain.append(".".join(parts[:3]))
            if len(parts) > 4 and parts[3] in ("self_attn", "mlp"):
                chain.append(".".join(parts[:4]))
    return chain


def _leaf(op: LayerOp) -> str | None:
    """The leaf module an op runs in (the activation is ``mlp.act_fn``; attention and the loss are
    functional code inside their container)."""
    if op.kind is LayerKind.MLP_ACT:
        return f"{op.module}.act_fn"
    if op.kind in (LayerKind.ATTENTION, LayerKind.LOSS):
        return None
    return op.module


def _op_calls(op: LayerOp, phase: OpKind, entered: set[str], wrapped: set[int]) -> list[ModuleCall]:
    """The calls an op brings: containers entered for the first time (a checkpointed layer twice:
    its ``CheckpointWrapper`` and the layer inside), then its own leaf module."""
    leaf = _leaf(op)
    calls = []
    for container in _containers(leaf if leaf is not None else f"{op.module}.fn"):
        if container not in entered:
            entered.add(container)
            if container == f"model.layers.{op.block}" and op.block in wrapped:
                calls.append(ModuleCall(module=container))
            calls.append(ModuleCall(module=container))
    if leaf is not None and not (phase is OpKind.BACKWARD and op.kind is LayerKind.ROTARY):
        calls.append(ModuleCall(module=leaf, params=op.params))
    return calls


def _forward_order(cfg: StepConfig, segments: list[int]) -> list[int]:
    """Segments in forward order, the activation moved right after ``gate_proj`` (DeepSpeed sees
    ``act_fn(gate_proj(x)) * up_proj(x)``)."""
    out: list[int] = []
    for i in segments:
        op = cfg.segments[i].ops[0]
        if op.kind is LayerKind.MLP_ACT and out and cfg.segments[out[-1]].name.endswith("up_proj"):
            out.insert(len(out) - 1, i)
        else:
            out.append(i)
    return out


def _uses(
    cfg: StepConfig, order: list[int], phase: OpKind, entered: set[str], wrapped: set[int]
) -> list[SegmentUse]:
    uses = []
    for i in order:
        ops = cfg.segments[i].ops if phase is not OpKind.BACKWARD else cfg.segments[i].ops[::-1]
        calls = [c for op in ops for c in _op_calls(op, phase, entered, wrapped)]
        uses.append(SegmentUse(segment=i, phase=phase, calls=tuple(calls)))
    return uses


def segment_uses(cfg: StepConfig) -> list[SegmentUse]:
    """Every segment use of one micro-batch, in order, with the module calls before each: forward,
    then backward. A checkpointed block is recomputed when its backward first needs a saved
    tensor: after the backward calls of its containers and its last module (measured order), so
    that module's backward compute follows the recomputation."""
    forward = _forward_order(cfg, list(range(len(cfg.segments))))
    wrapped = {b for b in range(len(cfg.segments) + 1) if cfg.checkpoint.covers(b)}
    uses = _uses(cfg, forward, OpKind.FORWARD, set(), wrapped)
    entered: set[str] = set()
    recomputed: set[int] = set()
    for i in forward[::-1]:
        block = cfg.segments[i].block
        if block in wrapped and block not in recomputed:  # its last segment, parameters or none
            recomputed.add(block)
            first = _uses(cfg, [i], OpKind.BACKWARD, entered, wrapped)[0]
            uses.append(SegmentUse(segment=i, phase=OpKind.BACKWARD, calls=first.calls, compute=False))
            inside = [j for j in forward if cfg.segments[j].block == block]
            uses += _uses(cfg, inside, OpKind.RECOMPUTE, {"", "model"}, set())
            uses.append(SegmentUse(segment=i, phase=OpKind.BACKWARD, calls=()))
            continue
        uses += _uses(cfg, [i], OpKind.BACKWARD, entered, wrapped)
    return uses
