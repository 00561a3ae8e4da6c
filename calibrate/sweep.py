"""Measuring one point of the sweep (torch): buffers, timed iterations, and the #wrong check.

One point (nccl-tests style, ``src/common.cu``): warm-up iterations, then timed iterations; each
timed iteration starts after a world barrier (GPU: after a device synchronize, timed with CUDA
events; CPU: wall clock around the call). A rank's iteration time is its own; the point's
iteration time is the max over ranks, since a collective is done when its last rank is.
After the timed iterations the last result is checked element by element against the exact
expected values, like nccl-tests' ``#wrong``: inputs hold small integers ((i + rank) mod 3)
that every dtype represents exactly, and so do their sums for groups of up to 128 ranks.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from calibrate.records import Point, point_from_times
from sim.dtypes import dtype_bytes

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _pattern(rank: int, n: int, offset: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Element i is (offset + i + rank) mod 3."""
    base = torch.tensor([(offset + rank + k) % 3 for k in range(3)], dtype=dtype, device=device)
    return base.repeat(math.ceil(n / 3))[:n]


def _pattern_sum(
    group_size: int, n: int, offset: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Σ over ranks r < group_size of _pattern(r): 3 per full cycle of three ranks, plus the rest."""
    full, rest = divmod(group_size, 3)
    out = torch.full((n,), 3 * full, dtype=dtype, device=device)
    for r in range(rest):
        out += _pattern(r, n, offset, dtype, device)
    return out


@dataclass(frozen=True)
class _Op:
    run: Callable[[], Any]
    before_each: Callable[[], Any]
    wrong: Callable[[], int]


def build_op(
    collective: str, size_bytes: int, dtype: str, group: Any, grank: int, gsize: int, device: torch.device
) -> _Op:
    """Buffers, the call, and the #wrong check of one collective at one nccl-tests size."""
    td = TORCH_DTYPES[dtype]
    n = size_bytes // dtype_bytes(dtype)
    chunk = n // gsize
    if collective == "all_gather":
        inp = _pattern(grank, chunk, grank * chunk, td, device)
        out = torch.empty(n, dtype=td, device=device)
        expected = torch.cat([_pattern(r, chunk, r * chunk, td, device) for r in range(gsize)])
        return _Op(lambda: _all_gather(out, inp, group), lambda: None, lambda: int((out != expected).sum()))
    if collective == "reduce_scatter":
        inp = _pattern(grank, n, 0, td, device)
        out = torch.empty(chunk, dtype=td, device=device)
        expected = _pattern_sum(gsize, chunk, grank * chunk, td, device)
        return _Op(
            lambda: _reduce_scatter(out, inp, group), lambda: None, lambda: int((out != expected).sum())
        )
    if collective == "all_reduce":
        pristine = _pattern(grank, n, 0, td, device)
        buf = pristine.clone()
        expected = _pattern_sum(gsize, n, 0, td, device)
        return _Op(
            lambda: dist.all_reduce(buf, group=group),
            lambda: buf.copy_(pristine),
            lambda: int((buf != expected).sum()),
        )
    if collective == "all_to_all":  # rank r sends chunk d (offset d · chunk) to rank d
        inp = torch.cat([_pattern(grank, chunk, d * chunk, td, device) for d in range(gsize)])
        out = torch.empty(chunk * gsize, dtype=td, device=device)
        expected = torch.cat([_pattern(r, chunk, grank * chunk, td, device) for r in range(gsize)])
        return _Op(
            lambda: dist.all_to_all_single(out, inp, group=group),
            lambda: None,
            lambda: int((out != expected).sum()),
        )
    raise ValueError(f"unknown collective {collective!r}")


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _time_once(op: _Op, device: torch.device) -> float:
    """One timed iteration after a world barrier: CUDA events on GPU, wall clock on CPU."""
    import time

    op.before_each()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op.run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    dist.barrier()
    t0 = time.perf_counter()
    op.run()
    return time.perf_counter() - t0


def measure_point(op: _Op, size_bytes: int, warmup: int, iters: int, device: torch.device) -> Point:
    """Warm up, time ``iters`` iterations, check the last result; identical Point on every rank."""
    for _ in range(warmup):
        op.before_each()
        op.run()
    times = torch.tensor([_time_once(op, device) for _ in range(iters)], dtype=torch.float64, device=device)
    wrong = torch.tensor([op.wrong()], dtype=torch.int64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM)
    return point_from_times(size_bytes, times.tolist(), int(wrong.item()))
