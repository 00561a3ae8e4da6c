"""Memory curves from the ledger in an event table: live bytes per category over time, and peaks."""

from dataclasses import dataclass

import numpy as np

from sim.events import EventTable, MemoryCategory


@dataclass(frozen=True)
class MemoryCurve:
    """Live bytes on one rank after each ledger entry: ``by_category[c][i]`` after entry ``i``."""

    times_s: np.ndarray
    by_category: dict[MemoryCategory, np.ndarray]

    @property
    def total(self) -> np.ndarray:
        return np.sum(list(self.by_category.values()), axis=0)

    def peak_index(self) -> int:
        return int(np.argmax(self.total)) if len(self.times_s) else 0

    def peak_bytes(self) -> int:
        return int(self.total[self.peak_index()]) if len(self.times_s) else 0

    def at(self, index: int) -> dict[str, int]:
        return {c.value: int(v[index]) if len(v) else 0 for c, v in self.by_category.items()}


def memory_curve(table: EventTable, rank: int) -> MemoryCurve:
    records = table.memory_of(rank)
    times = np.array([m.time_s for m in records])
    by_category = {}
    for category in MemoryCategory:
        deltas = np.array([m.delta_bytes if m.category is category else 0 for m in records], dtype=np.int64)
        by_category[category] = np.cumsum(deltas)
    return MemoryCurve(times, by_category)
