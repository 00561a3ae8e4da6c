"""Branch-and-bound search over the tuner's candidates (``sim.study.tune.space``).

Every candidate gets its two bounds (``sim.study.tune.bounds``) first. Those whose memory lower bound
exceeds the limit cannot fit and are not simulated. The rest are simulated in order of their
step-time lower bound; once ``top`` fitting candidates are known, a candidate whose bound is
slower than the ``top``-th best cannot enter the list and is not simulated either (only without
compute jitter: with jitter a rank's compute may be shorter than the bound).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from sim.errors import UserError
from sim.hardware.schema import HardwareProfile
from sim.outputs.report import StepReport, build_report
from sim.scenario.sections import Scenario
from sim.simulate import build_step, compute_jitter, simulate
from sim.study.tune.bounds import memory_lower_bound_bytes, step_time_lower_bound_s
from sim.study.tune.space import Candidate, apply, candidates


class Status(StrEnum):
    PRUNED_MEMORY = "pruned_memory"  # memory lower bound above the limit: cannot fit
    PRUNED_TIME = "pruned_time"  # step-time lower bound slower than the top-th fitting candidate
    SIMULATED = "simulated"
    INVALID = "invalid"  # the scenario rejects it (e.g. a calibrated profile's fixed micro-batch)


@dataclass(frozen=True, kw_only=True)
class Evaluated:
    """One candidate, its bounds and, when simulated, its report."""

    candidate: Candidate
    status: Status
    memory_bound_bytes: int = 0
    time_bound_s: float = 0.0
    report: StepReport | None = None
    error: str | None = None

    @property
    def step_time_s(self) -> float:
        assert self.report is not None
        return self.report.step_time_s

    @property
    def required_bytes(self) -> int:
        """What the device must hold at the peak (what fitting is judged on; ``StepReport``)."""
        assert self.report is not None
        return self.report.required_bytes

    def fits(self, limit_bytes: float) -> bool:
        return self.report is not None and self.required_bytes <= limit_bytes

    def sort_key(self) -> tuple[float, int, Candidate]:
        """Fastest first; then the smaller peak; then the candidate's own order (deterministic)."""
        return (self.step_time_s, self.required_bytes, self.candidate)


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    limit_bytes: float
    evaluated: tuple[Evaluated, ...]  # in candidate order
    top: tuple[Evaluated, ...]  # fitting, fastest first

    def count(self, status: Status) -> int:
        return sum(e.status is status for e in self.evaluated)

    def fitting(self) -> list[Evaluated]:
        return sorted((e for e in self.evaluated if e.fits(self.limit_bytes)), key=Evaluated.sort_key)


def bound(base: Scenario, profile: HardwareProfile, c: Candidate, limit_bytes: float) -> Evaluated:
    """The candidate with its bounds; PRUNED_MEMORY when it cannot fit, INVALID when refused."""
    scenario = apply(base, c)
    try:
        step, _, _ = build_step(scenario, profile)
    except UserError as e:
        return Evaluated(candidate=c, status=Status.INVALID, error=str(e))
    memory = memory_lower_bound_bytes(step)
    status = Status.PRUNED_MEMORY if memory > limit_bytes else Status.SIMULATED
    return Evaluated(
        candidate=c,
        status=status,
        memory_bound_bytes=memory,
        time_bound_s=step_time_lower_bound_s(step),
    )


def run_candidate(base: Scenario, profile: HardwareProfile, e: Evaluated) -> Evaluated:
    """Simulate ``e``'s candidate; its report is the same as ``fsdpsim run`` with its overrides."""
    report = build_report(simulate(apply(base, e.candidate), profile))
    return Evaluated(
        candidate=e.candidate,
        status=Status.SIMULATED,
        memory_bound_bytes=e.memory_bound_bytes,
        time_bound_s=e.time_bound_s,
        report=report,
    )


def same_but_prefetch(a: Evaluated, b: Evaluated) -> bool:
    """True when ``a`` only differs from ``b`` in prefetch and gains nothing by it (same step time
    to 1e-9, no smaller peak): the top list shows such variants once."""
    ca, cb = a.candidate, b.candidate
    if replace(ca, forward_prefetch=0, backward_prefetch=0) != replace(
        cb, forward_prefetch=0, backward_prefetch=0
    ):
        return False
    return abs(a.step_time_s - b.step_time_s) <= 1e-9 * b.step_time_s and a.required_bytes >= b.required_bytes


def search(
    base: Scenario,
    profile: HardwareProfile,
    global_sequences: int,
    limit_bytes: float,
    top: int,
    *,
    prune: bool = True,
) -> SearchResult:
    """Simulate what may fit and may be among the ``top`` fastest; bound the rest.

    ``prune=False`` simulates every valid candidate (the brute force the tests compare with).
    """
    bounded = [bound(base, profile, c, limit_bytes) for c in candidates(base, global_sequences)]
    time_pruning = prune and compute_jitter(base, profile) == 0.0
    done: dict[Candidate, Evaluated] = {}
    best: list[Evaluated] = []
    todo = [
        e for e in bounded if e.status is Status.SIMULATED or (not prune and e.status is Status.PRUNED_MEMORY)
    ]
    for e in sorted(todo, key=lambda e: (e.time_bound_s, e.candidate)):
        if time_pruning and len(best) >= top and e.time_bound_s > best[top - 1].step_time_s:
            done[e.candidate] = Evaluated(
                candidate=e.candidate,
                status=Status.PRUNED_TIME,
                memory_bound_bytes=e.memory_bound_bytes,
                time_bound_s=e.time_bound_s,
            )
            continue
        result = run_candidate(base, profile, e)
        done[e.candidate] = result
        if result.fits(limit_bytes) and not any(same_but_prefetch(result, b) for b in best):
            best = sorted([*best, result], key=Evaluated.sort_key)[:top]
    evaluated = tuple(done.get(e.candidate, e) for e in bounded)
    return SearchResult(limit_bytes=limit_bytes, evaluated=evaluated, top=tuple(best))


def lowest_memory(
    base: Scenario, profile: HardwareProfile, bounded: Sequence[Evaluated], n: int
) -> list[Evaluated]:
    """Simulate the ``n`` valid candidates with the smallest memory lower bound (smallest first)."""
    valid = [e for e in bounded if e.status is not Status.INVALID]
    chosen = sorted(valid, key=lambda e: (e.memory_bound_bytes, e.time_bound_s, e.candidate))[:n]
    return [run_candidate(base, profile, e) for e in chosen]
