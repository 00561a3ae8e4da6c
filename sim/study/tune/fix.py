"""When no configuration fits: the cheapest change to the scenario that makes one fit.

The changes lie outside the tuner's search space (which never changes the training or the
hardware). They are tried in order of cost, each by simulating the configurations with the
smallest memory lower bound under it (``sim.tune_search.lowest_memory``); a change is proven
hopeless, without simulating, when every configuration's lower bound is above the limit:
1. numerics: bf16 parameters and activations (FSDP2 keeps fp32 master weights either way);
2. hardware: 2x, 4x, 8x, 16x the ranks (the global batch kept where the ranks divide it);
3. the training recipe: SGD with momentum instead of AdamW, half the sequence length.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sim.errors import UserError
from sim.hardware.registry import load_profile
from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from sim.study.tune.search import Evaluated, bound, lowest_memory
from sim.study.tune.space import candidates
from sim.workload.options import OptimizerName

RANK_FACTORS = (2, 4, 8, 16)
SIMULATED_PER_CHANGE = 4


@dataclass(frozen=True, kw_only=True)
class Change:
    what: str
    cost: str
    overrides: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ChangeResult:
    change: Change
    fits: bool
    global_batch: int
    best: Evaluated | None  # the fastest fitting simulated configuration, else the smallest peak
    memory_bound_bytes: int  # smallest memory lower bound over the configurations
    error: str | None = None

    @property
    def overrides(self) -> tuple[str, ...]:
        """The change and the configuration: ``fsdpsim run FILE --set ...`` reproduces ``best``."""
        extra = self.best.candidate.overrides() if self.best else ()
        return (*self.change.overrides, *extra)


def candidate_changes(base: Scenario) -> list[Change]:
    """The changes worth trying for ``base``, cheapest first."""
    changes = []
    if base.param_dtype == "fp32":
        changes.append(
            Change(what="bf16 parameters", cost="numerics", overrides=("precision.param_dtype=bf16",))
        )
    k = base.parallel.world_size
    for factor in RANK_FACTORS:
        changes.append(
            Change(
                what=f"{factor}x the ranks ({k * factor})",
                cost=f"{factor}x the GPUs",
                overrides=(f"parallel.world_size={k * factor}",),
            )
        )
    if base.optimizer.name is OptimizerName.ADAMW:
        changes.append(
            Change(what="SGD with momentum", cost="training recipe", overrides=("optimizer.name=sgd",))
        )
    t = base.training
    if t.seq_len >= 2:
        half = t.seq_len // 2
        sets = [f"training.seq_len={half}"]
        for name in ("avg_seq_len", "avg_doc_len"):  # neither may exceed the halved rows
            avg = getattr(t, name)
            if avg is not None and avg > half:
                sets.append(f"training.{name}={half}")
        changes.append(Change(what=f"sequence length {half}", cost="training recipe", overrides=tuple(sets)))
    return changes


def scaled_global_batch(changed: Scenario, global_sequences: int) -> int:
    """The global batch on the changed ranks: kept when they divide it, else the nearest multiple
    below (at least one sequence per rank)."""
    k = changed.parallel.world_size
    return max(1, global_sequences // k) * k


def evaluate_change(
    path: str | Path, user_sets: Sequence[str], change: Change, global_sequences: int, margin: float
) -> ChangeResult:
    """Simulate the smallest-memory configurations of the scenario with ``change`` applied."""
    try:
        changed = load_scenario(path, [*user_sets, *change.overrides])
    except UserError as e:
        return ChangeResult(
            change=change, fits=False, global_batch=0, best=None, memory_bound_bytes=0, error=str(e)
        )
    profile = load_profile(changed.cluster.profile, where=f"{changed.source}: cluster.profile")
    limit = profile.device.memory_bytes * (1.0 - margin)
    g = scaled_global_batch(changed, global_sequences)
    bounded = [bound(changed, profile, c, limit) for c in candidates(changed, g)]
    valid = [e for e in bounded if e.error is None]
    if not valid:
        return ChangeResult(
            change=change,
            fits=False,
            global_batch=g,
            best=None,
            memory_bound_bytes=0,
            error=bounded[0].error if bounded else "no configuration",
        )
    smallest = min(e.memory_bound_bytes for e in valid)
    if smallest > limit:  # proven: nothing fits, no simulation needed
        return ChangeResult(change=change, fits=False, global_batch=g, best=None, memory_bound_bytes=smallest)
    simulated = lowest_memory(changed, profile, valid, SIMULATED_PER_CHANGE)
    fitting = sorted((e for e in simulated if e.fits(limit)), key=Evaluated.sort_key)
    best = fitting[0] if fitting else min(simulated, key=lambda e: (e.required_bytes, e.candidate))
    return ChangeResult(
        change=change, fits=bool(fitting), global_batch=g, best=best, memory_bound_bytes=smallest
    )


def suggest(
    path: str | Path, user_sets: Sequence[str], base: Scenario, global_sequences: int, margin: float
) -> list[ChangeResult]:
    """Every candidate change for ``base`` (the file with ``user_sets``) with its outcome, cheapest
    first. Each change is applied to the file as ``--set`` overrides, as a user would."""
    return [
        evaluate_change(path, user_sets, change, global_sequences, margin)
        for change in candidate_changes(base)
    ]


def cheapest(results: Sequence[ChangeResult]) -> ChangeResult | None:
    return next((r for r in results if r.fits), None)
