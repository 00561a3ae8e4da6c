"""The per-step inputs both schedule builders share: units, segments, byte sizes and cost functions."""

from collections.abc import Callable
from dataclasses import dataclass

from sim.compute_model import ComputeCosts
from sim.topology import GroupKind
from sim.units import Segment, WrapUnit

# (collective, nccl-tests size in bytes, group kind, dtype) -> seconds
CollectiveTime = Callable[[str, int, GroupKind, str], float]

# Optimizer states per parameter element, each in fp32 (torch.optim defaults).
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    units: tuple[WrapUnit, ...]  # non-root units in forward order, then the root
    segments: tuple[Segment, ...]
    shard_size: int
    hybrid: bool
    reshard_after_forward: bool
    forward_prefetch: int
    backward_prefetch: int
    checkpointing: bool
    grad_accum: int
    optimizer: str
    master_bytes: int  # sharded master parameters, gradients and optimizer states (fp32)
    param_dtype: str
    param_bytes: int
    reduce_dtype: str
    reduce_bytes: int
    block_input_bytes: int  # what a checkpointed block keeps: its input activations
    buffer_bytes: int  # unsharded module buffers (RoPE inverse frequencies)
    collective_temp_buffers: bool
    ddp_bucket_bytes: int
    costs: ComputeCosts
    collective_s: CollectiveTime
