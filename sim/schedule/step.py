"""The per-step inputs every schedule builder shares: units, segments with their figures, byte
sizes and the cost functions, resolved once from a scenario and a profile (``sim.simulate``)."""

from collections.abc import Callable
from dataclasses import dataclass

from sim.core.topology import GroupKind
from sim.costs.collectives import CollectiveCost
from sim.costs.compute import ComputeCosts, SegmentFigures
from sim.workload.checkpointing import CheckpointPlan
from sim.workload.options import OptimizerName, Strategy
from sim.workload.units import Segment, WrapUnit

# (collective, nccl-tests size in bytes, group kind, dtype) -> its cost
CollectiveCostFn = Callable[[str, int, GroupKind, str], CollectiveCost]


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    strategy: Strategy
    units: tuple[WrapUnit, ...]  # non-root units in forward order, then the root
    segments: tuple[Segment, ...]
    figures: tuple[SegmentFigures, ...]  # one per segment, computed once
    shard_size: int
    reshard_after_forward: bool
    forward_prefetch: int
    backward_prefetch: int
    checkpoint: CheckpointPlan
    grad_accum: int
    optimizer: OptimizerName
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
    collective: CollectiveCostFn

    @property
    def sharded(self) -> bool:
        """FSDP (any sharding strategy) rather than DDP."""
        return self.strategy is not Strategy.NO_SHARD

    @property
    def hybrid(self) -> bool:
        return self.strategy is Strategy.HYBRID_SHARD
