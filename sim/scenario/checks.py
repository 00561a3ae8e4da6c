"""The cross-field rules of a scenario: what one section allows depends on another's (a strategy
and its FSDP version, offload and resharding, DeepSpeed's stages, a finetune method and its
system, selective checkpointing, the KV cache), each broken rule one ``UserError`` naming the
file and keys; and the warnings a valid scenario still earns. ``sim.scenario.loader`` runs them
after building the sections (``check_precision`` and ``sim.scenario.finetune_check``'s
``check_finetune`` before the model is resolved, ``check_scenario`` on the whole). A finetune
method's rules are ``sim.scenario.finetune_check``'s, expert parallelism's
``sim.scenario.expert_check``'s.
"""

from collections.abc import Callable
from typing import Any

from sim.dtypes import FLOAT_DTYPES, canonical_dtype
from sim.errors import UserError
from sim.scenario.expert_check import check_expert_parallel
from sim.scenario.finetune_check import check_finetune_system
from sim.scenario.sections import ENGINES, Scenario
from sim.workload.options import (
    AttentionImpl,
    CheckpointMode,
    OutputFormat,
    Strategy,
)


def check_scenario(s: Scenario, where: str) -> None:
    """The rules across a loaded scenario's sections; the first broken one a UserError naming
    ``where`` and the keys."""

    def positive(name: str, value: float) -> None:
        if value <= 0:
            raise UserError(f"{where}: {name} must be > 0, got {value}")

    for name in ("micro_batch", "seq_len", "grad_accum"):
        positive(f"training.{name}", getattr(s.training, name))
    _check_decoder_seq_len(s, where)
    _check_use_cache(s, where)
    _check_grad_clip(s, where)
    for name in ("avg_seq_len", "avg_doc_len"):
        avg = getattr(s.training, name)
        if avg is not None and not 0 < avg <= s.training.seq_len:
            raise UserError(
                f"{where}: training.{name} must be in [1, training.seq_len = {s.training.seq_len}], got {avg}"
            )
    _check_packing(s, where)
    _check_parallel(s, where, positive)
    _check_selective(s, where)
    _check_cluster(s, where, positive)
    if not 0.0 <= s.precision.skipped_step_fraction < 1.0:
        raise UserError(f"{where}: precision.skipped_step_fraction must be in [0, 1)")
    if s.precision.grad_scaler and s.deepspeed.enabled:
        raise UserError(
            f"{where}: precision.grad_scaler: DeepSpeed scales fp16 losses itself (fp16 in [precision])"
        )
    _check_fsdp_version(s, where)
    _check_fsdp2_offload(s, where)
    _check_reshard(s, where)
    check_expert_parallel(s, where)
    _check_deepspeed(s, where)
    check_finetune_system(s, where)
    _check_fsdp1_mixed_precision(s, where)
    _check_simulation(s, where, positive)


def _check_parallel(s: Scenario, where: str, positive: Callable[[str, float], None]) -> None:
    """[parallel]: sizes positive, prefetch depths not negative, a hybrid strategy's shard group
    dividing the world (and a shard group only for a hybrid strategy)."""
    p = s.parallel
    positive("parallel.world_size", p.world_size)
    positive("parallel.ddp_bucket_mb", p.ddp_bucket_mb)
    if p.forward_prefetch < 0 or p.backward_prefetch < 0:
        raise UserError(f"{where}: parallel.forward_prefetch and parallel.backward_prefetch must be >= 0")
    if p.shard_group_size is not None:
        positive("parallel.shard_group_size", p.shard_group_size)
    if p.strategy.is_hybrid:
        g = s.shard_group_size
        if g <= 0 or p.world_size % g:
            raise UserError(
                f"{where}: parallel.world_size ({p.world_size}) must be divisible by parallel.shard_group_size ({g})"
            )
    elif p.shard_group_size is not None:
        raise UserError(
            f"{where}: parallel.shard_group_size applies only to strategies HYBRID_SHARD and _HYBRID_SHARD_ZERO2"
        )


