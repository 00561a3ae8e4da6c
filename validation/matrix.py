"""The validation matrix behind ``make validate``: configurations run for real and simulated,
summarised in VALIDATION.md with the machine, versions, every prediction, measurement and error.

A shared host drifts by more than a configuration's error over minutes, so the matrix runs in
``ROUNDS`` interleaved rounds: each round recalibrates the collectives, then for every
configuration calibrates its compute and runs it for real right after. Every figure is the
median over rounds, of the predictions and of the measurements alike; each prediction uses only
calibrations taken before its own real run.

The rows live in ``validation.matrix_rows``, the document's text in ``validation.matrix_document``
and the marked-section writer in ``validation.marked_sections``; this module runs the rounds and
takes their medians."""

import os
import statistics
import tempfile
from pathlib import Path

from sim.fileio import write_text_atomic
from validation.compare import Comparison, Row
from validation.marked_sections import write_between_markers
from validation.matrix_document import document
from validation.matrix_rows import BASE, HF_BASE, MATRIX, MEMORY_BASE, MEMORY_MATRIX, selected_rows, system_of
from validation.run import calibrate_collectives, calibrated_profile, validate_one

ROUNDS = 3


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

    matrix, memory_matrix = selected_rows(MATRIX, systems), selected_rows(MEMORY_MATRIX, systems)
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
                _write(out, systems, document(results, memory, steps, warmup, nproc, rnd + 1, systems, loads))
    for i, (name, overrides) in enumerate(memory_matrix):
        print(f"[memory {i + 1}/{len(memory_matrix)}] {name}", flush=True)
        comparison, _ = validate_memory_only(MEMORY_BASE, overrides, timeout_s=1800)
        memory.append((name, comparison))
        _write(out, systems, document(results, memory, steps, warmup, nproc, rounds, systems, loads))
    return results


def _write(out: str, systems: set[str] | None, text: str) -> None:
    if systems is None:
        write_text_atomic(out, text)
    else:
        write_between_markers(out, "matrix:" + ",".join(sorted(systems)), text)
