"""Forward, backward and recompute time of one unit, and its activation memory.

Times are means over ``reps`` repetitions (a step sums the units' times, so its expected length
sums their means) after one warm-up; every repetition gets fresh
inputs and gradients set to None (FSDP2 frees unsharded gradients after each reduce-scatter, so
each backward allocates them anew). On a GPU the device is synchronised around each timed
region. Recompute is timed inside a real non-reentrant ``torch.utils.checkpoint`` backward,
through its ``context_fn`` recompute context: the time from entering to leaving the
recomputation, so it includes exactly what checkpointing re-runs.
"""

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from calibrate.layers import Unit
from calibrate.memtrack import SavedTensorBytes, peak_above_start
from sim.hardware.compute_section import UnitMeasurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced_now(device: torch.device) -> float:
    """Wait for the device's queued work, then read the clock (timers must not race the GPU)."""
    _sync(device)
    return time.perf_counter()


def _clear_grads(unit: Unit) -> None:
    for p in unit.params():
        p.grad = None


def _grad_for(out: torch.Tensor) -> torch.Tensor | None:
    return None if out.dim() == 0 else torch.randn_like(out)


def _timed(region: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    region()
    _sync(device)
    return time.perf_counter() - t0


def forward_s(unit: Unit, device: torch.device, reps: int) -> float:
    times: list[float] = []
    for _ in range(reps + 1):
        inputs = unit.make_inputs()
        times.append(_timed(partial(unit.run, *inputs), device))
    return statistics.fmean(times[1:])


def backward_s(unit: Unit, device: torch.device, reps: int) -> float:
    times: list[float] = []
    for _ in range(reps + 1):
        out = unit.run(*unit.make_inputs())
        grad = _grad_for(out)
        _clear_grads(unit)
        times.append(_timed(partial(out.backward, grad), device))
    return statistics.fmean(times[1:])


def recompute_s(unit: Unit, device: torch.device, reps: int) -> float:
    spent: list[float] = []

    @contextlib.contextmanager
    def stopwatch() -> Iterator[None]:
        _sync(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync(device)
            spent.append(time.perf_counter() - t0)

    for _ in range(reps + 1):
        out = checkpoint(
            unit.run,
            *unit.make_inputs(),
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), stopwatch()),
        )
        _clear_grads(unit)
        out.backward(_grad_for(out))
    return statistics.fmean(spent[1:])


def memory(unit: Unit, device: torch.device) -> tuple[int, int, int]:
    """(saved activation bytes, forward transient, backward transient) of one call, as the
    simulator's ledger uses them (``sim.hardware.compute_section``): forward holds saved + transient,
    backward holds transient on top of its start."""
    inputs = unit.make_inputs()
    _clear_grads(unit)
    with SavedTensorBytes([*unit.params(), *unit.shared]) as saved:
        # the forward's transient is its peak without the activations it saves
        out, fwd_transient = peak_above_start(
            lambda: unit.run(*inputs), device, leave_out=lambda: saved.tensors
        )
    grad = _grad_for(out)
    grads = lambda: [p.grad for p in unit.params() if p.grad is not None]  # noqa: E731
    _, bwd_peak = peak_above_start(lambda: out.backward(grad), device, leave_out=grads)
    return saved.bytes, fwd_transient, bwd_peak


def measure_unit(unit: Unit, device: torch.device, reps: int, with_recompute: bool) -> UnitMeasurement:
    saved, fwd_transient, bwd_transient = memory(unit, device)
    return UnitMeasurement(
        forward_s=forward_s(unit, device, reps),
        backward_s=backward_s(unit, device, reps),
        recompute_s=recompute_s(unit, device, reps) if with_recompute else 0.0,
        saved_activation_bytes=saved,
        forward_transient_bytes=fwd_transient,
        backward_transient_bytes=bwd_transient,
    )