def _check_simulation(s: Scenario, where: str, positive: Callable[[str, float], None]) -> None:
    """[simulation]: jitter and slowdowns in range, a known engine, the slow rank one of the job's."""
    sim, world = s.simulation, s.parallel.world_size
    if sim.compute_jitter is not None and sim.compute_jitter < 0:
        raise UserError(f"{where}: simulation.compute_jitter must be >= 0")
    positive("simulation.slow_rank_factor", sim.slow_rank_factor)
    positive("simulation.slow_nic_factor", sim.slow_nic_factor)
    if sim.engine not in ENGINES:
        raise UserError(f"{where}: simulation.engine = {sim.engine!r}; allowed: {', '.join(ENGINES)}")
    if sim.nic_jitter < 0 or sim.slow_nic < 0 or (sim.slow_nic_node is not None and sim.slow_nic_node < 0):
        raise UserError(f"{where}: simulation.nic_jitter, slow_nic and slow_nic_node must be >= 0")
    if sim.slow_rank is not None and not 0 <= sim.slow_rank < world:
        raise UserError(f"{where}: simulation.slow_rank must be in [0, {world - 1}], got {sim.slow_rank}")


def _check_cluster(s: Scenario, where: str, positive: Callable[[str, float], None]) -> None:
    c = s.cluster
    for name in ("device_memory_gib", "nics_per_node", "nic_gbps", "nic_factor", "nvlink_factor"):
        value = getattr(c, name)
        if value is not None:
            positive(f"cluster.{name}", value)
    if c.spine_oversubscription is not None and c.spine_oversubscription < 1:
        raise UserError(
            f"{where}: cluster.spine_oversubscription must be >= 1, got {c.spine_oversubscription}"
        )


def _check_fsdp_version(s: Scenario, where: str) -> None:
    """FSDP1 and FSDP2 exist; FSDP2 has no ``_HYBRID_SHARD_ZERO2`` name (it is HSDP without
    resharding) but the schedule is the same, so it is accepted; CPU offload is FSDP1's only."""
    p = s.parallel
    if p.fsdp_version not in (1, 2):
        raise UserError(f"{where}: parallel.fsdp_version = {p.fsdp_version} is not allowed; allowed: 1, 2")
    if p.fsdp_version == 2 and s.fsdp1.cpu_offload:
        raise UserError(f"{where}: fsdp1.cpu_offload needs parallel.fsdp_version = 1")
    if p.fsdp_version == 1 and s.fsdp1.cpu_offload and s.training.grad_accum > 1:
        raise UserError(
            f"{where}: fsdp1.cpu_offload with training.grad_accum > 1 fails in FSDP1 itself "
            "(prepare_gradient_for_backward cannot add a CPU gradient to a device one)"
        )
    if p.fsdp_version == 1 and s.fsdp1.cpu_offload and p.strategy is Strategy.NO_SHARD:
        raise UserError(
            f"{where}: fsdp1.cpu_offload with strategy NO_SHARD is not modelled; use a sharded strategy"
        )


def _check_grad_clip(s: Scenario, where: str) -> None:
    """``training.max_grad_norm``: 0 (off) or a positive norm; with CPU offload the norms and the
    scaling run on the host's gradient shards, which is not modelled."""
    norm = s.training.max_grad_norm
    if norm < 0:
        raise UserError(f"{where}: training.max_grad_norm must be >= 0 (0: no clipping), got {norm}")
    if norm > 0 and (s.parallel.cpu_offload or s.fsdp1.cpu_offload):
        raise UserError(
            f"{where}: training.max_grad_norm with CPU offload (clipping the host's gradient shards) is not "
            "modelled; set training.max_grad_norm = 0"
        )


def _check_fsdp2_offload(s: Scenario, where: str) -> None:
    """``parallel.cpu_offload`` is FSDP2's ``CPUOffloadPolicy``: a sharded FSDP2 strategy, one
    reduction per unit and step (a second micro-batch's reduced gradient is added into the CPU shard
    by a blocking copy and a CPU add, not modelled), no grad scaler (its unscale runs on CPU shards)."""
    p = s.parallel
    if not p.cpu_offload:
        return
    if p.fsdp_version != 2 or s.deepspeed.enabled:
        raise UserError(
            f"{where}: parallel.cpu_offload is FSDP2's CPUOffloadPolicy; FSDP1 offloads with "
            "fsdp1.cpu_offload, DeepSpeed with deepspeed.offload_optimizer / offload_param"
        )
    if p.strategy is Strategy.NO_SHARD:
        raise UserError(f"{where}: parallel.cpu_offload needs a sharded strategy (NO_SHARD is DDP)")
    if s.shard_group_size == 1:
        raise UserError(
            f"{where}: parallel.cpu_offload on a one-rank shard group (no all-gather, no reduce-scatter) "
            "is not modelled; use a shard group of 2 or more ranks"
        )
    if s.training.grad_accum > 1 and s.training.sync_every_microbatch:
        raise UserError(
            f"{where}: parallel.cpu_offload with training.grad_accum > 1 adds each micro-batch's reduced "
            "gradient into the CPU shard on the host, which is not modelled; set "
            "training.sync_every_microbatch = false (one reduction per step)"
        )
    if s.precision.grad_scaler:
        raise UserError(f"{where}: parallel.cpu_offload with precision.grad_scaler is not modelled")


