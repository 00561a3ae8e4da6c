"""The tuner's search space: which FSDP configurations of one scenario ``fsdpsim tune`` considers.

A *candidate* fixes the knobs the tuner may turn without changing the training itself: sharding
strategy, wrap policy, micro-batch (with gradient accumulation keeping the global batch),
activation checkpointing and prefetch. Model, sequence length, precision, optimizer, hardware and
ranks stay as in the scenario; changing those is a *change* the tuner only suggests
(``sim.study.tune.fix``).
"""

from collections.abc import Iterator
from dataclasses import dataclass, replace

from sim.errors import UserError
from sim.scenario.sections import Scenario
from sim.workload.options import CheckpointMode, Strategy, WrapPolicy

FORWARD_PREFETCH = (0, 1)  # 0: FSDP2's implicit overlap only; 1: set_modules_to_forward_prefetch
BACKWARD_PREFETCH = (1, 2)  # 1: FSDP2's implicit default


@dataclass(frozen=True, kw_only=True, order=True)
class Candidate:
    """One configuration; fields order the candidates deterministically (the tie-break)."""

    strategy: Strategy
    wrap: WrapPolicy
    micro_batch: int
    grad_accum: int
    checkpointing: CheckpointMode
    forward_prefetch: int
    backward_prefetch: int
    shard_group_size: int | None = None  # HYBRID_SHARD only

    def overrides(self) -> tuple[str, ...]:
        """``--set`` arguments that turn the scenario file into this candidate."""
        sets = [
            f"parallel.strategy={self.strategy.value}",
            f"parallel.wrap={self.wrap.value}",
            f"training.micro_batch={self.micro_batch}",
            f"training.grad_accum={self.grad_accum}",
            f"checkpointing.mode={self.checkpointing.value}",
            f"parallel.forward_prefetch={self.forward_prefetch}",
            f"parallel.backward_prefetch={self.backward_prefetch}",
        ]
        if self.shard_group_size is not None:
            sets.append(f"parallel.shard_group_size={self.shard_group_size}")
        return tuple(sets)

    def label(self) -> str:
        """Short human label, e.g. ``FULL_SHARD block mb 2x4 ckpt pf 0/1``."""
        strategy = self.strategy.value
        if self.shard_group_size is not None:
            strategy += f"({self.shard_group_size})"
        ckpt = " ckpt" if self.checkpointing is CheckpointMode.FULL else ""
        return (
            f"{strategy} {self.wrap.value} mb {self.micro_batch}x{self.grad_accum}{ckpt} "
            f"pf {self.forward_prefetch}/{self.backward_prefetch}"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "strategy": self.strategy.value,
            "wrap": self.wrap.value,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "checkpointing": self.checkpointing.value,
            "forward_prefetch": self.forward_prefetch,
            "backward_prefetch": self.backward_prefetch,
            "shard_group_size": self.shard_group_size,
        }


def global_batch(scenario: Scenario) -> int:
    """Sequences per optimizer step: micro-batch x accumulation x data-parallel ranks."""
    t = scenario.training
    return t.micro_batch * t.grad_accum * scenario.parallel.world_size


def per_rank_batch(scenario: Scenario, global_sequences: int) -> int:
    """Sequences each rank processes per step; a UserError when ranks do not divide the batch."""
    k = scenario.parallel.world_size
    if global_sequences <= 0 or global_sequences % k:
        raise UserError(
            f"--global-batch {global_sequences}: must be a positive multiple of parallel.world_size ({k})"
        )
    return global_sequences // k


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strategies(scenario: Scenario) -> list[tuple[Strategy, int | None]]:
    """Each strategy with its shard group: HYBRID_SHARD shards within a node, and only when the
    ranks span more than one node (otherwise it is FULL_SHARD)."""
    k, node = scenario.parallel.world_size, scenario.gpus_per_node
    found: list[tuple[Strategy, int | None]] = [
        (Strategy.NO_SHARD, None),
        (Strategy.SHARD_GRAD_OP, None),
        (Strategy.FULL_SHARD, None),
    ]
    if k > node and k % node == 0:
        found.append((Strategy.HYBRID_SHARD, node))
    return found


# the wrap policies the tuner searches (FSDP2's); PEFT's is FSDP1's, for LoRA only
TUNED_WRAPS = (WrapPolicy.MODEL, WrapPolicy.BLOCK, WrapPolicy.LINEAR)


def candidates(scenario: Scenario, global_sequences: int) -> list[Candidate]:
    """Every candidate, deduplicated: DDP has no wrap units or prefetch, one unit has nothing to
    prefetch, so those get a single wrap / prefetch value."""
    per_rank = per_rank_batch(scenario, global_sequences)
    return sorted(set(_generate(scenario, per_rank)))


def _generate(scenario: Scenario, per_rank: int) -> Iterator[Candidate]:
    for strategy, group in strategies(scenario):
        ddp = strategy is Strategy.NO_SHARD
        for wrap in [WrapPolicy.BLOCK] if ddp else TUNED_WRAPS:
            single = ddp or wrap is WrapPolicy.MODEL
            for mb in divisors(per_rank):
                for ckpt in CheckpointMode:
                    for fwd in (0,) if single else FORWARD_PREFETCH:
                        for bwd in (1,) if single else BACKWARD_PREFETCH:
                            yield Candidate(
                                strategy=strategy,
                                wrap=wrap,
                                micro_batch=mb,
                                grad_accum=per_rank // mb,
                                checkpointing=ckpt,
                                forward_prefetch=fwd,
                                backward_prefetch=bwd,
                                shard_group_size=group,
                            )


def apply(scenario: Scenario, c: Candidate) -> Scenario:
    """``scenario`` configured as ``c`` (the same as ``--set c.overrides()`` on its file)."""
    return replace(
        scenario,
        training=replace(scenario.training, micro_batch=c.micro_batch, grad_accum=c.grad_accum),
        parallel=replace(
            scenario.parallel,
            strategy=c.strategy,
            wrap=c.wrap,
            shard_group_size=c.shard_group_size,
            forward_prefetch=c.forward_prefetch,
            backward_prefetch=c.backward_prefetch,
        ),
        checkpointing=replace(scenario.checkpointing, mode=c.checkpointing),
    )


def as_candidate(scenario: Scenario) -> Candidate:
    """The scenario's own configuration as a candidate (the baseline the tuner compares with)."""
    p, t = scenario.parallel, scenario.training
    hybrid = p.strategy is Strategy.HYBRID_SHARD
    return Candidate(
        strategy=p.strategy,
        wrap=p.wrap,
        micro_batch=t.micro_batch,
        grad_accum=t.grad_accum,
        checkpointing=scenario.checkpointing.mode,
        forward_prefetch=p.forward_prefetch,
        backward_prefetch=p.backward_prefetch,
        shard_group_size=scenario.shard_group_size if hybrid else None,
    )
