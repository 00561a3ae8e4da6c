"""The README's answers, recomputed: every figure of "Scenarios and their answers" and of the
``fsdpsim sweep`` and ``fsdpsim tune`` examples, from the simulator's Python API, as the README's
markdown (memory in GiB, times in ms).

    python -m bench.answers            # print the generated text
    python -m bench.answers --write    # rewrite it in README.md, between the answers markers

The README holds the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` for each
NAME of ``BLOCKS``; ``tests/test_readme_answers.py`` fails when the two differ. Sentences that
interpret the figures ("... fits", "... costs almost nothing") are checked with ``claim``: when a
change to the cost model makes one false, generation stops and names it, so that it is rewritten
where it is written instead of left wrong in the README. The seed documents' own figures are
quoted as they give them, in GB (10^9 B).

This module assembles the blocks and reads and writes the README; the paragraphs come from
``bench.answers_seeds``, ``answers_node``, ``answers_workloads`` and ``answers_ranks`` (the
scenarios block), ``answers_tools`` (sweep and tune), ``answers_offload`` (offload) and
``answers_validation`` (the CPU validation figures, read from VALIDATION.md).
"""

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from bench.answer_kit import README, para
from bench.answers_node import node_strategies, wrap_granularity
from bench.answers_offload import offload_section
from bench.answers_ranks import scale_out, slow_rank
from bench.answers_seeds import seed_checkpointing, seed_model_state
from bench.answers_tools import sweep_example, tune_example
from bench.answers_validation import cpu_validation
from bench.answers_workloads import packing, sft_vs_grpo
from sim.fileio import write_text_atomic
from validation.marked_sections import section_span

# ---- "Scenarios and their answers" ----


def intro() -> str:
    return para(
        """Figures from `fsdpsim run` on the datasheet profiles (not calibrated), memory in GiB and
        times in ms; the seed documents' own figures are quoted as they give them, in GB (10⁹ B).
        `python -m bench.answers --write` regenerates them; the commands shown give each one."""
    )


SECTIONS: tuple[Callable[[], str], ...] = (
    intro,
    seed_model_state,
    seed_checkpointing,
    node_strategies,
    sft_vs_grpo,
    packing,
    wrap_granularity,
    scale_out,
    slow_rank,
)


def scenarios_section() -> str:
    return "\n\n".join(section() for section in SECTIONS)


# ---- the README ----


BLOCKS: dict[str, Callable[[], str]] = {
    "answers": scenarios_section,  # README "## Scenarios and their answers"
    "answers:sweep": sweep_example,  # README "fsdpsim sweep": the scenarios/sweep-7b-strategies.toml example
    "answers:tune": tune_example,  # README "fsdpsim tune": the examples
    "answers:offload": offload_section,  # README "FSDP2's CPU offload": the QLoRA recipe and the sweep
    "answers:validation": cpu_validation,  # README "Validation": VALIDATION.md's FSDP2 matrix run
}
"""Each README marker name and the function that writes the text between its markers."""


def generate() -> dict[str, str]:
    """The text between each pair of README markers, by marker name."""
    return {name: block() for name, block in BLOCKS.items()}


def between(text: str, name: str) -> str:
    start, stop = section_span(text, name, README.name)
    return text[start:stop]


def splice(text: str, blocks: dict[str, str]) -> str:
    for name, body in blocks.items():
        start, stop = section_span(text, name, README.name)
        text = text[:start] + body + text[stop:]
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.answers", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write", action="store_true", help="rewrite the text between the markers in README.md"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    blocks = generate()
    elapsed = time.perf_counter() - start
    if not args.write:
        for name, body in blocks.items():
            print(f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->\n")
    else:
        old = README.read_text()
        new = splice(old, blocks)
        if new == old:
            print(f"{README.name}: up to date")
        else:
            write_text_atomic(README, new)
            changed = [name for name, body in blocks.items() if between(old, name) != body]
            print(f"{README.name}: rewrote {', '.join(changed)}")
    print(f"generated in {elapsed:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
