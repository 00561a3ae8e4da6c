"""The validation matrix behind ``make validate``: configurations run for real and simulated,
summarised in VALIDATION.md with the machine, versions, every prediction, measurement and error."""

import datetime
import platform
import statistics
import tempfile
from pathlib import Path

from sim.io import write_text_atomic
from validation.compare import Comparison, format_markdown

BASE = "scenarios/validate-cpu.toml"

# (name, overrides): strategies, wrap policies, checkpointing, prefetch, dtypes, two model sizes
MATRIX: list[tuple[str, list[str]]] = [
    ("5m FULL_SHARD block fp32", []),
    ("5m SHARD_GRAD_OP block fp32", ["parallel.strategy=SHARD_GRAD_OP"]),
    ("5m NO_SHARD (DDP) fp32", ["parallel.strategy=NO_SHARD"]),
    ("5m FULL_SHARD model fp32", ["parallel.wrap=model"]),
    ("5m FULL_SHARD block fp32 checkpointing", ["checkpointing.mode=full"]),
    ("5m FULL_SHARD block fp32 forward prefetch 1", ["parallel.forward_prefetch=1"]),
    ("5m FULL_SHARD block bf16", ["precision.param_dtype=bf16"]),
    ("34m FULL_SHARD block fp32", ["model.preset=llama-34m"]),
    (
        "34m FULL_SHARD block bf16 checkpointing",
        ["model.preset=llama-34m", "precision.param_dtype=bf16", "checkpointing.mode=full"],
    ),  # fmt: skip
]


def _machine() -> list[str]:
    import torch

    from calibrate.device_probe import cpu_model

    return [
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {cpu_model()}, {torch.get_num_threads()} torch threads per rank, {platform.system()}",
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


def run_matrix(*, out: str, steps: int, warmup: int, nproc: int) -> list[tuple[str, Comparison]]:
    from calibrate.cli import main as calibrate_main
    from sim.errors import UserError
    from validation.cli import calibrated_profile, validate_one

    results = []
    with tempfile.TemporaryDirectory(prefix="fsdpsim-matrix-") as tmp:
        comm = Path(tmp) / "comm.json"
        if calibrate_main(["comm", "--nproc", str(nproc), "--out", str(comm), "--max-bytes", "16M"]) != 0:
            raise UserError("calibrating the collectives failed")
        for i, (name, overrides) in enumerate(MATRIX):
            print(f"[{i + 1}/{len(MATRIX)}] {name}", flush=True)
            folder = Path(tmp) / f"config{i}"
            folder.mkdir()
            sets = [*overrides, f"parallel.world_size={nproc}"]
            profile = calibrated_profile(BASE, sets, nproc, folder, str(comm))
            _, comparison = validate_one(
                BASE, overrides, nproc=nproc, steps=steps, warmup=warmup, profile=profile, timeout_s=1800
            )
            results.append((name, comparison))
    text = ["# Validation: fsdp-sim against real FSDP2 runs", "", *_machine(), "",
            f"`make validate` ({steps} timed steps after {warmup} warm-up, {nproc} ranks; base `{BASE}`).", "",
            "## Summary", "", *_summary(results), "", "## Every configuration", ""]  # fmt: skip
    for name, comparison in results:
        text += [format_markdown(name, comparison), ""]
    write_text_atomic(out, "\n".join(text))
    return results
