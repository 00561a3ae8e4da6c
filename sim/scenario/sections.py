"""The scenario's sections and the ``Scenario`` that composes them: small, frozen, keyword-only.

Each field's type annotation is its validation rule (``sim.scenario.loader`` reads the hints);
derived settings (the reduce dtype, the shard group, reshard-after-forward) are pure properties.
Everything that depends on hardware (``gpus_per_node``) is resolved when the file is loaded, so
a ``Scenario`` never reads a file.
"""

from dataclasses import dataclass

from sim.hardware.cluster_spec import ClusterSpec
from sim.workload.model import ModelConfig
from sim.workload.options import (
    AttentionImpl,
    BackwardPrefetch,
    CheckpointMode,
    FinetuneMethod,
    Fsdp1Options,
    Fsdp2Offload,
    LossKernel,
    NormKernel,
    OffloadDevice,
    OptimizerImplementation,
    OptimizerName,
    OutputFormat,
    Strategy,
    WrapPolicy,
    ZeroOptions,
)


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    preset: str | None = None  # a Llama preset, or a name / hub id of the bundled config library
    config: str | None = None  # a Hugging Face config.json (path relative to the scenario file)
    n_layers: int | None = None
    hidden: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    tie_embeddings: bool | None = None
    # true: HF's KV cache on in the training forward (llama-recipes 2023: config's use_cache with
    # apply_activation_checkpointing); every block's K/V lives to the forward's end
    use_cache: bool = False
    # what the model returns and keeps, by transformers version (OutputFormat): "current" (>= 4.36,
    # a DynamicCache, logits in the activation dtype) or "legacy" (< 4.36: (k, v) tuples, fp32 logits)
    output_format: OutputFormat = OutputFormat.CURRENT


@dataclass(frozen=True, kw_only=True)
class TrainingSection:
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    avg_seq_len: int | None = None  # mean real tokens per sequence padded to seq_len; None: no padding
    # mean tokens per document of rows packed from several, their positions restarting at each
    # document (the ``position_ids`` transformers' DataCollatorWithFlattening and TRL's padding-free
    # packing pass); None: one sequence per row, or documents concatenated without positions
    avg_doc_len: int | None = None
    loss: LossKernel = LossKernel.EAGER  # eager (HF's cross-entropy) or fused (Liger's fused linear CE)
    norm: NormKernel = NormKernel.EAGER  # eager (HF's RMSNorm) or fused (torchtitan's Triton RMSNorm)
    # false: accumulate gradients without synchronising (FSDP2 set_requires_gradient_sync(False),
    # DDP no_sync) on every micro-batch but the last: one reduction per optimizer step
    sync_every_microbatch: bool = True
    # an encoder-decoder's (T5's) decoder length, the labels' tokens; None: seq_len
    decoder_seq_len: int | None = None
    # transformers' attn_implementation: "sdpa" (the profile's kernel) or "eager" (HF's own, op by op)
    attention: AttentionImpl = AttentionImpl.SDPA
    # true: the loop keeps the model's output (`outputs = model(**batch)`, as HF's no_trainer
    # examples and llama-recipes' 2023 loop do): its logits (and a KV cache) live until the next
    # forward returns, through backward and the optimizer step
    keep_outputs: bool = False
    # > 0: the gradients' norm clipped before the optimizer step (``torch.nn.utils.clip_grad_norm_``,
    # FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``), as torchtitan (``max_norm = 1.0``) and
    # HF's Trainer (``max_grad_norm = 1.0``) do by default; 0: no clipping
    max_grad_norm: float = 0.0

    @property
    def padded(self) -> bool:
        """Whether rows are padded to ``seq_len`` (``avg_seq_len`` below it), coming with the
        ``attention_mask`` a padding collator passes."""
        return self.avg_seq_len is not None and self.avg_seq_len < self.seq_len

    @property
    def packed(self) -> bool:
        """Whether rows are packed from several documents whose positions restart at each
        (``avg_doc_len`` below ``seq_len``), coming with the collator's ``position_ids``."""
        return self.avg_doc_len is not None and self.avg_doc_len < self.seq_len


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    world_size: int = 8
    strategy: Strategy = Strategy.FULL_SHARD
    wrap: WrapPolicy = WrapPolicy.BLOCK
    shard_group_size: int | None = None  # HYBRID_SHARD; default: cluster.gpus_per_node
    # None: True for FULL/HYBRID_SHARD, False for SHARD_GRAD_OP; an integer k (FSDP2, k divides the
    # shard group): keep a 1/k slice of the unsharded parameters after forward, gather within k ranks
    reshard_after_forward: bool | int | None = None
    forward_prefetch: int = (
        0  # units all-gathered ahead explicitly in forward (set_modules_to_forward_prefetch)
    )
    backward_prefetch: int = 1  # units all-gathered ahead in backward; 1 is FSDP2's implicit default
    ddp_bucket_mb: float = 25.0  # NO_SHARD: DistributedDataParallel bucket_cap_mb
    # 2: ``fully_shard`` (FSDP2; NO_SHARD is DDP); 1: ``FullyShardedDataParallel`` (FSDP1, knobs in [fsdp1])
    fsdp_version: int = 2
    # FSDP2 ``offload_policy=CPUOffloadPolicy(pin_memory=cpu_offload_pin_memory)``: shards, gradients
    # and optimizer states on the host (FSDP1's is fsdp1.cpu_offload)
    cpu_offload: bool = False
    cpu_offload_pin_memory: bool = True
    # E > 1: each MoE layer's experts split over groups of E ranks, tokens exchanged by all-to-all,
    # the experts FSDP-sharded over the other world_size / E ranks (sim.scenario.expert_check)
    expert_parallel: int = 1


