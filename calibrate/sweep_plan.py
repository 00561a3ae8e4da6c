"""The message-size sweep plan: which sizes, how many warm-up and timed iterations. No torch.

Defaults follow the issue: CPU 1 KiB–64 MiB (×4 steps), GPU 1 KiB–1 GiB (×2 steps, as nccl-tests'
``-f 2``). The iteration count of a size depends on the size only, so every rank agrees on it
without talking.
"""

import math
from dataclasses import dataclass

from sim.dtypes import dtype_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    min_bytes: int
    max_bytes: int
    factor: int
    warmup: int
    min_iters: int
    max_iters: int
    budget_bytes: int  # timed iterations per point: about budget_bytes / size, clamped
    dtypes: tuple[str, ...]
    collectives: tuple[str, ...]
    timeout_s: float


CPU_DEFAULTS = dict(
    min_bytes=1 * KiB,
    max_bytes=64 * MiB,
    factor=4,
    warmup=2,
    min_iters=5,
    max_iters=30,
    budget_bytes=256 * MiB,
)
GPU_DEFAULTS = dict(
    min_bytes=1 * KiB,
    max_bytes=1 * GiB,
    factor=2,
    warmup=5,
    min_iters=10,
    max_iters=50,
    budget_bytes=16 * GiB,
)


def sizes_for(cfg: SweepConfig, group_size: int, dtype: str) -> list[int]:
    """The log grid min..max (×factor), each rounded down to a multiple of group_size × dtype bytes."""
    quantum = group_size * dtype_bytes(dtype)
    sizes: list[int] = []
    s = cfg.min_bytes
    while s <= cfg.max_bytes:
        rounded = max(quantum, s // quantum * quantum)
        if not sizes or rounded > sizes[-1]:
            sizes.append(rounded)
        s *= cfg.factor
    return sizes


def iters_for(cfg: SweepConfig, size_bytes: int) -> int:
    """Timed iterations for one size: the same on every rank, so no negotiation is needed."""
    return max(cfg.min_iters, min(cfg.max_iters, math.ceil(cfg.budget_bytes / size_bytes)))
