"""VALIDATION.md's text for the validation matrix: the machine, the summaries and every row.

Split from ``validation.matrix``, which calls ``document`` after each run with the results
so far, so that a stopped run leaves a complete document of what it has. Pure text from the
comparisons (``validation.compare``), apart from the date, the machine and the library versions
it reads.
"""

import datetime
import os
import platform
import statistics

from validation.compare import Comparison, format_markdown
from validation.matrix_rows import BASE, HF_BASE, MEMORY_BASE


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


def document(
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
