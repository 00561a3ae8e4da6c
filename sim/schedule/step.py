"""The per-step inputs every schedule builder shares: units, segments with their figures, byte
sizes and the cost functions, resolved once from a scenario and a profile (``sim.simulate``)."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from sim.core.topology import GroupKind
from sim.costs.collectives import CollectiveCost
from sim.costs.compute import ComputeCosts, SegmentFigures
from sim.costs.offload import HostCosts
from sim.dtypes import dtype_bytes
from sim.workload.checkpointing import CheckpointPlan
from sim.workload.expert_parallel import expert_padded_numel
from sim.workload.layers import StackMask
from sim.workload.options import (
    Fsdp1Options,
    Fsdp2Offload,
    OptimizerImplementation,
    OptimizerName,
    Strategy,
    ZeroOptions,
)
from sim.workload.params import ParamSpec
from sim.workload.stack_bias import StackBias
from sim.workload.units import (
    Segment,
    WrapUnit,
    flat_param_numel,
    flat_param_padded_numel,
    gradient_params,
    padded_numel,
)

FLAT_PARAM_ALIGNMENT_BYTES = 16  # FSDP1 ``_get_aligned_numel``: TorchInductor's alignment

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
    optimizer_implementation: OptimizerImplementation = OptimizerImplementation.FOREACH
    # the trained parameters' shards, their gradients and optimizer states: fp32, or the
    # parameter dtype where nothing upcasts them (``Scenario.master_dtype``)
    master_dtype: str
    param_dtype: str
    param_bytes: int
    reduce_dtype: str
    reduce_bytes: int
    # what each checkpointed block keeps, by block: its input activations
    # (``sim.workload.checkpointing.block_input_bytes``)
    block_input_bytes: tuple[int, ...]
    # model.use_cache: what HF's KV cache holds of each block from its forward to the forward's
    # end (``sim.workload.checkpointing.kv_cache_bytes``); empty: no cache
    kv_cache_bytes: tuple[int, ...] = ()
    # the cache is one object passed into every block (transformers >= 4.36's DynamicCache): each
    # checkpoint region holds it into backward and each recompute appends to it; false: each block
    # returns its (k, v) (transformers < 4.36), held by nothing but the model's output
    kv_cache_in_block_inputs: bool = True
    # training.keep_outputs: the model's output a micro-batch leaves the loop holding (its logits,
    # ``sim.workload.loss.output_logits_bytes``) until the next forward returns; 0: dropped
    # with ``.loss`` at the forward's end. A KV cache is then the output's, freed with it.
    kept_output_bytes: int = 0
    # the attention masks the model's decoder stack builds once per micro-batch before its first
    # block (eager: float; SDPA given a window: boolean), each with the blocks given it
    # (``sim.workload.layers.stack_masks``); (): none
    stack_masks: tuple[StackMask, ...] = ()
    # the attention biases an encoder-decoder's stacks make in their first block and give every
    # later one (``sim.workload.stack_bias.stack_biases``); (): none
    stack_biases: tuple[StackBias, ...] = ()
    buffer_bytes: int  # unsharded module buffers (RoPE inverse frequencies)
    collective_temp_buffers: bool
    ddp_bucket_bytes: int
    costs: ComputeCosts
    collective: CollectiveCostFn
    world_size: int = 1
    fsdp1: Fsdp1Options | None = None  # set: FSDP1 (FullyShardedDataParallel) instead of FSDP2/DDP
    zero: ZeroOptions | None = None  # set: DeepSpeed ZeRO (its units are every module with parameters)
    host: HostCosts | None = None  # offload's transfers and the optimizer on the host
    grad_scaler: bool = False  # ShardedGradScaler (GradScaler under DDP) around the step
    clip_grad_norm: bool = False  # clip_grad_norm_ before the step (training.max_grad_norm > 0)
    fsdp2_offload: Fsdp2Offload | None = None  # FSDP2's CPUOffloadPolicy

    quant_state_bytes: int = 0  # QLoRA's quantization state, whole on every rank
    # False: gradient accumulation without synchronisation (FSDP2 set_requires_gradient_sync(False),
    # DDP no_sync) on every micro-batch but the last
    sync_every_microbatch: bool = True
    # FSDP2's integer reshard_after_forward k (1 < k < shard_size): after forward each non-root unit
    # keeps a 1/k slice of its unsharded parameters; backward all-gathers within groups of k ranks
    post_forward_size: int | None = None
    # expert parallelism (``sim.workload.expert_parallel``): E ranks per group, the names of the
    # stacked expert weights (held as this rank's 1/E), the experts per layer, the modules that
    # run them, and one token all-to-all's nccl-tests size (tokens · top_k · hidden · act bytes)
    expert_parallel: int = 1
    expert_params: frozenset[str] = frozenset()
    experts_per_layer: int = 0
    expert_modules: frozenset[str] = frozenset()
    dispatch_bytes: int = 0

    @property
    def master_bytes(self) -> int:
        return dtype_bytes(self.master_dtype)

    @property
    def stack_mask_bytes(self) -> int:
        """All of the stack's masks' bytes."""
        return sum(m.bytes for m in self.stack_masks)

    @property
    def host_costs(self) -> HostCosts:
        assert self.host is not None, "build_step sets the host costs"
        return self.host

    @property
    def fsdp2_host_state(self) -> bool:
        """FSDP2's CPUOffloadPolicy keeps the shards, gradients and optimizer states in host memory
        apart from the device's (not where the device is the host: there nothing moves)."""
        return self.fsdp2_offload is not None and not self.host_costs.host_is_device

    @property
    def sharded(self) -> bool:
        """A sharding strategy (parameters split over the shard group) rather than NO_SHARD."""
        return self.strategy is not Strategy.NO_SHARD

    @property
    def ddp(self) -> bool:
        """DistributedDataParallel: FSDP2's NO_SHARD (FSDP1's NO_SHARD keeps its flat parameters)."""
        return not self.sharded and self.fsdp1 is None and self.zero is None

    @property
    def system(self) -> str:
        """Which system the step is: ``FSDP2``, ``FSDP1``, ``DDP`` or ``DeepSpeed ZeRO-<stage>``."""
        if self.zero is not None:
            return f"DeepSpeed ZeRO-{self.zero.stage}"
        if self.fsdp1 is not None:
            return "FSDP1"
        if self.expert_parallel > 1:
            return f"FSDP2 + expert parallel {self.expert_parallel}"
        return "DDP" if self.ddp else "FSDP2"

    @cached_property
    def gradient_params(self) -> tuple[tuple[ParamSpec, ...], ...]:
        """Per segment, the parameters whose gradient its backward produces first (a tied one at
        its last user: ``sim.workload.units.gradient_params``)."""
        return tuple(gradient_params(self.segments))

    @property
    def finetuned(self) -> bool:
        """Some parameters are frozen (LoRA, QLoRA)."""
        return any(not p.trainable for u in self.units for p in u.params)

    @property
    def hybrid(self) -> bool:
        return self.strategy.is_hybrid

    def param_sharding(self, p: ParamSpec) -> tuple[int, int]:
        """(padded unsharded elements, shard group size) of ``p`` under FSDP2: dim 0 padded to the
        shard group, a local expert weight under EP to its ``world / E`` ranks
        (``expert_padded_numel``); NO_SHARD keeps it whole on one rank's group of one."""
        if not self.sharded:
            return p.numel, 1
        if p.name in self.expert_params:
            w = self.shard_size // self.expert_parallel
            return expert_padded_numel(p, w, self.shard_size, self.experts_per_layer), w
        return padded_numel(p, self.shard_size), self.shard_size

    def flat_numel(self, unit: WrapUnit) -> int:
        """FSDP1: the unit's ``FlatParameter`` before world-size padding (its unpadded unsharded size)."""
        assert self.fsdp1 is not None
        pad_to = self.shard_size if self.sharded else self.world_size
        aligned = FLAT_PARAM_ALIGNMENT_BYTES // self.param_bytes if self.fsdp1.use_orig_params else 0
        return flat_param_numel(unit.params, aligned_numel=aligned, pad_to=pad_to)

    def padded_numel(self, unit: WrapUnit) -> int:
        """The unit's unsharded parameter elements as the system pads them: FSDP2 pads each
        parameter's dim 0 to the shard group, FSDP1 its flat parameter; DDP does not pad."""
        if self.fsdp1 is not None:
            flat = self.flat_numel(unit)
            return flat_param_padded_numel(flat, self.shard_size) if self.sharded else flat
        if self.expert_params:
            return sum(self.param_sharding(p)[0] for p in unit.params)
        return unit.padded_numel(self.shard_size) if self.sharded else unit.numel
