"""The rows of the validation matrix: which configurations ``make validate`` runs, on which bases.

Split from ``validation.matrix``, which runs them (``MATRIX`` for real, ``MEMORY_MATRIX`` in fake
mode); kept apart because the rows are data that other readers use too: the document names the
bases, ``validation.offload_memory`` measures at ``MEMORY_BASE``, and the tests check that every
``hf`` row is its own system with its config.json in place. ``system_of`` sorts a row into the ``SYSTEMS`` that
``fsdpsim validate --matrix --systems`` selects.
"""

BASE = "scenarios/validate-cpu.toml"
_DS = ["deepspeed.enabled=true", "deepspeed.reduce_bucket_size=2000000"]
_DS_BF16 = [*_DS, "precision.param_dtype=bf16"]

# (name, overrides): strategies, wrap policies, checkpointing, prefetch, dtypes, two model sizes
MATRIX: list[tuple[str, list[str]]] = [
    ("5m FULL_SHARD block fp32", []),
    ("5m SHARD_GRAD_OP block fp32", ["parallel.strategy=SHARD_GRAD_OP"]),
    ("5m NO_SHARD (DDP) fp32", ["parallel.strategy=NO_SHARD"]),
    ("5m FULL_SHARD model fp32", ["parallel.wrap=model"]),
    ("5m FULL_SHARD block fp32 checkpointing", ["checkpointing.mode=full"]),
    ("5m FULL_SHARD block fp32 selective op checkpointing", ["checkpointing.mode=selective"]),
    ("5m FULL_SHARD block fp32 forward prefetch 1", ["parallel.forward_prefetch=1"]),
    ("5m FULL_SHARD block bf16", ["precision.param_dtype=bf16"]),
    # a 2-D (replicate 2, shard 1) mesh: FSDP2 skips the one-rank collectives and all-reduces
    ("5m HYBRID_SHARD 2x1 fp32", ["parallel.strategy=HYBRID_SHARD", "parallel.shard_group_size=1"]),
    ("34m FULL_SHARD block fp32", ["model.preset=llama-34m"]),
    # bf16 matmuls run ~20x slower than fp32 on this CPU (no native bf16), so the larger model
    # is validated in fp32
    ("34m FULL_SHARD block fp32 checkpointing", ["model.preset=llama-34m", "checkpointing.mode=full"]),
    # FSDP1 (FullyShardedDataParallel): its defaults (BACKWARD_PRE, limit_all_gathers) unless named
    ("FSDP1 5m FULL_SHARD block fp32", ["parallel.fsdp_version=1"]),
    ("FSDP1 5m SHARD_GRAD_OP block fp32", ["parallel.fsdp_version=1", "parallel.strategy=SHARD_GRAD_OP"]),
    ("FSDP1 5m NO_SHARD fp32", ["parallel.fsdp_version=1", "parallel.strategy=NO_SHARD"]),
    ("FSDP1 5m FULL_SHARD block bf16", ["parallel.fsdp_version=1", "precision.param_dtype=bf16"]),
    (
        "FSDP1 5m FULL_SHARD block fp32 checkpointing",
        ["parallel.fsdp_version=1", "checkpointing.mode=full"],
    ),
    (
        "FSDP1 5m FULL_SHARD block fp32 BACKWARD_POST forward_prefetch use_orig_params",
        [
            "parallel.fsdp_version=1",
            "fsdp1.backward_prefetch=BACKWARD_POST",
            "fsdp1.forward_prefetch=true",
            "fsdp1.use_orig_params=true",
        ],
    ),
    ("FSDP1 34m FULL_SHARD block fp32", ["parallel.fsdp_version=1", "model.preset=llama-34m"]),
    # DeepSpeed ZeRO (torch_adam AdamW); 2M-element buckets (the 5e8 default allocates 1 GB buffers)
    ("DeepSpeed ZeRO-1 5m bf16", [*_DS_BF16, "deepspeed.stage=1"]),
    (
        "DeepSpeed ZeRO-2 5m bf16 overlap_comm",
        [*_DS_BF16, "deepspeed.stage=2", "deepspeed.overlap_comm=true"],
    ),
    ("DeepSpeed ZeRO-2 5m fp32", [*_DS, "deepspeed.stage=2", "precision.param_dtype=fp32"]),
    (
        "DeepSpeed ZeRO-3 5m bf16",
        [*_DS_BF16, "deepspeed.stage=3", "deepspeed.stage3_param_persistence_threshold=10000"],
    ),
    (  # the head shares the embedding's weight: its gradient is summed from both uses
        "DeepSpeed ZeRO-3 5m bf16 tied embeddings",
        [
            *_DS_BF16,
            "deepspeed.stage=3",
            "deepspeed.stage3_param_persistence_threshold=10000",
            "model.tie_embeddings=true",
        ],
    ),
    (
        "DeepSpeed ZeRO-3 5m bf16 checkpointing",
        [
            *_DS_BF16,
            "deepspeed.stage=3",
            "deepspeed.stage3_param_persistence_threshold=10000",
            "checkpointing.mode=full",
        ],
    ),
]