def _check_reshard(s: Scenario, where: str) -> None:
    """An integer ``reshard_after_forward`` is FSDP2's, and must divide the shard group
    (``_fsdp_init._get_post_forward_mesh_info``)."""
    k, p = s.parallel.reshard_after_forward, s.parallel
    if k is None or isinstance(k, bool):
        return
    if p.fsdp_version != 2 or s.deepspeed.enabled or p.strategy is Strategy.NO_SHARD:
        raise UserError(
            f"{where}: parallel.reshard_after_forward = {k}: an integer is FSDP2's (fully_shard with a "
            "sharding strategy); FSDP1, DeepSpeed and NO_SHARD take true or false"
        )
    g = s.shard_group_size
    if k < 1 or g % k:
        raise UserError(
            f"{where}: parallel.reshard_after_forward = {k} must be true, false or an integer that divides "
            f"the shard group size ({g})"
        )


def _check_deepspeed(s: Scenario, where: str) -> None:
    d = s.deepspeed
    if not d.enabled:
        return
    if d.stage not in (1, 2, 3):
        raise UserError(
            f"{where}: deepspeed.stage = {d.stage} is not allowed; allowed: 1, 2, 3 (ZeRO stages)"
        )
    for name in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size"):
        if getattr(d, name) <= 0:
            raise UserError(f"{where}: deepspeed.{name} must be > 0, got {getattr(d, name)}")
    if s.param_dtype not in ("bf16", "fp16", "fp32"):
        raise UserError(
            f"{where}: precision.param_dtype = {s.param_dtype!r}: DeepSpeed trains in fp32, bf16 or fp16"
        )
    if s.parallel.strategy is not Strategy.FULL_SHARD or s.parallel.fsdp_version != 2:
        raise UserError(
            f"{where}: deepspeed.enabled: the ZeRO stage is deepspeed.stage; leave parallel.strategy "
            "(FULL_SHARD) and parallel.fsdp_version (2) at their defaults"
        )
    total = s.training.micro_batch * s.training.grad_accum * s.parallel.world_size
    if d.train_batch_size is not None and d.train_batch_size != total:
        raise UserError(
            f"{where}: deepspeed.train_batch_size = {d.train_batch_size} but micro_batch x grad_accum x world_size "
            f"= {s.training.micro_batch} x {s.training.grad_accum} x {s.parallel.world_size} = {total}"
        )
    if d.offload_optimizer.value == "nvme" and d.stage != 3:
        raise UserError(
            f"{where}: deepspeed.offload_optimizer = nvme needs deepspeed.stage = 3 (ZeRO-Infinity)"
        )
    if d.offload_param.value != "none" and d.stage != 3:
        raise UserError(f"{where}: deepspeed.offload_param needs deepspeed.stage = 3")


def check_precision(precision: Any, where: str) -> None:
    """Before the model is described in ``param_dtype``."""
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        value = getattr(precision, name)
        if value is not None:
            try:
                canonical = canonical_dtype(value)
            except UserError as e:
                raise UserError(f"{where}: precision.{name}: {e}") from None
            if canonical not in FLOAT_DTYPES:
                raise UserError(
                    f"{where}: precision.{name} = {value!r} is not allowed; allowed: {', '.join(sorted(FLOAT_DTYPES))}"
                )


def _check_fsdp1_mixed_precision(s: Scenario, where: str) -> None:
    """``fsdp1.mixed_precision = false``: FSDP1 with ``mixed_precision=None`` over a model stored in
    ``param_dtype``: LoRA's adapters stay fp32; trained whole, everything is ``param_dtype``
    (``Scenario.master_dtype``)."""
    if s.fsdp1.mixed_precision:
        return
    if s.parallel.fsdp_version != 1 or s.deepspeed.enabled:
        raise UserError(f"{where}: fsdp1.mixed_precision = false needs parallel.fsdp_version = 1")
    given = [
        f"precision.{k}" for k in ("reduce_dtype", "buffer_dtype") if getattr(s.precision, k) is not None
    ]
    if given:
        raise UserError(
            f"{where}: fsdp1.mixed_precision = false reduces each FlatParameter in its own dtype and keeps "
            f"buffers as stored; remove {' and '.join(given)}"
        )


