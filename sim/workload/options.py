"""The choices a scenario makes about how a model is trained, as enums (values as users spell them).

They live here, below the scenario parser, so that the schedules, the tuner and validation can
name a strategy without importing the TOML loader.
"""

from dataclasses import dataclass
from enum import StrEnum


class Strategy(StrEnum):
    """FSDP's ``ShardingStrategy`` names (FSDP2 expresses them as mesh and ``reshard_after_forward``)."""

    NO_SHARD = "NO_SHARD"  # DDP
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # ZeRO-2
    FULL_SHARD = "FULL_SHARD"  # ZeRO-3
    HYBRID_SHARD = "HYBRID_SHARD"  # ZeRO-3 within a shard group, replicated across groups
    # FSDP1's ``ShardingStrategy._HYBRID_SHARD_ZERO2``: ZeRO-2 within a shard group, replicated across
    # groups (FSDP2: the HSDP mesh with ``reshard_after_forward=False``)
    HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"

    @property
    def is_hybrid(self) -> bool:
        """Sharded within a group and replicated across groups (an all-reduce after the reduce-scatter)."""
        return self in (Strategy.HYBRID_SHARD, Strategy.HYBRID_SHARD_ZERO2)

    @property
    def reshards_after_forward(self) -> bool:
        """FSDP1's ``RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES``: FULL_SHARD and HYBRID_SHARD."""
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)


class WrapPolicy(StrEnum):
    """Which modules get their own ``fully_shard``: none (the model), each decoder block, each linear;
    or, for FSDP1 with LoRA, PEFT's ``fsdp_auto_wrap_policy`` (each decoder block and each leaf
    module whose weight trains, i.e. every adapter: FSDP1 without ``use_orig_params`` flattens only
    parameters of one ``requires_grad`` into a ``FlatParameter``)."""

    MODEL = "model"
    BLOCK = "block"
    LINEAR = "linear"
    PEFT = "peft"


class CheckpointMode(StrEnum):
    """Activation checkpointing as torchtitan offers it: none, every block, or selective (an op-level
    policy inside every block, or every N-th block: ``checkpointing.selective``)."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class AttentionImpl(StrEnum):
    """transformers' ``attn_implementation``: "sdpa" (``scaled_dot_product_attention``, the kernel
    the hardware profile runs: flash on a GPU) or "eager" (HF's own attention, op by op: q @ kᵀ,
    the float causal mask added, an fp32 softmax cast back, @ v, its s² tensors kept for
    backward; as transformers before SDPA ran Llama, and as Gemma 2 runs)."""

    SDPA = "sdpa"
    EAGER = "eager"


class OutputFormat(StrEnum):
    """What a transformers causal LM hands back and keeps, by version: "current" (transformers
    >= 4.36: one ``DynamicCache`` object passed into every decoder layer, which appends its K/V;
    logits in the activation dtype) or "legacy" (transformers < 4.36, as llama-cookbook's 2023
    recipes ran 4.31: each layer returns its ``(k, v)`` tuple, collected into the output; the
    logits upcast to fp32 in the output, ``logits = logits.float()``)."""

    CURRENT = "current"
    LEGACY = "legacy"


class LossKernel(StrEnum):
    """How the head computes the loss: HF's eager cross-entropy (full logits, their fp32 copy and
    log-softmax), or a fused linear cross-entropy (Liger-Kernel's ``LigerFusedLinearCrossEntropy``:
    logits a chunk at a time, the gradients computed in forward)."""

    EAGER = "eager"
    FUSED = "fused"


class NormKernel(StrEnum):
    """How an RMSNorm runs: HF's eager ops (an fp32 copy, pow, mean, rsqrt, two multiplies, casts),
    or one fused kernel (torchtitan's ``fused_rmsnorm``, ``TritonFusedRMSNorm``, which its Llama 2
    13B and Llama 3 8B configs of 2024 used): it keeps the input and the per-row fp32 ``rstd``."""

    EAGER = "eager"
    FUSED = "fused"


class OptimizerName(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"
    NONE = "none"


class OptimizerImplementation(StrEnum):
    """Which of ``torch.optim``'s three implementations steps the parameters (``foreach=True``,
    the default on CUDA; ``foreach=False``; ``fused=True``): they differ in the temporaries AdamW
    holds, ``sim.schedule.optimizer.optimizer_temp_pieces``."""

    FOREACH = "foreach"
    FOR_LOOP = "for-loop"
    FUSED = "fused"


# Optimizer states per parameter element, each in fp32 (torch.optim defaults: AdamW keeps
# exp_avg and exp_avg_sq, SGD with momentum its momentum buffer).
OPTIMIZER_STATES: dict[OptimizerName, int] = {
    OptimizerName.ADAMW: 2,
    OptimizerName.SGD: 1,
    OptimizerName.NONE: 0,
}


class BackwardPrefetch(StrEnum):
    """FSDP1's ``BackwardPrefetch`` (``torch.distributed.fsdp.BackwardPrefetch``), and ``NONE`` for
    ``backward_prefetch=None``: when the next unit's all-gather is issued in backward."""

    BACKWARD_PRE = "BACKWARD_PRE"  # in the current unit's pre-backward hook, before its gradient compute
    BACKWARD_POST = "BACKWARD_POST"  # in its post-backward hook, after its gradient compute
    NONE = "NONE"  # in the next unit's own pre-backward hook


@dataclass(frozen=True, kw_only=True)
class Fsdp1Options:
    """The ``FullyShardedDataParallel`` arguments a schedule needs beyond the sharding strategy and
    the mixed-precision dtypes (defaults as torch 2.13 sets them)."""

    backward_prefetch: BackwardPrefetch = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = False
    offload_params: bool = False  # CPUOffload(offload_params=True)
    # False: no MixedPrecision; each FlatParameter gathers, computes and reduces in its own dtype
    mixed_precision: bool = True


@dataclass(frozen=True, kw_only=True)
class Fsdp2Offload:
    """FSDP2's ``offload_policy=CPUOffloadPolicy(pin_memory=...)``: sharded parameters, gradients and
    optimizer states on the host, the optimizer step on the CPU."""

    pin_memory: bool = True


class OffloadDevice(StrEnum):
    """DeepSpeed's ``offload_optimizer.device`` / ``offload_param.device``."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """DeepSpeed ZeRO's ``zero_optimization`` fields a schedule needs, as DeepSpeed 0.19.8 names
    and defaults them (``deepspeed/runtime/zero/config.py``); sizes are elements."""

    stage: int
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    loss_scaling: bool = False  # fp16: dynamic loss scaling (overflow check, unscale)
    offload_optimizer: OffloadDevice = OffloadDevice.NONE
    offload_param: OffloadDevice = OffloadDevice.NONE


class FinetuneMethod(StrEnum):
    """What a step trains: every parameter, or LoRA adapters over a frozen base (bf16, or 4-bit
    NF4 for QLoRA)."""

    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"
