"""Measuring one point of the sweep (torch): buffers, timed iterations, and the #wrong check.

One point (nccl-tests style, ``src/common.cu``): warm-up iterations, then timed iterations, each
on its own copy of the buffers where the cache would still hold a reused one (``build_op``); each
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

from calibrate.cache_state import copies_for, evict
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


@dataclass(frozen=True, kw_only=True)
class _Op:
    run: Callable[[], Any]
    before_each: Callable[[], Any]  # untimed, before each iteration: the next buffer set
    wrong: Callable[[], int]  # wrong elements of the last iteration's result
    current_output: Callable[[], torch.Tensor]
    sets: int  # buffer sets the iterations rotate through


class _Rotation:
    """Which of ``n`` buffer sets the next iteration uses (``advance`` before each one)."""

    def __init__(self, n: int):
        self.n, self.i = n, -1

    def advance(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


def build_op(
    collective: str,
    size_bytes: int,
    dtype: str,
    group: Any,
    grank: int,
    gsize: int,
    device: torch.device,
    *,
    uses: int,
    cache_bytes: int,
) -> _Op:
    """Buffers, the call, and the #wrong check of one collective at one nccl-tests size.

    A training step does not find a collective's buffers in cache (FSDP2 allocates each
    all-gather's output anew, and the rest of the step has passed through the cache since a
    bucket was last used), while back-to-back iterations on one buffer do: on this project's
    2-core Xeon a 3.5 MB gloo all-gather took 1.7 ms on a reused buffer and 3.5 ms after the
    cache was overwritten. So the ``uses`` iterations of a point rotate through as many copies
    of the buffers as ``cache_state.copies_for`` says for ``cache_bytes`` (the last-level cache),
    like hipBLASLt-bench's ``--rotating`` buffers. The all-reduce's buffer is refilled from its
    pristine input just before each iteration, as DDP fills a bucket just before reducing it. On
    a CPU an output copy's pages are first touched by its first iteration, as a step's freshly
    allocated output's are."""
    itemsize = dtype_bytes(dtype)
    inp, expected = _input_and_expected(
        collective, size_bytes // itemsize, TORCH_DTYPES[dtype], grank, gsize, device
    )
    in_place = collective == "all_reduce"  # one buffer per set; the input stays pristine
    set_bytes = (expected.numel() + (0 if in_place else inp.numel())) * itemsize
    rotation = _Rotation(copies_for(set_bytes, uses=uses, cache_bytes=cache_bytes))
    ins = [inp] + ([] if in_place else [inp.clone() for _ in range(rotation.n - 1)])
    outs = [torch.empty_like(expected) for _ in range(rotation.n)]

    evict(device)  # every copy was just written: out of cache before the first iteration

    def current_output() -> torch.Tensor:
        return outs[rotation.i]

    def wrong() -> int:
        return int((current_output() != expected).sum())

    if in_place:  # the set is refilled from the pristine input first

        def refill() -> None:
            outs[rotation.advance()].copy_(inp)

        return _Op(
            run=lambda: dist.all_reduce(outs[rotation.i], group=group),
            before_each=refill,
            wrong=wrong,
            current_output=current_output,
            sets=rotation.n,
        )
    call = {
        "all_gather": lambda o, i: _all_gather(o, i, group),
        "reduce_scatter": lambda o, i: _reduce_scatter(o, i, group),
        "all_to_all": lambda o, i: dist.all_to_all_single(o, i, group=group),
    }[collective]
    return _Op(
        run=lambda: call(outs[rotation.i], ins[rotation.i]),
        before_each=rotation.advance,
        wrong=wrong,
        current_output=current_output,
        sets=rotation.n,
    )


def _input_and_expected(
    collective: str, n: int, td: torch.dtype, grank: int, gsize: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input of ``n`` elements and the output every correct run of ``collective``
    gives it: patterns distinct per rank and offset, so a misplaced chunk is counted wrong."""
    chunk = n // gsize
    if collective == "all_gather":
        inp = _pattern(grank, chunk, grank * chunk, td, device)
        return inp, torch.cat([_pattern(r, chunk, r * chunk, td, device) for r in range(gsize)])
    if collective == "reduce_scatter":
        return _pattern(grank, n, 0, td, device), _pattern_sum(gsize, chunk, grank * chunk, td, device)
    if collective == "all_reduce":  # pristine: each iteration reduces a fresh copy
        return _pattern(grank, n, 0, td, device), _pattern_sum(gsize, n, 0, td, device)
    if collective == "all_to_all":  # rank r sends chunk d (offset d · chunk) to rank d
        inp = torch.cat([_pattern(grank, chunk, d * chunk, td, device) for d in range(gsize)])
        return inp, torch.cat([_pattern(r, chunk, grank * chunk, td, device) for r in range(gsize)])
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