@dataclass(frozen=True, kw_only=True)
class PrecisionSection:
    param_dtype: str = "fp32"  # MixedPrecisionPolicy.param_dtype; master params stay fp32
    reduce_dtype: str | None = None  # default: param_dtype
    buffer_dtype: str | None = None  # FSDP1 MixedPrecision.buffer_dtype; default: buffers stay fp32
    # fp16 loss scaling with (Sharded)GradScaler: unscale_ and the inf check before each step
    grad_scaler: bool = False
    skipped_step_fraction: float = 0.0  # what-if: the share of steps an overflow skips


@dataclass(frozen=True, kw_only=True)
class Fsdp1Section:
    """``FullyShardedDataParallel``'s own arguments, named as PyTorch names them (read when
    ``parallel.fsdp_version = 1``; the sharding strategy is ``parallel.strategy``, the dtypes
    ``[precision]``)."""

    backward_prefetch: BackwardPrefetch = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = False
    cpu_offload: bool = False  # CPUOffload(offload_params=True)
    # false: FullyShardedDataParallel(mixed_precision=None) over a model stored in
    # precision.param_dtype (llama-recipes' pure_bf16: model.to(bf16), then PEFT, then FSDP): each
    # FlatParameter gathers, computes and reduces in its own dtype (LoRA: fp32 adapters, PEFT's
    # autocast_adapter_dtype, over the low-precision frozen base)
    mixed_precision: bool = True

    def options(self) -> Fsdp1Options:
        return Fsdp1Options(
            backward_prefetch=self.backward_prefetch,
            forward_prefetch=self.forward_prefetch,
            limit_all_gathers=self.limit_all_gathers,
            use_orig_params=self.use_orig_params,
            offload_params=self.cpu_offload,
            mixed_precision=self.mixed_precision,
        )


@dataclass(frozen=True, kw_only=True)
class DeepSpeedSection:
    """DeepSpeed ZeRO (``enabled = true``), its ``zero_optimization`` fields named as DeepSpeed
    names them (sizes in elements); ``fsdpsim run --deepspeed ds_config.json`` fills this section
    (and the batch, precision and optimizer) from a real DeepSpeed config. The dtypes come from
    ``[precision]``: ``bf16`` or ``fp16`` parameters (fp16 with dynamic loss scaling)."""

    enabled: bool = False
    stage: int = 2
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default, true for stage 3 only
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    offload_optimizer: OffloadDevice = OffloadDevice.NONE
    offload_param: OffloadDevice = OffloadDevice.NONE
    train_batch_size: int | None = None  # checked: micro_batch x grad_accum x world_size

    def options(self, param_dtype: str) -> ZeroOptions:
        return ZeroOptions(
            stage=self.stage,
            reduce_bucket_size=self.reduce_bucket_size,
            allgather_bucket_size=self.allgather_bucket_size,
            overlap_comm=self.stage == 3 if self.overlap_comm is None else self.overlap_comm,
            contiguous_gradients=self.contiguous_gradients,
            prefetch_bucket_size=self.stage3_prefetch_bucket_size,
            param_persistence_threshold=self.stage3_param_persistence_threshold,
            max_live_parameters=self.stage3_max_live_parameters,
            max_reuse_distance=self.stage3_max_reuse_distance,
            sub_group_size=self.sub_group_size,
            loss_scaling=param_dtype == "fp16",
            offload_optimizer=self.offload_optimizer,
            offload_param=self.offload_param,
        )


@dataclass(frozen=True, kw_only=True)
class OptimizerSection:
    name: OptimizerName = OptimizerName.ADAMW
    # torch.optim's implementation: "foreach" (its default on CUDA), "for-loop" (foreach=False;
    # also llama-recipes' AnyPrecisionAdamW, a loop over the parameters) or "fused" (fused=True)
    implementation: OptimizerImplementation = OptimizerImplementation.FOREACH


