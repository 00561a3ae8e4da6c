"""torchtitan's op-level selective activation checkpointing policy, for the real runs."""

from typing import Any

import torch


def sac_save_list() -> set[Any]:
    """torchtitan's op-level SAC save list (``_save_list``, llama3 ``parallelize.py``), with the CPU
    flash-attention op beside the CUDA ones so the same policy runs here."""
    ops = torch.ops.aten
    return {
        ops.mm.default,
        ops._scaled_dot_product_efficient_attention.default,
        ops._scaled_dot_product_flash_attention.default,
        ops._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        ops.max.default,
    }


def op_sac_context() -> Any:
    """A fresh selective-checkpoint context per region: save every listed op's output but every
    second mm's (counted separately in forward and recompute), recompute the rest."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = sac_save_list()
    meta: defaultdict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
