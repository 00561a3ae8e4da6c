"""The validation matrix behind ``make validate``: configurations run for real and simulated,
summarised in VALIDATION.md with the machine, versions, every prediction, measurement and error.

A shared host drifts by more than a configuration's error over minutes, so the matrix runs in
``ROUNDS`` interleaved rounds: each round recalibrates the collectives, then for every
configuration calibrates its compute and runs it for real right after. Every figure is the
median over rounds, of the predictions and of the measurements alike; each prediction uses only
calibrations taken before its own real run."""

import datetime
import os
import platform
import statistics
import tempfile
from pathlib import Path

from sim.fileio import write_text_atomic
from validation.compare import Comparison, Row, format_markdown
from validation.run import calibrate_collectives, calibrated_profile, validate_one

BASE = "scenarios/validate-cpu.toml"
_DS = ["deepspeed.enabled=true", "deepspeed.reduce_bucket_size=2000000"]
_DS_BF16 = [*_DS, "precision.param_dtype=bf16"]
ROUNDS = 3

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


def _machine(nproc: int) -> list[str]:
    import torch

    from calibrate.device_probe import cpu_model

    return [
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()}; each rank runs "
        f"{os.environ.get('OMP_NUM_THREADS', max(1, (os.cpu_count() or 1) // nproc))} thread(s) (OMP_NUM_THREADS)",
        f"- torch {torch.__version__}, backend gloo, Python {platform.python_version()}",
    ]


def _summary(results: list[tuple[str, Comparison]]) -> list[str]:
    lines = [
        "| configuration | step time error | peak memory error | collectives match |",
        "|---|---|---|---|",
    ]
    step_errors, memory_errors = [], []
    for name, c in results:
        step, peak = c.error("step time"), c.error("peak memory")
        step_errors.append(abs(step or 0.0))
        memory_errors.append(abs(peak or 0.0))
        lines.append(f"| {name} | {step:+.1%} | {peak:+.1%} | {'yes' if c.collectives_match else 'NO'} |")
    lines += [
        "",
        f"Step time: median |error| {statistics.median(step_errors):.1%}, worst {max(step_errors):.1%}. "
        f"Peak memory: median |error| {statistics.median(memory_errors):.1%}, worst {max(memory_errors):.1%}.",
    ]
    return lines


def median_comparison(rounds: list[Comparison]) -> Comparison:
    """One comparison from several rounds of the same configuration: each row's prediction and
    measurement are their medians over rounds; the collectives match only if every round's did."""
    first = rounds[0]
    by_metric = [{r.metric: r for r in c.rows} for c in rounds]
    rows = [
        Row(
            row.metric,
            statistics.median(m[row.metric].predicted for m in by_metric),
            statistics.median(m[row.metric].measured for m in by_metric),
            row.unit,
        )
        for row in first.rows
        if all(row.metric in m for m in by_metric)  # a row some round lacks is left out
    ]
    collectives = [
        dict(c, match=all(r.collectives[i]["match"] for r in rounds)) for i, c in enumerate(first.collectives)
    ]
    steps = [c.measured_step_s for c in rounds]
    measured_step_s = {
        "median": statistics.median(s["median"] for s in steps),
        "min": min(s["min"] for s in steps),
        "max": max(s["max"] for s in steps),
    }
    return Comparison(rows=rows, collectives=collectives, measured_step_s=measured_step_s)


SYSTEMS = ("fsdp2", "fsdp1", "deepspeed", "hf")


def system_of(overrides: list[str]) -> str:
    """Which system a matrix row runs: FSDP1 (``parallel.fsdp_version=1``), DeepSpeed, FSDP2/DDP,
    or FSDP2 on a model from a config.json (``hf``, the rows of ``HF_BASE``)."""
    if any(o.startswith("model.config=") for o in overrides):
        return "hf"
    if any(o.startswith("deepspeed.") for o in overrides):
        return "deepspeed"
    return "fsdp1" if "parallel.fsdp_version=1" in overrides else "fsdp2"


def _selected(rows: list[tuple[str, list[str]]], systems: set[str] | None) -> list[tuple[str, list[str]]]:
    return [row for row in rows if systems is None or system_of(row[1]) in systems]


