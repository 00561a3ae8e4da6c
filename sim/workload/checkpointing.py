"""Which blocks activation checkpointing wraps, and with which policy, as torchtitan applies it
(``torchtitan/models/llama3/infra/parallelize.py`` ``_apply_ac_to_transformer_block``).

- ``full``: every decoder block is a checkpoint region; only its input is kept.
- ``selective`` with ``"op"``: every block is a region under the op-level policy, which keeps the
  outputs of the matmuls but every second one, and of attention (``sim.workload.layers._sac_kept``).
- ``selective`` with N: every N-th block is a full region (torchtitan counts blocks from 1 and
  wraps those whose count is divisible by N); the others keep everything.
"""

from dataclasses import dataclass

from sim.workload.options import CheckpointMode


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    blocks: frozenset[int] = frozenset()  # decoder blocks that are checkpoint regions
    selective_op: bool = False  # the op-level policy inside each region

    @property
    def active(self) -> bool:
        return bool(self.blocks)

    def covers(self, block: int | None) -> bool:
        return block is not None and block in self.blocks


def checkpoint_plan(mode: CheckpointMode, selective: str | int, n_layers: int) -> CheckpointPlan:
    if mode is CheckpointMode.NONE:
        return CheckpointPlan()
    every = range(n_layers)
    if mode is CheckpointMode.FULL:
        return CheckpointPlan(blocks=frozenset(every))
    if selective == "op":
        return CheckpointPlan(blocks=frozenset(every), selective_op=True)
    n = int(selective)
    return CheckpointPlan(blocks=frozenset(i for i in every if (i + 1) % n == 0))
