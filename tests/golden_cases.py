"""The cases of the golden test: every file in scenarios/ as it is, plus variants that reach each
schedule path (DDP, HSDP, wrap policies, checkpointing, prefetch, mixed precision, accumulation,
jitter and a slow rank, a calibrated gloo profile).

Where each recording comes from (``tests/data/golden/README.md``): the calibrated-CPU cases
(``PRE_REWRITE``) are the reports and event tables of the code before the layered rewrite
(issue 10), unchanged since; the cases on built-in GPU profiles were recorded again, by
``python tests/golden_cases.py --record``, when the GPU kernel model replaced the roofline
(issue 11), and are recorded again whenever a cost model changes on purpose, so that each such
change shows its effect on every scenario in the diff of these files."""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted(p.name for p in (ROOT / "scenarios").glob("*.toml"))
CPU = "cluster.profile=profiles/cpu-2x-gloo.json"

VARIANTS: list[tuple[str, str, list[str]]] = [
    ("tiny-ddp", "tiny.toml", ["parallel.strategy=NO_SHARD"]),
    ("tiny-ddp-ckpt", "tiny.toml", ["parallel.strategy=NO_SHARD", "checkpointing.mode=full"]),
    ("tiny-ddp-bf16", "tiny.toml", ["parallel.strategy=NO_SHARD", "precision.param_dtype=bf16"]),
    ("tiny-zero2", "tiny.toml", ["parallel.strategy=SHARD_GRAD_OP"]),
    ("tiny-raf2", "tiny.toml", ["parallel.world_size=8", "parallel.reshard_after_forward=2"]),
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
    # FSDP1 and DeepSpeed ZeRO (issue 13)
    ("tiny-fsdp1", "tiny.toml", ["parallel.fsdp_version=1"]),
    (
        "tiny-fsdp1-zero2-bf16-orig",
        "tiny.toml",
        [
            "parallel.fsdp_version=1",
            "parallel.strategy=SHARD_GRAD_OP",
            "precision.param_dtype=bf16",
            "precision.reduce_dtype=fp32",
            "fsdp1.use_orig_params=true",
            "fsdp1.backward_prefetch=BACKWARD_POST",
            "parallel.world_size=3",
        ],
    ),
    (
        "tiny-fsdp1-hsdp",
        "tiny.toml",
        [
            "parallel.fsdp_version=1",
            "parallel.strategy=HYBRID_SHARD",
            "parallel.world_size=8",
            "parallel.shard_group_size=4",
        ],
    ),
    (
        "tiny-fsdp1-noshard-accum",
        "tiny.toml",
        ["parallel.fsdp_version=1", "parallel.strategy=NO_SHARD", "training.grad_accum=2"],
    ),
    (
        "tiny-zero1",
        "tiny.toml",
        [
            "deepspeed.enabled=true",
            "deepspeed.stage=1",
            "precision.param_dtype=bf16",
            "deepspeed.reduce_bucket_size=20000",
        ],
    ),
    (
        "tiny-zero2-overlap",
        "tiny.toml",
        [
            "deepspeed.enabled=true",
            "deepspeed.stage=2",
            "precision.param_dtype=bf16",
            "deepspeed.reduce_bucket_size=20000",
            "deepspeed.overlap_comm=true",
        ],
    ),
    (
        "tiny-zero3-ckpt",
        "tiny.toml",
        [
            "deepspeed.enabled=true",
            "deepspeed.stage=3",
            "precision.param_dtype=bf16",
            "deepspeed.stage3_param_persistence_threshold=100",
            "deepspeed.stage3_prefetch_bucket_size=5000",
            "deepspeed.reduce_bucket_size=50000",
            "checkpointing.mode=full",
        ],
    ),
    (
        "7b-a100-multinode",
        "llama2-7b-8xh100-zero3.toml",
        ["cluster.profile=a100-sxm-80g", "parallel.world_size=32"],
    ),
]

CASES: list[tuple[str, str, list[str]]] = [
    (Path(name).stem, f"scenarios/{name}", []) for name in SCENARIOS
] + [(name, f"scenarios/{scenario}", sets) for name, scenario, sets in VARIANTS]

# recorded by the code before the layered rewrite and never re-recorded: the calibrated gloo
# profile's path is the one validated against real FSDP2 runs (VALIDATION.md)
PRE_REWRITE = frozenset(
    name for name, _, sets in CASES if any(s.startswith("cluster.profile=profiles/") for s in sets)
)
GOLDEN = ROOT / "tests" / "data" / "golden"


def event_rows(table) -> dict[str, list[list[object]]]:  # type: ignore[no-untyped-def]
    """An event table as the golden files store it."""
    ops = [
        [o.rank, o.op_id, str(o.stream), str(o.kind), o.name, o.unit, o.microbatch]
        + [o.ready_s, o.start_s, o.end_s, o.bytes, o.group_size]
        for o in table.ops
    ]
    memory = [[m.rank, m.time_s, str(m.category), m.delta_bytes, m.label] for m in table.memory]
    return {"ops": ops, "memory": memory}


def record(names: Sequence[str]) -> None:
    """Write the current code's report (and, where one is kept, event table) of each case."""
    import os

    from sim.outputs.report import build_report
    from sim.scenario.loader import load_scenario
    from sim.simulate import simulate

    os.chdir(ROOT)  # the reports name the scenario and profile paths as given
    for name, scenario, sets in CASES:
        if name not in names:
            continue
        result = simulate(load_scenario(scenario, sets))
        (GOLDEN / f"{name}.json").write_text(json.dumps(build_report(result).to_json(), indent=1) + "\n")
        events = GOLDEN / f"{name}.events.json"
        if events.exists():
            events.write_text(json.dumps(event_rows(result.events)) + "\n")
        print(f"recorded {name}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="re-record golden cases with the current code")
    parser.add_argument(
        "--record",
        nargs="*",
        metavar="NAME",
        required=True,
        help="cases (default: all but the pre-rewrite ones)",
    )
    args = parser.parse_args(argv)
    known = {name for name, _, _ in CASES}
    names = set(args.record) or known - PRE_REWRITE
    unknown = names - known
    if unknown:
        print(
            f"golden_cases: unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
        )
        return 2
    record(sorted(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
