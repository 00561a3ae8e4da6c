"""The one memory curve of a rank: live bytes per category after every ledger entry.

The report's peak, the timeline's memory panel and the Chrome trace's counters all read it, so
they agree to the byte. Entries are taken in the order the engine made them: an allocation and a
free at the same instant count in that order, as the caching allocator sees them.
"""

from dataclasses import dataclass

import numpy as np

from sim.core.events import EventTable, MemoryCategory


@dataclass(frozen=True, kw_only=True)
class MemoryCurve:
    """``by_category[c][i]``: bytes of category ``c`` live after entry ``i`` (at ``times_s[i]``)."""

    times_s: np.ndarray
    by_category: dict[MemoryCategory, np.ndarray]

    @property
    def total(self) -> np.ndarray:
        return np.sum(list(self.by_category.values()), axis=0)

    def peak_index(self) -> int:
        """The first entry after which the total is largest (0 for an empty curve)."""
        return int(np.argmax(self.total)) if len(self.times_s) else 0

    def peak_bytes(self) -> int:
        return int(self.total[self.peak_index()]) if len(self.times_s) else 0

    def at(self, index: int) -> dict[MemoryCategory, int]:
        """Bytes per category after entry ``index``."""
        return {c: int(v[index]) if len(v) else 0 for c, v in self.by_category.items()}


def memory_curve(table: EventTable, rank: int) -> MemoryCurve:
    """The curve of job rank ``rank`` (the simulated rank that stands for it)."""
    records = table.memory_of(rank)
    times = np.array([m.time_s for m in records], dtype=float)
    if np.any(np.diff(times) < 0):
        raise ValueError(
            f"rank {rank}'s memory records are not in time order; the curve needs the ledger's order"
        )
    by_category = {}
    for category in MemoryCategory:
        deltas = np.array([m.delta_bytes if m.category is category else 0 for m in records], dtype=np.int64)
        by_category[category] = np.cumsum(deltas)
    return MemoryCurve(times_s=times, by_category=by_category)


def memory_curves(table: EventTable) -> dict[int, MemoryCurve]:
    """The curve of every simulated rank, by simulated rank."""
    return {r: memory_curve(table, r) for r in table.simulated_ranks}