def _check_selective(s: Scenario, where: str) -> None:
    value = s.checkpointing.selective
    if value != "op" and not (isinstance(value, int) and value >= 1):
        raise UserError(
            f'{where}: checkpointing.selective = {value!r} is not allowed; allowed: "op" or a positive integer N '
            "(checkpoint every N-th block)"
        )


def _check_packing(s: Scenario, where: str) -> None:
    """Packed rows (training.avg_doc_len) are full rows: not padded as well; and their restarted
    positions are a decoder's (an encoder-decoder's T5 positions are its relative bias)."""
    t = s.training
    if not t.packed:
        return
    if t.padded:
        raise UserError(
            f"{where}: training.avg_doc_len (packed rows) and training.avg_seq_len (padded rows) exclude "
            "each other: packed rows are full; set one of them"
        )
    d = s.model.description
    if d is not None and d.decoder_seq_len is not None:
        raise UserError(
            f"{where}: training.avg_doc_len: packed rows are modelled for decoder-only models; "
            f"{d.name} is an encoder-decoder"
        )


def _check_use_cache(s: Scenario, where: str) -> None:
    """model.use_cache is modelled for decoder-only models (a self-attention K/V per block); a
    ``DynamicCache`` (model.output_format "current") with HF's eager attention under checkpointing
    is refused: the real run fails. So is a kept output holding a DynamicCache under
    checkpointing: each recompute attends over the cache's grown keys, which is not modelled."""
    if not s.use_cache:
        return
    dynamic_under_checkpointing = (
        s.output_format is OutputFormat.CURRENT and s.checkpointing.mode is not CheckpointMode.NONE
    )
    if dynamic_under_checkpointing and s.training.keep_outputs:
        raise UserError(
            f"{where}: training.keep_outputs with model.use_cache under checkpointing is not modelled for "
            "transformers >= 4.36 (the kept DynamicCache grows at each recompute, which then attends over "
            'its doubled keys); set model.output_format = "legacy" (transformers < 4.36) or model.use_cache = false'
        )
    if dynamic_under_checkpointing and s.training.attention is AttentionImpl.EAGER:
        # each recompute appends its K/V to the DynamicCache again: the keys grow to twice the
        # sequence while the causal mask built in forward stays s x s (transformers 5.24 raises
        # "Attempting to broadcast a dimension ..." in the first recompute, measured here)
        raise UserError(
            f'{where}: model.use_cache with training.attention = "eager" under checkpointing fails for real '
            "(transformers >= 4.36: each recompute appends its K/V to the DynamicCache, and the eager "
            'attention\'s s x s mask no longer fits); set model.output_format = "legacy" (transformers < 4.36) '
            "or model.use_cache = false"
        )
    d = s.model.description
    if d is not None and d.decoder_seq_len is not None:
        raise UserError(
            f"{where}: model.use_cache is not modelled for encoder-decoder models ({s.model.name}: its "
            "decoder caches self- and cross-attention K/V); set model.use_cache = false"
        )


def _check_decoder_seq_len(s: Scenario, where: str) -> None:
    dec = s.training.decoder_seq_len
    if dec is None:
        return
    if dec <= 0:
        raise UserError(f"{where}: training.decoder_seq_len must be > 0, got {dec}")
    d = s.model.description
    if d is None or d.decoder_seq_len is None:
        raise UserError(
            f"{where}: training.decoder_seq_len is for encoder-decoder models (T5); model {s.model.name} "
            "is a decoder: use training.seq_len"
        )


def scenario_warnings(s: Scenario, where: str) -> tuple[str, ...]:
    """A sequence longer than the model's ``max_position_embeddings`` (a described model's config)."""
    d = s.model.description
    limit = d.max_position_embeddings if d is not None else None
    if limit is not None and s.training.seq_len > limit:
        return (
            f"{where}: training.seq_len = {s.training.seq_len} exceeds the model's max_position_embeddings "
            f"({limit}); it was not trained for it (RoPE scaling or a long-context variant is needed)",
        )
    return ()
