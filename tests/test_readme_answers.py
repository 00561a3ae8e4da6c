"""README.md quotes the code's figures: the text between each pair of answers markers
(``<!-- answers:begin -->`` ... ``<!-- answers:end -->``, and the sweep and tune examples) is
exactly what ``bench/answers.py`` generates from the simulator, so the README cannot drift from
the code. After a change to the cost model: ``python -m bench.answers --write``."""

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not an installed package; plain `pytest` may not see it
    sys.path.insert(0, str(ROOT))
answers = importlib.import_module("bench.answers")


@pytest.mark.parametrize("name", list(answers.BLOCKS))
def test_readme_holds_the_generated_text(name: str) -> None:
    readme = answers.README.read_text()
    expected = answers.BLOCKS[name]()
    assert answers.between(readme, name) == expected, (
        f"README.md's {name} text differs from the simulator's figures: run python -m bench.answers --write"
    )


def test_splice_replaces_only_the_text_between_markers() -> None:
    text = "a\n<!-- answers:begin -->\nold\n<!-- answers:end -->\nb\n"
    new = answers.splice(text, {"answers": "new\ntext"})
    assert new == "a\n<!-- answers:begin -->\nnew\ntext\n<!-- answers:end -->\nb\n"
    assert answers.between(new, "answers") == "new\ntext"
    with pytest.raises(ValueError, match="exactly one"):
        answers.between(text + text, "answers")


def test_the_validation_figures_are_the_run_validation_md_holds() -> None:
    """The README's CPU validation table is VALIDATION.md's FSDP2 matrix summary, row for row, and
    a figure past its target is said to be so."""
    figures = importlib.import_module("bench.answers_validation")
    section = figures.fsdp2_matrix_section()
    held = figures._rows(figures._after(section, "### Summary"))
    shown = figures._rows(answers.between(answers.README.read_text(), "answers:validation").splitlines())
    assert [r[0] for r in shown] == [r[0] for r in held] and len(held) > 0
    assert figures._against((0.037, 0.084), (0.10, 0.20)).endswith(": met)")
    assert figures._against((0.12, 0.15), (0.10, 0.20)).endswith("NOT met)")
    assert figures._against((0.05, 0.25), (0.10, 0.20)).endswith("NOT met)")