HF_BASE = "validation/hf-cpu.toml"
_HF = "model.config=../tests/data/hf/"
# (name, overrides of HF_BASE): models from a config.json, timed on their own calibrated units
# (``calibrate.hf_units``); the MoE in bf16, as transformers' grouped-mm experts run on a CPU
HF_MATRIX: list[tuple[str, list[str]]] = [
    ("hf tiny-qwen2 (dense) FULL_SHARD block fp32", [f"{_HF}tiny-qwen2.json"]),
    # at the FSDP2 rows' scale (validation/hf/README.md): one dense and one MoE model
    ("hf qwen2-5m (dense) FULL_SHARD block fp32", ["model.config=hf/qwen2-5m.json"]),
    (
        "hf mixtral-5m (MoE, 4 experts, top-2) FULL_SHARD block bf16",
        ["model.config=hf/mixtral-5m.json", "precision.param_dtype=bf16"],
    ),
    (
        "hf tiny-mixtral (MoE, 4 experts, top-2) FULL_SHARD block bf16",
        [f"{_HF}tiny-mixtral.json", "precision.param_dtype=bf16"],
    ),
    (  # PEFT's LoRA on every linear of the blocks, the base frozen (calibrated as it trains)
        "hf tiny-qwen2 (dense) LoRA r8 all-linear FULL_SHARD block fp32",
        [
            f"{_HF}tiny-qwen2.json",
            "finetune.method=lora",
            "finetune.rank=8",
            "finetune.alpha=16",
            "finetune.target_modules=all-linear",
        ],
    ),
    (  # FSDP1 with PEFT's fsdp_auto_wrap_policy: frozen blocks, every adapter its own FlatParameter
        "hf tiny-qwen2 (dense) LoRA r8 all-linear FSDP1 FULL_SHARD peft wrap fp32",
        [
            f"{_HF}tiny-qwen2.json",
            "finetune.method=lora",
            "finetune.rank=8",
            "finetune.alpha=16",
            "finetune.target_modules=all-linear",
            "parallel.fsdp_version=1",
            "parallel.wrap=peft",
        ],
    ),
    # an encoder-decoder: 3 encoder and 2 decoder blocks, relative position bias, the decoder as
    # long as the encoder
    ("hf tiny-t5 (encoder-decoder) FULL_SHARD block fp32", [f"{_HF}tiny-t5.json"]),
]
MATRIX += HF_MATRIX