@dataclass(frozen=True, kw_only=True)
class CheckpointingSection:
    mode: CheckpointMode = CheckpointMode.NONE
    # with mode "selective": "op" (torchtitan's op-level policy: keep the outputs of the matmuls but
    # every second one, and of attention; recompute the rest) or N (checkpoint every N-th block)
    selective: str | int = "op"


@dataclass(frozen=True, kw_only=True)
class ClusterSection:
    profile: str = "h100-sxm"  # built-in profile name or path to a calibrated JSON profile
    # the nodes and network (sim/hardware/clusters: dgx-h100, aws-p5, ...) or a cluster JSON file;
    # default: the cluster the profile names (node.cluster), else nodes built from its node section
    name: str | None = None
    gpus_per_node: int | None = None  # ranks per node; default: the cluster's, else the profile's
    # what-ifs on the cluster: other NICs, a degraded network, an oversubscribed spine
    nics_per_node: int | None = None
    nic_gbps: float | None = None
    nic_factor: float = 1.0  # NICs at this fraction of their rate (a ring runs at its slowest link)
    nvlink_factor: float = 1.0
    spine_oversubscription: float | None = None
    compute_scaling: bool = False  # accept a compute section measured at other dimensions, scaled
    device_memory_gib: float | None = None  # override the profile's device memory (GiB, 2**30 bytes)
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True


@dataclass(frozen=True, kw_only=True)
class SimulationSection:
    seed: int = 0
    # relative std-dev of each compute op's time, per rank; unset: the spread the profile's
    # compute calibration measured (``compute.compute_time_rel_std``), 0 without one
    compute_jitter: float | None = None
    slow_rank: int | None = None
    slow_rank_factor: float = 1.0  # e.g. 1.1: slow_rank's compute takes 10 % longer
    # the network's what-ifs that differ between links (every rank is then simulated):
    nic_jitter: float = 0.0  # relative std-dev of each NIC's rate, drawn once per run (seeded)
    slow_nic_node: int | None = None  # a degraded NIC: NIC ``slow_nic`` of this node ...
    slow_nic: int = 0
    slow_nic_factor: float = 1.0  # ... at this fraction of its rate
    # "auto": the vectorised engine where ranks differ, every collective is the world's and there
    # are more than VECTOR_RANKS ranks (it keeps the records of a few ranks, figures of all);
    # "simpy": always the SimPy engine (every rank's records); "vector": the vectorised one where it applies
    engine: str = "auto"


ENGINES = ("auto", "simpy", "vector")
VECTOR_RANKS = 256  # "auto" below this: every rank's full records are cheap enough


@dataclass(frozen=True, kw_only=True)
class FinetuneSection:
    """What the step trains: everything, or LoRA adapters (PEFT ``LoraConfig``) over a frozen base,
    which QLoRA stores in 4-bit NF4 (bitsandbytes ``Params4bit``)."""

    method: FinetuneMethod = FinetuneMethod.FULL
    rank: int = 16  # LoraConfig.r
    alpha: int = 32  # LoraConfig.lora_alpha
    dropout: float = 0.0  # LoraConfig.lora_dropout
    # PEFT's names (["q_proj", "v_proj"]), "all-linear", or None: PEFT's default for the model type
    target_modules: tuple[str, ...] | str | None = None
    quant_storage: str = "bf16"  # qlora: bnb_4bit_quant_storage (the FSDP-QLoRA recipe's bf16)
    double_quant: bool = True  # qlora: bnb_4bit_use_double_quant

    @property
    def lora(self) -> bool:
        return self.method is not FinetuneMethod.FULL

    def settings(self, *, adapter_dtype: str | None = None) -> dict[str, object]:
        """What the model description is measured with (``hfmodel.finetune``); ``adapter_dtype``:
        the adapters' own dtype where it differs from the compute dtype (fp32 adapters computing in
        fp32 over a bf16 base, FSDP1 without MixedPrecision), else absent: they compute in it."""
        targets = list(self.target_modules) if isinstance(self.target_modules, tuple) else self.target_modules
        out: dict[str, object] = {
            "method": self.method.value,
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": targets,
        }
        if self.method is FinetuneMethod.QLORA:
            out |= {"quant_storage": self.quant_storage, "double_quant": self.double_quant}
        if adapter_dtype is not None:
            out["adapter_dtype"] = adapter_dtype
        return out


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "training": TrainingSection,
    "parallel": ParallelSection,
    "precision": PrecisionSection,
    "fsdp1": Fsdp1Section,
    "deepspeed": DeepSpeedSection,
    "optimizer": OptimizerSection,
    "checkpointing": CheckpointingSection,
    "cluster": ClusterSection,
    "simulation": SimulationSection,
    "finetune": FinetuneSection,
}


