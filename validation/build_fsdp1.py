"""Wrap a model with FSDP1 (``FullyShardedDataParallel``) exactly as a scenario says.

One ``FullyShardedDataParallel`` per wrap unit through ``lambda_auto_wrap_policy`` (the decoder
layers, or every linear and embedding), the root on the whole model; ``ShardingStrategy`` from
``parallel.strategy``, ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` from
``[precision]``, the other arguments from ``[fsdp1]``. HSDP gets an explicit (replicate, shard)
mesh: without one, FSDP1 on a CPU builds a shard group of one rank and never synchronises the
replicas. On a CPU ``device_id`` is ``torch.device("cpu")`` (FSDP1 needs it there).
Activation checkpointing is applied after wrapping, as the FSDP1 recipes do it
(``apply_activation_checkpointing``): each checkpoint region lies inside its unit's hooks.
"""

from functools import partial
from typing import Any

import torch
from torch import nn

from calibrate.sweep import TORCH_DTYPES
from sim.errors import UserError
from sim.scenario.sections import Scenario
from sim.workload.checkpointing import CheckpointPlan
from sim.workload.options import BackwardPrefetch as SimBackwardPrefetch
from sim.workload.options import WrapPolicy
from sim.workload.units import unit_prefixes
from validation.sac_policy import op_sac_context


def check_runs_here(scenario: Scenario) -> None:
    """FSDP1's ``CPUOffload`` pins its host shards (``pin_memory()``), which needs an accelerator:
    refused in one line on a machine without one, before anything runs."""
    if scenario.parallel.fsdp_version == 1 and scenario.fsdp1.cpu_offload and not torch.cuda.is_available():
        raise UserError(
            f"{scenario.source}: fsdp1.cpu_offload = true cannot run on this machine: FSDP1's CPUOffload "
            "pins host memory, which needs a CUDA device; simulate it (fsdpsim run) or validate on a GPU"
        )


def _mixed_precision(scenario: Scenario) -> Any:
    from torch.distributed.fsdp import MixedPrecision

    p = scenario.precision
    if not scenario.fsdp1.mixed_precision:  # the model as stored: llama-recipes' pure_bf16
        return None
    if scenario.param_dtype == "fp32" and scenario.reduce_dtype == "fp32" and p.buffer_dtype is None:
        return None
    return MixedPrecision(
        param_dtype=TORCH_DTYPES[scenario.param_dtype],
        reduce_dtype=TORCH_DTYPES[scenario.reduce_dtype],
        buffer_dtype=TORCH_DTYPES[p.buffer_dtype] if p.buffer_dtype is not None else None,
    )


def _backward_prefetch(value: SimBackwardPrefetch) -> Any:
    from torch.distributed.fsdp import BackwardPrefetch

    return None if value is SimBackwardPrefetch.NONE else BackwardPrefetch[value.value]


def apply_checkpointing_fsdp1(model: nn.Module, plan: CheckpointPlan, blocks: list[nn.Module]) -> None:
    """Non-reentrant checkpointing of the plan's decoder blocks inside their FSDP units; ``blocks``
    are the decoder layers in order, found by the scenario's block paths before wrapping (any
    architecture's class, not only ``LlamaDecoderLayer``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    index = {id(block): i for i, block in enumerate(blocks)}
    kwargs: dict[str, Any] = {"preserve_rng_state": False}
    if plan.selective_op:
        kwargs["context_fn"] = op_sac_context
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, **kwargs),
        check_fn=lambda m: id(m) in index and plan.covers(index[id(m)]),
    )


def wrap_fsdp1(model: nn.Module, scenario: Scenario, mesh: Any, plan: CheckpointPlan) -> nn.Module:
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    modules = dict(model.named_modules())
    blocks = [modules[prefix] for prefix in unit_prefixes(scenario.model, WrapPolicy.BLOCK)]
    targets = {id(modules[prefix]) for prefix in unit_prefixes(scenario.model, scenario.parallel.wrap)}
    f = scenario.fsdp1
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    wrapped = FSDP(
        model,
        auto_wrap_policy=partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in targets),
        sharding_strategy=ShardingStrategy[scenario.parallel.strategy.value],
        mixed_precision=_mixed_precision(scenario),
        backward_prefetch=_backward_prefetch(f.backward_prefetch),
        forward_prefetch=f.forward_prefetch,
        limit_all_gathers=f.limit_all_gathers,
        use_orig_params=f.use_orig_params,
        cpu_offload=CPUOffload(offload_params=True) if f.cpu_offload else None,
        device_id=device,
        device_mesh=mesh if scenario.parallel.strategy.is_hybrid else None,
    )
    if plan.active:
        apply_checkpointing_fsdp1(wrapped, plan, blocks)
    return wrapped
