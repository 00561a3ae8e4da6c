"""The tuner: the fastest FSDP configuration of a scenario that fits in device memory.

It searches strategy, wrap policy, micro-batch (with gradient accumulation keeping the global
batch), activation checkpointing and prefetch (``sim.study.tune.space``), prunes with memory and
step-time lower bounds before simulating (``sim.study.tune.bounds``, ``sim.study.tune.search``), prints the
top configurations with why each wins (``sim.study.tune.report``) and, when nothing fits, the cheapest
change that makes it fit, found by simulation (``sim.study.tune.fix``). CPU offload is not modelled by
the simulator and is not searched. User mistakes raise ``UserError`` (exit code 2).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sim.errors import UserError
from sim.hardware.registry import load_profile
from sim.hardware.schema import HardwareProfile
from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from sim.study.tune.fix import ChangeResult, suggest
from sim.study.tune.search import Evaluated, SearchResult, Status, bound, lowest_memory, run_candidate, search
from sim.study.tune.space import as_candidate, candidates, global_batch

NOTES = ("CPU offload (FSDP2 CPUOffloadPolicy) is not modelled by the simulator, so it is not searched.",)


@dataclass(frozen=True, kw_only=True)
class TuneOutcome:
    path: str
    user_sets: tuple[str, ...]
    scenario: Scenario
    profile: HardwareProfile
    global_batch: int
    margin: float
    limit_bytes: float
    result: SearchResult
    baseline: Evaluated
    closest: Evaluated | None = None  # nothing fits: the smallest simulated peak
    changes: tuple[ChangeResult, ...] = ()
    notes: tuple[str, ...] = field(default=NOTES)


def check_settings(margin: float, top: int) -> None:
    if not 0.0 <= margin < 1.0:
        raise UserError(f"--margin {margin}: must be in [0, 1), e.g. 0.1 for 10 %")
    if top < 1:
        raise UserError(f"--top {top}: must be >= 1")


def simulate_baseline(scenario: Scenario, profile: HardwareProfile, limit_bytes: float) -> Evaluated:
    """The file's own configuration, simulated as ``fsdpsim run`` would."""
    e = bound(scenario, profile, as_candidate(scenario), limit_bytes)
    if e.status is Status.INVALID:
        raise UserError(e.error or f"{scenario.source}: cannot be simulated")
    return run_candidate(scenario, profile, e)


def closest_config(
    result: SearchResult, scenario: Scenario, profile: HardwareProfile, g: int
) -> Evaluated | None:
    """The simulated configuration with the smallest peak (one is simulated if none was)."""
    simulated = [e for e in result.evaluated if e.report is not None]
    if not simulated:
        bounded = [bound(scenario, profile, c, result.limit_bytes) for c in candidates(scenario, g)]
        simulated = lowest_memory(scenario, profile, bounded, 1)
    return min(simulated, key=lambda e: (e.required_bytes, e.candidate)) if simulated else None


def tune(
    path: str,
    user_sets: Sequence[str] = (),
    *,
    margin: float = 0.1,
    top: int = 5,
    global_sequences: int | None = None,
) -> TuneOutcome:
    """Search the scenario at ``path`` (with ``--set`` overrides); the whole answer, deterministic."""
    check_settings(margin, top)
    scenario = load_scenario(path, user_sets)
    if scenario.parallel.fsdp_version != 2 or scenario.deepspeed.enabled:
        raise UserError(
            f"{path}: fsdpsim tune searches FSDP2's space (its bounds are FSDP2's); compare FSDP1 and "
            "DeepSpeed with fsdpsim sweep (e.g. scenarios/sweep-systems-7b.toml)"
        )
    profile = load_profile(scenario.cluster.profile, where=f"{scenario.source}: cluster.profile")
    g = global_batch(scenario) if global_sequences is None else global_sequences
    limit = profile.device.memory_bytes * (1.0 - margin)
    result = search(scenario, profile, g, limit, top)
    outcome = TuneOutcome(
        path=str(path),
        user_sets=tuple(user_sets),
        scenario=scenario,
        profile=profile,
        global_batch=g,
        margin=margin,
        limit_bytes=limit,
        result=result,
        baseline=simulate_baseline(scenario, profile, limit),
    )
    if result.top:
        return outcome
    return replace(
        outcome,
        closest=closest_config(result, scenario, profile, g),
        changes=tuple(suggest(path, user_sets, scenario, g, margin)),
    )
