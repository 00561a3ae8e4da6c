"""The cases of the golden test: every file in scenarios/ as it is, plus variants that reach each
schedule path (DDP, HSDP, wrap policies, checkpointing, prefetch, mixed precision, accumulation,
jitter and a slow rank, a calibrated gloo profile). Their reports were recorded in
``tests/data/golden`` by the code before the layered rewrite (issue 10)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted(p.name for p in (ROOT / "scenarios").glob("*.toml"))
CPU = "cluster.profile=profiles/cpu-2x-gloo.json"

VARIANTS: list[tuple[str, str, list[str]]] = [
    ("tiny-ddp", "tiny.toml", ["parallel.strategy=NO_SHARD"]),
    ("tiny-ddp-ckpt", "tiny.toml", ["parallel.strategy=NO_SHARD", "checkpointing.mode=full"]),
    ("tiny-ddp-bf16", "tiny.toml", ["parallel.strategy=NO_SHARD", "precision.param_dtype=bf16"]),
    ("tiny-zero2", "tiny.toml", ["parallel.strategy=SHARD_GRAD_OP"]),
    (
        "tiny-hsdp",
        "tiny.toml",
        ["parallel.strategy=HYBRID_SHARD", "parallel.world_size=8", "parallel.shard_group_size=4"],
    ),
    ("tiny-hsdp-1", "tiny.toml", ["parallel.strategy=HYBRID_SHARD", "parallel.shard_group_size=1"]),
    ("tiny-world1", "tiny.toml", ["parallel.world_size=1"]),
    ("tiny-linear", "tiny.toml", ["parallel.wrap=linear"]),
    ("tiny-model", "tiny.toml", ["parallel.wrap=model"]),
    (
        "tiny-ckpt-bf16",
        "tiny.toml",
        ["checkpointing.mode=full", "precision.param_dtype=bf16", "precision.reduce_dtype=fp32"],
    ),
    (
        "tiny-accum",
        "tiny.toml",
        ["training.grad_accum=3", "parallel.forward_prefetch=1", "parallel.backward_prefetch=2"],
    ),
    (
        "tiny-jitter",
        "tiny.toml",
        [
            "parallel.world_size=4",
            "simulation.compute_jitter=0.05",
            "simulation.slow_rank=2",
            "simulation.slow_rank_factor=1.2",
        ],
    ),
    ("tiny-sgd-tied", "tiny.toml", ["optimizer.name=sgd", "model.tie_embeddings=true"]),
    ("tiny-cpu", "tiny.toml", [CPU]),
    ("tiny-cpu-ddp", "tiny.toml", [CPU, "parallel.strategy=NO_SHARD"]),
    ("tiny-cpu-ckpt", "tiny.toml", [CPU, "checkpointing.mode=full"]),
    ("tiny-cpu-hsdp", "tiny.toml", [CPU, "parallel.strategy=HYBRID_SHARD", "parallel.shard_group_size=1"]),
    (
        "7b-a100-multinode",
        "llama2-7b-8xh100-zero3.toml",
        ["cluster.profile=a100-sxm-80g", "parallel.world_size=32"],
    ),
]

CASES: list[tuple[str, str, list[str]]] = [
    (Path(name).stem, f"scenarios/{name}", []) for name in SCENARIOS
] + [(name, f"scenarios/{scenario}", sets) for name, scenario, sets in VARIANTS]
