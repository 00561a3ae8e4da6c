"""The choices a scenario makes about how a model is trained, as enums (values as users spell them).

They live here, below the scenario parser, so that the schedules, the tuner and validation can
name a strategy without importing the TOML loader.
"""

from enum import StrEnum


class Strategy(StrEnum):
    """FSDP's ``ShardingStrategy`` names (FSDP2 expresses them as mesh and ``reshard_after_forward``)."""

    NO_SHARD = "NO_SHARD"  # DDP
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # ZeRO-2
    FULL_SHARD = "FULL_SHARD"  # ZeRO-3
    HYBRID_SHARD = "HYBRID_SHARD"  # ZeRO-3 within a shard group, replicated across groups


class WrapPolicy(StrEnum):
    """Which modules get their own ``fully_shard``: none (the model), each decoder block, each linear."""

    MODEL = "model"
    BLOCK = "block"
    LINEAR = "linear"


class CheckpointMode(StrEnum):
    """Activation checkpointing as torchtitan offers it: none, every block, or selective (an op-level
    policy inside every block, or every N-th block: ``checkpointing.selective``)."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class LossKernel(StrEnum):
    """How the head computes the loss: HF's eager cross-entropy (full logits, their fp32 copy and
    log-softmax), or a fused linear cross-entropy (Liger-Kernel's ``LigerFusedLinearCrossEntropy``:
    logits a chunk at a time, the gradients computed in forward)."""

    EAGER = "eager"
    FUSED = "fused"


class OptimizerName(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"
    NONE = "none"


# Optimizer states per parameter element, each in fp32 (torch.optim defaults: AdamW keeps
# exp_avg and exp_avg_sq, SGD with momentum its momentum buffer).
OPTIMIZER_STATES: dict[OptimizerName, int] = {
    OptimizerName.ADAMW: 2,
    OptimizerName.SGD: 1,
    OptimizerName.NONE: 0,
}
