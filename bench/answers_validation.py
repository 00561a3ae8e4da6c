"""The README's CPU validation figures, read from the run VALIDATION.md holds (``make validate``
writes its FSDP2 matrix between the ``matrix:fsdp2`` markers), so that the README quotes that run
and no other: its date and rounds, each configuration's errors, the medians and worsts against
the targets, and the memory-at-scale summary."""

import re

from bench.answer_kit import ROOT, para, table
from validation.marked_sections import section_span

VALIDATION = ROOT / "VALIDATION.md"
# the targets of the validation matrix (step time, then peak memory: median |error|, worst)
STEP_TARGETS = (0.10, 0.20)
MEMORY_TARGETS = (0.02, 0.05)
_SUMMARY = re.compile(r"median \|error\| (-?[\d.]+)%, worst (-?[\d.]+)%")


def fsdp2_matrix_section() -> str:
    """The text VALIDATION.md holds between the FSDP2 matrix's markers (`make validate` writes it)."""
    text = VALIDATION.read_text()
    start, stop = section_span(text, "matrix:fsdp2", VALIDATION.name)
    return text[start:stop]


def _after(section: str, heading: str) -> list[str]:
    """The lines of ``section`` after ``heading`` up to the next heading."""
    lines = section.splitlines()
    start = lines.index(heading) + 1
    stop = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
    return lines[start:stop]


def _rows(lines: list[str]) -> list[list[str]]:
    """A Markdown table's body cells (header and rule left out)."""
    cells = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")
    ]
    return cells[2:]


def _summary(lines: list[str], label: str) -> tuple[float, float]:
    """(median, worst) |error| of the line ``label: median |error| X%, worst Y%``, as fractions."""
    line = next(line for line in lines if label in line)
    found = _SUMMARY.search(line[line.index(label) :])
    if found is None:
        raise ValueError(f"{VALIDATION.name}: no '{label}: median |error| X%, worst Y%' line")
    return float(found.group(1)) / 100, float(found.group(2)) / 100


def _signed(cell: str) -> str:
    """``-2.1%`` as the README writes it: ``−2.1 %``."""
    return cell.replace("-", "−").replace("%", " %")


def _against(figures: tuple[float, float], targets: tuple[float, float]) -> str:
    median, worst = figures
    met = median <= targets[0] and worst <= targets[1]
    return (
        f"median |error| {median * 100:.1f} %, worst {worst * 100:.1f} % (target ≤ {targets[0] * 100:.0f} % / "
        f"≤ {targets[1] * 100:.0f} %: {'met' if met else 'NOT met'})"
    )


def cpu_validation() -> str:
    section = fsdp2_matrix_section()
    date = re.search(r"^- date: (\S+)", section, re.MULTILINE)
    rounds = re.search(r"(\d+) interleaved round", section)
    if date is None or rounds is None:
        raise ValueError(f"{VALIDATION.name}: the FSDP2 matrix section names no date or rounds")
    summary = _after(section, "### Summary")
    rows = _rows(summary)
    matched = [r for r in rows if r[3] == "yes"]
    scale = _after(section, "### Memory at scale (`fsdpsim validate --memory-only`)")
    collectives = (
        "Every collective's count and bytes match exactly."
        if len(matched) == len(rows)
        else f"The collectives of {len(rows) - len(matched)} configurations do not match."
    )
    scale_median, scale_worst = _summary(scale, "Peak memory")
    figures = para(
        f"""**Step time**: {_against(_summary(summary, "Step time"), STEP_TARGETS)}. **Peak memory**:
        {_against(_summary(summary, "Peak memory"), MEMORY_TARGETS)}. {collectives} **Memory at scale**
        (`--memory-only`, one real FSDP2 rank in fake mode at the preset's world size, every row in
        `VALIDATION.md`): median |error| {scale_median * 100:.1f} %, worst
        {scale_worst * 100:.1f} % over {len(_rows(scale))} configurations."""
    )
    return "\n\n".join(
        (
            para(f"The run `VALIDATION.md` holds ({date.group(1)}, {rounds.group(1)} rounds):"),
            table(
                ("configuration", "step time error", "peak memory error", "collectives"),
                [(r[0], _signed(r[1]), _signed(r[2]), "exact" if r[3] == "yes" else "differ") for r in rows],
            ),
            figures,
        )
    )
