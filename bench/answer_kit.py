"""What the README's generated answers are made with (``bench.answers`` and its ``bench.answers_*``
modules): each scenario simulated once per process, the sentence checks
(``claim``: a README sentence that no longer holds stops generation) and the README's formatting
(times in ms, percentages, GiB cells, paragraphs wrapped at its width, tables)."""

import re
import textwrap
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from sim.core.events import OpKind
from sim.costs.one_collective import one_collective
from sim.hardware.registry import load_profile
from sim.outputs.display import gib, ms
from sim.outputs.report import StepReport, build_report
from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from sim.simulate import SimResult, scenario_network, simulate
from sim.workload.layer_op import LayerOp

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
WIDTH = 100  # the README's line width
NODE_7B = "scenarios/llama2-7b-8xh100-zero3.toml"  # one 8-GPU node (answers and the tune example)
SCALEOUT = "scenarios/scaleout-llama3-70b.toml"  # Llama 3 70B from 8 to 1,024 ranks (idem)


class ProseOutdated(RuntimeError):
    """A README sentence that interprets the figures no longer holds with them."""


def claim(holds: bool, sentence: str) -> None:
    """Stop when the README sentence ``sentence`` (or the part of it quoted) is false."""
    if not holds:
        raise ProseOutdated(
            f"no longer true with the current figures, rewrite it in the bench/answers_*.py module that writes it: {sentence!r}"
        )


# ---- simulations (each scenario and --set combination once per process) ----


@cache
def scenario(path: str, *sets: str) -> Scenario:
    return load_scenario(ROOT / path, sets)


@cache
def result(path: str, *sets: str) -> SimResult:
    return simulate(scenario(path, *sets))


@cache
def report(path: str, *sets: str) -> StepReport:
    return build_report(result(path, *sets))


def op_seconds(path: str, kind: OpKind, *sets: str) -> float:
    """Total time of ``kind`` ops on rank 0."""
    return sum(o.duration_s for o in result(path, *sets).events.ops_of(0) if o.kind is kind)


def layer_op(path: str, name: str) -> LayerOp:
    return next(o for o in result(path).layer_ops if o.name == name)


def collective_s(r: StepReport) -> float:
    return sum(t.time_s for t in r.collectives.values())


# ---- formatting ----


def t(seconds: float, digits: int = 1) -> str:
    return ms(seconds, digits)


def pct(x: float, digits: int = 1, sign: bool = False) -> str:
    """``9.5 %``, ``+9.5 %`` with ``sign``, ``−1.3 %`` (a minus sign) when negative."""
    text = f"{abs(x) * 100:.{digits}f} %"
    if x < 0 and float(text[:-2]) != 0:
        return "−" + text
    return "+" + text if sign else text


def n(x: float) -> str:
    return f"{x:,.0f}"


def peak_cell(r: StepReport, model_state: bool = False) -> str:
    """``58.99 GiB``; ``161.68 GiB (does not fit)``; with ``model_state``:
    ``164.27 GiB: does not fit (131.42 GiB model state)``."""
    if r.fits:
        return gib(r.peak_memory_bytes)
    if model_state:
        return f"{gib(r.peak_memory_bytes)}: does not fit ({gib(r.model_state.total)} model state)"
    return f"{gib(r.peak_memory_bytes)} (does not fit)"


_MARKDOWN_AT_LINE_START = re.compile(r"^([-+*]|\d+[.)])(\s|$)|^[#>|]")
_GLUE = "\x00"  # a space the wrapping must not break at
_NUMBER_UNIT = re.compile(r"(?<=\d) (?=(ms|GiB|GB/s|GB|B/param|B|%)(?![\w/]))")
_CODE = re.compile(r"`[^`]*`")


def para(text: str) -> str:
    """One paragraph wrapped at the README's width, never inside a code span or between a number
    and its unit (a wrapped line must not start like a list item or a heading)."""
    text = " ".join(text.split())
    text = _CODE.sub(lambda m: m.group().replace(" ", _GLUE), _NUMBER_UNIT.sub(_GLUE, text))
    lines = textwrap.wrap(text, WIDTH, break_long_words=False, break_on_hyphens=False)
    lines = [line.replace(_GLUE, " ") for line in lines]
    for line in lines[1:]:
        if _MARKDOWN_AT_LINE_START.match(line):
            raise ValueError(f"a wrapped line would start a markdown block: {line!r}")
    return "\n".join(lines)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def world_busbw(path: str, *sets: str) -> float:
    """NCCL's model's bus bandwidth of a 1 GiB all-gather over every rank of the scenario."""
    s = scenario(path, *sets)
    profile = load_profile(s.cluster.profile)
    network = scenario_network(s, profile)
    assert network is not None
    return one_collective("all_gather", 1 << 30, profile, network).busbw_Bps
