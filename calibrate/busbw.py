"""Algorithm and bus bandwidth of a collective, exactly as nccl-tests defines them.

Source: NVIDIA nccl-tests, ``doc/PERFORMANCE.md`` ("Performance reported by NCCL tests").

- ``size`` S is, per nccl-tests, the all-gather *output*, the reduce-scatter *input* and the
  all-reduce buffer, in bytes (for a group of n ranks, ``count * sizeof(dtype) * n`` for the first two).
- ``algbw = S / t``.
- ``busbw = algbw * factor`` with factor ``(n-1)/n`` for all-gather and reduce-scatter and
  ``2(n-1)/n`` for all-reduce.
- all-to-all (nccl-tests ``src/alltoall.cu``, ``AlltoAllGetBw``): ``size`` is each rank's send
  buffer, factor ``(n-1)/n`` (the share of it that leaves the rank).

The same factor turns the α–β model into seconds: ``t = latency_s + S * factor / busbw``.
"""

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def bus_factor(collective: str, group_size: int) -> float:
    """nccl-tests' correction factor from algbw to busbw (PERFORMANCE.md, "Summary")."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = group_size
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def algbw_Bps(size_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth in bytes/s: ``S / t`` (PERFORMANCE.md, "Algorithm bandwidth")."""
    if time_s <= 0:
        raise ValueError(f"time_s must be > 0, got {time_s}")
    return size_bytes / time_s


def busbw_Bps(collective: str, group_size: int, size_bytes: float, time_s: float) -> float:
    """Bus bandwidth in bytes/s: ``algbw * factor`` (PERFORMANCE.md, "Bus bandwidth")."""
    return algbw_Bps(size_bytes, time_s) * bus_factor(collective, group_size)


def wire_bytes(collective: str, group_size: int, size_bytes: float) -> float:
    """Bytes each rank's link carries at best: ``S * factor``; ``t = latency_s + wire_bytes / busbw``."""
    return size_bytes * bus_factor(collective, group_size)
