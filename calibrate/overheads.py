"""The overheads FSDP2 adds around every unit, measured on the unit's real parameter shapes.

- Copies (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``): all-gather copy-in
  (the rank's shards into one flat send buffer, ``torch.cat``), all-gather copy-out
  (``torch.split_with_sizes_copy`` of the gathered ``(world, shard)`` buffer into per-parameter
  tensors) and reduce-scatter copy-in (``torch._chunk_cat`` of the unsharded gradients into the
  ``(world, ...)`` reduce-scatter input). ``copy_Bps`` is the payload moved by the three over
  their total time (each payload byte is read once and written once).
- Optimizer step per parameter: ``AdamW(foreach=True)`` and ``SGD(momentum=0.9, foreach=True)``
  over fp32 shards (FSDP2 keeps sharded parameters in their original dtype) of the model's
  parameters, up to ``OPTIMIZER_ELEMENTS`` elements, divided by the elements stepped.
- Time spread: the relative standard deviation of the block's forward time run after run, on
  every rank at once (``time_spread``), the simulator's default per-op jitter.
- Compute slowdown during a collective: the block's forward time while another thread keeps
  all-reducing a large buffer (GPU: on a side stream; CPU: gloo's threads take cores), over the
  time right before; on one rank there is no collective and the factor is 1.
"""

import math
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from calibrate.cache_state import copies_for, evict, last_level_cache_bytes
from calibrate.compute import ComputeTarget
from calibrate.layers import Unit
from calibrate.sweep import TORCH_DTYPES
from sim.workload.model import param_specs

OPTIMIZER_ELEMENTS = 32 << 20
SLOWDOWN_WINDOW_S = 1.0
SPREAD_RUNS = 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_s(fn: Any, device: torch.device, reps: int, *, evicted: bool = False) -> float:
    """Mean seconds of ``fn`` repeated after one warm-up call: back to back (its data in cache),
    or ``evicted``, each call after the last-level cache is overwritten (``cache_state.evict``)."""
    return _rotating_mean_s([fn], device, reps, evicted=evicted)


def _rotating_mean_s(
    fns: list[Callable[[], Any]], device: torch.device, reps: int, *, evicted: bool = False
) -> float:
    """Mean seconds of ``reps`` calls taking ``fns`` in turn, after one warm-up call of the first:
    each ``fn`` works on its own data, as many as it takes for each call to find its data out of
    the last-level cache (``cache_state.copies_for``; the caller evicts once after making them)."""
    fns[0]()
    times = []
    for rep in range(1, reps + 1):
        fn = fns[rep % len(fns)]
        if evicted:
            evict(device)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times)


def copy_rates(target: ComputeTarget, device: torch.device, reps: int) -> dict[str, float]:
    """Bytes/s of FSDP2's three copies for one decoder block's parameters at ``param_dtype``.

    The all-gather's copy-in reads the sharded parameters, which the step last touched in the
    previous optimizer step: it is timed on shards out of cache (one set per repetition, as many
    as ``cache_state.copies_for`` needs). The copy-out reads the all-gather's output and the
    reduce-scatter's copy-in the gradients the backward just produced: both in cache, as here."""
    w, dtype = target.world_size, TORCH_DTYPES[target.param_dtype]
    shapes = target.block_param_shapes()
    numels = [math.prod(s) for s in shapes]
    shard = [math.ceil(n / w) for n in numels]
    n_sets = copies_for(
        sum(shard) * dtype.itemsize, uses=reps + 1, cache_bytes=last_level_cache_bytes(device)
    )
    shard_sets = [[torch.randn(n, device=device, dtype=dtype) for n in shard] for _ in range(n_sets)]
    gathered = torch.randn(w, sum(shard), device=device, dtype=dtype)
    outs = [torch.empty(w, n, device=device, dtype=dtype) for n in shard]
    grads = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
    bytes_per = dtype.itemsize
    evict(device)  # every shard set was just written: out of cache before the first copy-in
    times = {
        "all_gather_copy_in": _rotating_mean_s(
            [partial(torch.cat, shards) for shards in shard_sets], device, reps
        ),
        "all_gather_copy_out": _mean_s(
            lambda: torch.split_with_sizes_copy(gathered, shard, dim=1, out=outs), device, reps
        ),
        "reduce_scatter_copy_in": _mean_s(lambda: torch._chunk_cat(grads, dim=0, num_chunks=w), device, reps),
    }
    payload = {
        "all_gather_copy_in": sum(shard) * bytes_per,
        "all_gather_copy_out": w * sum(shard) * bytes_per,
        "reduce_scatter_copy_in": sum(numels) * bytes_per,
    }
    rates = {k: payload[k] / times[k] for k in times}
    rates["copy_Bps"] = sum(payload.values()) / sum(times.values())
    return rates


def optimizer_shard_shapes(target: ComputeTarget) -> list[tuple[int, ...]]:
    """The scenario's trainable parameter shards (LoRA: the adapters) in model order, up to
    ``OPTIMIZER_ELEMENTS`` elements."""
    w = target.world_size
    trained = [s for s in param_specs(target.model) if s.trainable]
    return leading_shapes([(math.ceil(s.shape[0] / w), *s.shape[1:]) for s in trained], OPTIMIZER_ELEMENTS)