MEMORY_BASE = "scenarios/llama2-7b-8xh100-zero3.toml"
_BF16 = ["precision.param_dtype=bf16", "precision.reduce_dtype=fp32"]
_FP32 = ["precision.param_dtype=fp32", "precision.reduce_dtype=fp32"]
_70B = ["model.preset=llama3-70b", "parallel.world_size=64", "training.micro_batch=1"]
_FSDP1 = ["parallel.fsdp_version=1"]
# (name, overrides of MEMORY_BASE): real presets at their real world sizes, one rank in fake mode
MEMORY_MATRIX: list[tuple[str, list[str]]] = [
    ("Llama-2-7B, 8 ranks, fp32", _FP32),
    ("Llama-2-7B, 8 ranks, bf16", _BF16),
    ("Llama-2-7B, 8 ranks, bf16, checkpointing", [*_BF16, "checkpointing.mode=full"]),
    ("Llama-2-7B, 8 ranks, bf16, selective op checkpointing", [*_BF16, "checkpointing.mode=selective"]),
    (
        "Llama-2-7B, 8 ranks, bf16, every 2nd block checkpointed",
        [*_BF16, "checkpointing.mode=selective", "checkpointing.selective=2"],
    ),
    (
        "Llama-2-7B, 8 ranks, bf16, reshard_after_forward=False",
        [*_BF16, "parallel.reshard_after_forward=false"],
    ),
    (  # FSDP2's integer reshard_after_forward: 1/k slices kept, backward gathers within k ranks
        "Llama-2-7B, 8 ranks, bf16, reshard_after_forward=2",
        [*_BF16, "parallel.reshard_after_forward=2"],
    ),
    ("Llama-3-70B, 64 ranks, bf16", [*_70B, *_BF16]),
    ("Llama-3-70B, 64 ranks, fp32", [*_70B, *_FP32]),
    ("Llama-3-70B, 64 ranks, bf16, checkpointing", [*_70B, *_BF16, "checkpointing.mode=full"]),
    (
        "Llama-3-70B, 64 ranks, bf16, selective op checkpointing",
        [*_70B, *_BF16, "checkpointing.mode=selective"],
    ),
    (
        "Llama-3-70B, 64 ranks, bf16, reshard_after_forward=False",
        [*_70B, *_BF16, "parallel.reshard_after_forward=false"],
    ),
    ("FSDP1 Llama-2-7B, 8 ranks, fp32", [*_FSDP1, *_FP32]),
    ("FSDP1 Llama-2-7B, 8 ranks, bf16", [*_FSDP1, *_BF16]),
    ("FSDP1 Llama-2-7B, 8 ranks, bf16, checkpointing", [*_FSDP1, *_BF16, "checkpointing.mode=full"]),
    ("FSDP1 Llama-2-7B, 8 ranks, bf16, SHARD_GRAD_OP", [*_FSDP1, *_BF16, "parallel.strategy=SHARD_GRAD_OP"]),
    (
        "FSDP1 Llama-2-7B, 8 ranks, bf16, use_orig_params, BACKWARD_POST",
        [*_FSDP1, *_BF16, "fsdp1.use_orig_params=true", "fsdp1.backward_prefetch=BACKWARD_POST"],
    ),
    ("FSDP1 Llama-3-70B, 64 ranks, bf16", [*_FSDP1, *_70B, *_BF16]),
    (  # PEFT's LoRA (r16 on q_proj, v_proj) with PEFT's wrap policy; fp32, as FSDP1 + PEFT runs without autocast
        "FSDP1 Llama-2-7B, 8 ranks, fp32, LoRA r16, PEFT's wrap",
        [
            *_FSDP1,
            *_FP32,
            "parallel.wrap=peft",
            "finetune.method=lora",
            "finetune.rank=16",
            "finetune.alpha=32",
        ],
    ),
]


SYSTEMS = ("fsdp2", "fsdp1", "deepspeed", "hf")


def system_of(overrides: list[str]) -> str:
    """Which system a matrix row runs: FSDP1 (``parallel.fsdp_version=1``), DeepSpeed, FSDP2/DDP,
    or FSDP2 on a model from a config.json (``hf``, the rows of ``HF_BASE``)."""
    if any(o.startswith("model.config=") for o in overrides):
        return "hf"
    if any(o.startswith("deepspeed.") for o in overrides):
        return "deepspeed"
    return "fsdp1" if "parallel.fsdp_version=1" in overrides else "fsdp2"


def selected_rows(rows: list[tuple[str, list[str]]], systems: set[str] | None) -> list[tuple[str, list[str]]]:
    """The rows of ``systems`` (every row with None)."""
    return [row for row in rows if systems is None or system_of(row[1]) in systems]