def write_between_markers(path: str, key: str, section: str) -> None:
    """Replace the section between ``<!-- key:begin -->`` and ``<!-- key:end -->`` in ``path``
    (appended the first time), keeping the rest of the file."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    p = Path(path)
    text = p.read_text() if p.is_file() else ""
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    write_text_atomic(path, text)


def _run_config(
    overrides: list[str], folder: Path, comm: Path, *, steps: int, warmup: int, nproc: int
) -> Comparison:
    """One configuration in one round: its compute calibrated for its own dimensions, then run."""
    folder.mkdir()
    sets = [*overrides, f"parallel.world_size={nproc}"]
    base = HF_BASE if system_of(overrides) == "hf" else BASE
    profile = calibrated_profile(base, sets, nproc, folder, str(comm))
    run = validate_one(
        base, overrides, nproc=nproc, steps=steps, warmup=warmup, profile=profile, timeout_s=1800
    )
    return run.comparison


def run_matrix(
    *,
    out: str,
    steps: int,
    warmup: int,
    nproc: int,
    rounds: int = ROUNDS,
    systems: set[str] | None = None,
) -> list[tuple[str, Comparison]]:
    """Every configuration of MATRIX for real on ``nproc`` ranks in ``rounds`` interleaved rounds,
    then MEMORY_MATRIX in fake mode; ``out`` is rewritten after each run, so a stopped run keeps
    what it has. With ``systems`` only their rows run, and they are written between markers in
    ``out`` (``<!-- matrix:fsdp1,deepspeed:begin -->``), the rest of the file kept."""
    from validation.memory_only import validate_memory_only

    matrix, memory_matrix = _selected(MATRIX, systems), _selected(MEMORY_MATRIX, systems)
    runs: list[list[Comparison]] = [[] for _ in matrix]
    results: list[tuple[str, Comparison]] = []
    memory: list[tuple[str, Comparison]] = []
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fsdpsim-matrix-") as tmp:
        for rnd in range(rounds):
            comm = Path(tmp) / f"comm{rnd}.json"
            calibrate_collectives(comm, nproc)
            for i, (name, overrides) in enumerate(matrix):
                print(f"[round {rnd + 1}/{rounds}, {i + 1}/{len(matrix)}] {name}", flush=True)
                folder = Path(tmp) / f"round{rnd}-config{i}"
                loads.append(os.getloadavg()[0])  # a shared host: how loaded it was, next to the figures
                runs[i].append(_run_config(overrides, folder, comm, steps=steps, warmup=warmup, nproc=nproc))
                results = [(matrix[j][0], median_comparison(r)) for j, r in enumerate(runs) if r]
                _write(
                    out, systems, _document(results, memory, steps, warmup, nproc, rnd + 1, systems, loads)
                )
    for i, (name, overrides) in enumerate(memory_matrix):
        print(f"[memory {i + 1}/{len(memory_matrix)}] {name}", flush=True)
        comparison, _ = validate_memory_only(MEMORY_BASE, overrides, timeout_s=1800)
        memory.append((name, comparison))
        _write(out, systems, _document(results, memory, steps, warmup, nproc, rounds, systems, loads))
    return results


def _write(out: str, systems: set[str] | None, document: str) -> None:
    if systems is None:
        write_text_atomic(out, document)
    else:
        write_between_markers(out, "matrix:" + ",".join(sorted(systems)), document)


def _memory_summary(memory: list[tuple[str, Comparison]]) -> list[str]:
    lines = [
        "| configuration | predicted peak | measured peak | error | largest category error (> 1 % of peak) |",
        "|---|---|---|---|---|",
    ]
    for name, c in memory:
        peak = c.rows[0]
        big = [r for r in c.rows[1:] if r.measured > 0.01 * peak.measured and r.error is not None]
        worst = max(big, key=lambda r: abs(r.error or 0.0))
        lines.append(
            f"| {name} | {peak.predicted / 2**30:.2f} GiB | {peak.measured / 2**30:.2f} GiB | {peak.error:+.1%} | "
            f"{worst.metric.strip()} {worst.error:+.1%} |"
        )
    errors = [abs(c.rows[0].error or 0.0) for _, c in memory]
    return [
        *lines,
        "",
        f"Peak memory: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}.",
    ]


def _load(loads: list[float]) -> list[str]:
    if not loads:
        return []
    return [
        f"- load: the 1-minute load average (`uptime`) as each configuration's calibration and run started: "
        f"min {min(loads):.2f}, median {statistics.median(loads):.2f}, max {max(loads):.2f} on "
        f"{os.cpu_count()} cores (the host is shared: step times are noisy)"
    ]


def _bases(systems: set[str] | None) -> str:
    if systems == {"hf"}:
        return f"base `{HF_BASE}`"
    return f"base `{BASE}`" + (f", the hf rows `{HF_BASE}`" if systems is None or "hf" in systems else "")


def _document(
    results: list[tuple[str, Comparison]],
    memory: list[tuple[str, Comparison]],
    steps: int,
    warmup: int,
    nproc: int,
    rounds: int,
    systems: set[str] | None = None,
    loads: list[float] | None = None,
) -> str:
    title = "# Validation: fsdp-sim against real FSDP2 runs"
    if systems is not None:
        title = f"## {', '.join(sorted(systems))} against the real systems (`make validate SYSTEMS=...`)"
    h = "##" if systems is None else "###"
    text = [
        title,
        "",
        *_machine(nproc),
        *_load(loads or []),
        "",
        f"`make validate` ({steps} timed steps after {warmup} warm-up, {nproc} ranks; {_bases(systems)}). "
        f"{rounds} interleaved round(s): each recalibrates the collectives, then calibrates every configuration's "
        "compute for its own dimensions and runs it for real right after. Every figure below is the median "
        "over rounds (the min and max of a measured step are over all rounds).",
        "",
        f"{h} Summary",
        "",
        *_summary(results),
        "",
    ]
    if memory:
        text += [
            f"{h} Memory at scale (`fsdpsim validate --memory-only`)",
            "",
            "One rank of the real FSDP2 (FSDP1) step at the preset's world size (fake process group, "
            "FakeTensorMode, FSDPMemTracker; FSDP1: the storage-level tracker validation.step_memory), "
            f"base `{MEMORY_BASE}` (micro-batch 2 x 4096; 70B: micro-batch 1), against the "
            "simulator with the attention kernel that ran. Categories are at each side's own peak.",
            "",
            *_memory_summary(memory),
            "",
        ]
    text += [f"{h} Every configuration", ""]
    for name, comparison in [*results, *memory]:
        text += [format_markdown(name, comparison), ""]
    return "\n".join(text)