def leading_shapes(shapes: list[tuple[int, ...]], limit: int) -> list[tuple[int, ...]]:
    """The first of ``shapes`` whose elements stay within ``limit`` (at least one)."""
    chosen: list[tuple[int, ...]] = []
    total = 0
    for shape in shapes:
        n = math.prod(shape)
        if chosen and total + n > limit:
            break
        chosen.append(shape)
        total += n
    return chosen


def optimizer_step_s_per_param(
    params: list[torch.nn.Parameter], device: torch.device, reps: int
) -> dict[str, float]:
    """Seconds per element of one ``AdamW(foreach=True)`` and ``SGD(momentum=0.9, foreach=True)``
    step over ``params`` (whose gradients are set), each repetition after the last-level cache
    is overwritten (``cache_state.evict``): in a training step the backward has just passed
    through it. Measured here (2-core Xeon, 2 ranks, the 5m Llama's shards), one rank's AdamW:
    9.0 ms back to back, 13.5 ms in the real step, 13.2 ms after an eviction, and 9.4 ms on
    fresh copies of the shards after a single eviction (``copies_for``'s way is not enough here:
    what a step leaves behind is more than cold data)."""
    from torch.distributed.tensor import DTensor

    # a DTensor's numel is the global one; the step works on this rank's shard
    total = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    out = {}
    for name, opt in (
        ("adamw", torch.optim.AdamW(params, lr=1e-4, foreach=True)),
        ("sgd", torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True)),
    ):
        out[name] = _mean_s(opt.step, device, reps, evicted=True) / total
    return out


def optimizer_s_per_param(target: ComputeTarget, device: torch.device, reps: int) -> dict[str, float]:
    """Seconds per parameter element of one optimizer step over fp32 shards (plain tensors)."""
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in optimizer_shard_shapes(target)]
    for p in params:
        p.grad = torch.randn_like(p)
    return optimizer_step_s_per_param(params, device, reps)


def _collective_thread(buf: torch.Tensor, group: Any, count: int, device: torch.device) -> threading.Thread:
    def loop() -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else _null():
            for _ in range(count):
                dist.all_reduce(buf, group=group)
            if stream is not None:
                stream.synchronize()

    return threading.Thread(target=loop, name="calibrate-collective", daemon=True)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _forward_times(unit: Unit, device: torch.device, until: Any) -> list[float]:
    times: list[float] = []
    inputs = unit.make_inputs()
    while until(len(times)):
        _sync(device)
        t0 = time.perf_counter()
        unit.run(*inputs)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def time_spread(unit: Unit, device: torch.device, reps: int) -> float:
    """The unit's forward-time spread over ``SPREAD_RUNS`` (at least ``reps``) runs in a row,
    every rank at once (after a barrier), as the relative standard deviation of the normal
    per-op draws the simulator makes (``sim.core.engine.Variability``). What makes ranks wait
    for each other is how far two runs differ, so it is estimated from Gini's mean difference
    (the mean of |t_i - t_j| over all pairs), which for a normal law is 2σ/√π: σ = √π/2 times it,
    over the mean. It counts a rare slow run by its size, not its square, so a preempted run of a
    short unit on a busy host does not swamp it as it does the sample standard deviation."""
    if dist.is_initialized():
        dist.barrier()
    _forward_times(unit, device, lambda n: n < 1)  # a warm-up
    times = _forward_times(unit, device, lambda n: n < max(reps, SPREAD_RUNS))
    return gini_sigma(times) / statistics.fmean(times)


def gini_sigma(samples: list[float]) -> float:
    """σ of a normal law with the samples' Gini mean difference (√π/2 × mean |x_i - x_j|)."""
    pairs = [abs(a - b) for i, a in enumerate(samples) for b in samples[i + 1 :]]
    return math.sqrt(math.pi) / 2 * statistics.fmean(pairs)


def slowdown_during_collective(unit: Unit, device: torch.device, reps: int) -> tuple[float, float]:
    """(factor >= 1, raw ratio) of the block's forward time while an all-reduce runs alongside."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return 1.0, 1.0
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    buf = torch.zeros((256 << 20) // 4 if device.type == "cuda" else (16 << 20) // 4, device=device)
    one = torch.tensor([_mean_s(lambda: dist.all_reduce(buf, group=group), device, 3)], device=device)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    count = max(3, math.ceil(SLOWDOWN_WINDOW_S / float(one.item())))
    start = time.perf_counter()
    before = _forward_times(
        unit, device, lambda n: n < reps or time.perf_counter() - start < SLOWDOWN_WINDOW_S / 2
    )
    dist.barrier()
    thread = _collective_thread(buf, group, count, device)
    thread.start()
    during = _forward_times(unit, device, lambda n: thread.is_alive() or n == 0)
    thread.join()
    dist.barrier()
    raw = statistics.median(during) / statistics.median(before)
    return max(1.0, raw), raw