@dataclass(frozen=True, kw_only=True)
class Scenario:
    source: str
    model: ModelConfig
    training: TrainingSection
    parallel: ParallelSection
    precision: PrecisionSection
    fsdp1: Fsdp1Section
    deepspeed: DeepSpeedSection
    optimizer: OptimizerSection
    checkpointing: CheckpointingSection
    cluster: ClusterSection
    simulation: SimulationSection
    gpus_per_node: int  # cluster.gpus_per_node, else the cluster's or the profile's; resolved at load
    cluster_spec: ClusterSpec | None = None  # the cluster cluster.name names, read at load
    warnings: tuple[str, ...] = ()  # what the scenario asks that its model was not built for
    finetune: FinetuneSection = FinetuneSection()
    use_cache: bool = False  # model.use_cache
    output_format: OutputFormat = OutputFormat.CURRENT  # model.output_format

    @property
    def param_dtype(self) -> str:
        return self.precision.param_dtype

    @property
    def document_mask(self) -> bool:
        """Whether transformers builds packed rows' block-diagonal causal mask from their positions
        (``masking_utils._preprocess_mask_arguments``: only without a KV cache; transformers before
        4.36, the "legacy" output format, never reads positions for a mask): else the rows' attention
        crosses their documents."""
        return self.training.packed and not self.use_cache and self.output_format is OutputFormat.CURRENT

    @property
    def reduce_dtype(self) -> str:
        return self.precision.reduce_dtype or self.precision.param_dtype

    @property
    def master_dtype(self) -> str:
        """The dtype of the trained parameters' shards, their gradients and optimizer states: fp32,
        except FSDP1 with ``mixed_precision=None`` over a model stored in ``param_dtype`` and trained
        whole (llama-recipes' ``--pure_bf16``): there nothing is upcast, so the shards, gradients
        and ``torch.optim.AdamW``'s states (``zeros_like(param)``) are all ``param_dtype``."""
        pure = (
            self.parallel.fsdp_version == 1
            and not self.fsdp1.mixed_precision
            and not self.deepspeed.enabled
            and not self.finetune.lora
        )
        return self.precision.param_dtype if pure else "fp32"

    @property
    def reshard_after_forward(self) -> bool:
        """Whether non-root units free their unsharded parameters after forward (FSDP2 treats an
        integer 1 as False and any larger one as True: ``_fsdp_init._get_post_forward_mesh_info``)."""
        value = self.parallel.reshard_after_forward
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return value > 1
        return self.parallel.strategy not in (Strategy.SHARD_GRAD_OP, Strategy.HYBRID_SHARD_ZERO2)

    @property
    def post_forward_shard_size(self) -> int | None:
        """k of an integer ``reshard_after_forward`` smaller than the shard group: the group of k
        consecutive ranks a unit reshards to after forward; None otherwise (k = the shard group
        size is True to FSDP2)."""
        value = self.parallel.reshard_after_forward
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        return value if 1 < value < self.shard_group_size else None

    @property
    def shard_group_size(self) -> int:
        """Ranks that hold one copy of the sharded state (the all-gather/reduce-scatter group)."""
        strategy, k = self.parallel.strategy, self.parallel.world_size
        if strategy is Strategy.NO_SHARD:
            return 1
        if strategy.is_hybrid:
            return self.parallel.shard_group_size or min(k, self.gpus_per_node)
        return k

    @property
    def fsdp1_options(self) -> Fsdp1Options | None:
        """FSDP1's arguments when the scenario runs ``FullyShardedDataParallel``, else None."""
        return self.fsdp1.options() if self.parallel.fsdp_version == 1 else None

    @property
    def fsdp2_offload(self) -> Fsdp2Offload | None:
        """FSDP2's ``CPUOffloadPolicy`` when the scenario asks for it (``parallel.cpu_offload``)."""
        p = self.parallel
        return Fsdp2Offload(pin_memory=p.cpu_offload_pin_memory) if p.cpu_offload else None

    @property
    def zero_options(self) -> ZeroOptions | None:
        """DeepSpeed ZeRO's settings when the scenario runs DeepSpeed, else None."""
        return self.deepspeed.options(self.param_dtype) if self.deepspeed.enabled else None

    @property
    def tokens_per_step(self) -> int:
        """Real (non-padding) tokens of one optimizer step over all ranks."""
        t = self.training
        real = t.seq_len if t.avg_seq_len is None else t.avg_seq_len
        return t.micro_batch * real * t.grad_accum * self.parallel.world_size

    @property
    def tokens_processed_per_rank(self) -> int:
        """Tokens the kernels process on one rank in one optimizer step, padding included."""
        t = self.training
        return t.micro_batch * t.seq_len * t.grad_accum
