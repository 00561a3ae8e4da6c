"""What DeepSpeed ZeRO's optimizer step costs on the host, measured with the real engine.

``DeepSpeedZeroOptimizer.step`` (stages 1 and 2) and ``DeepSpeedZeroOptimizer_Stage3.step`` do
more than the optimizer: each parameter's gradient cast to fp32 (``.to``), a norm per gradient
and the inf/NaN checks (``get_grad_norm_direct``, ``has_overflow``), unscale and clip, then
``torch.optim.AdamW`` on the flat fp32 partition (one tensor: torch's single-tensor path, not
foreach) and the copy back into the training-dtype parameters. On this CPU that step ran 3-7x the
time of a foreach AdamW over the same elements (VALIDATION.md, the DeepSpeed rows), so it is timed
whole: ``deepspeed.initialize`` with the scenario's own DeepSpeed config on a module holding the
scenario's parameters (whole shapes, in model order, up to ``OPTIMIZER_ELEMENTS`` per rank), a
cheap forward and backward that give every parameter a gradient, then ``engine.step()`` timed,
less the collectives it calls (the overflow flag and norm all-reduces, the parameter
all-gather: the simulator times those as collectives), per element of this rank's partition.

Its host work in forward and backward (ZeRO-3's hooks on every module call: fetch, release,
partition bookkeeping; ZeRO-1/2's gradient hooks and bucket bookkeeping) is measured as FSDP's is
(``calibrate.fsdp_overhead``): ``CHAIN`` decoder layers on a few tokens through the engine against
the same layers plain, less the engine's blocking collectives and the copies the schedules charge,
per layer; the schedules spread it over a layer's module calls (ZeRO-3) or parameters (ZeRO-1/2).

Only where the host is the device (a CPU): on a GPU the step's kernels are the GPU cost model's,
and its host work runs ahead of them.
"""

import math
import statistics
from collections.abc import Mapping
from typing import Any

import torch

from calibrate.cache_state import evict
from calibrate.compute import ComputeTarget
from calibrate.overheads import OPTIMIZER_ELEMENTS, leading_shapes
from calibrate.sweep import TORCH_DTYPES
from calibrate.unit_timing import synced_now
from sim.workload.model import param_specs

WARMUP_STEPS = 2  # the first step allocates the optimizer's states


class _Parameters(torch.nn.Module):
    """The scenario's parameters, and a forward that gives each a gradient at negligible cost."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        super().__init__()
        torch.manual_seed(0)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes)

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return sum((w.float().sum() for w in self.weights), torch.zeros(())) * scale


def blocked_s(records: list[tuple[str, float, float, int]], t0: float, t1: float) -> float:
    """Seconds within [t0, t1] the host spent in collectives or their waits: the union of the
    intervals (a synchronous call's own ``work.wait()`` lies inside the call's interval)."""
    total, end = 0.0, t0
    for _, start, stop, _ in sorted((r for r in records if r[1] >= t0 and r[2] <= t1), key=lambda r: r[1]):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _partition_numel(optimizer: Any) -> int:
    """Elements of this rank's fp32 partition, as the ZeRO optimizer holds it (stages 1/2: the
    flat group's slice; stage 3: each parameter's partition, flattened per sub-group)."""
    groups = getattr(optimizer, "single_partition_of_fp32_groups", None)
    if groups is None:
        groups = optimizer.fp32_partitioned_groups_flat
    return sum(int(t.numel()) for t in groups)


def without_shm_comm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at start-up (about 40 s on a
    fresh machine) that only ``inference_all_reduce`` (AutoTP inference) calls; ZeRO's collectives
    go through torch.distributed, so the step run is the same without it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _engine(module: torch.nn.Module, config: Mapping[str, Any]) -> tuple[Any, Any]:
    """``deepspeed.initialize`` of ``module`` under ``config`` at one sample per rank and step, on
    the calibration's process group: (engine, its ZeRO optimizer)."""
    import deepspeed
    import torch.distributed as dist

    without_shm_comm_build()
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    world = dist.get_world_size()
    ds_config = dict(config) | {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
    }
    engine, optimizer, _, _ = deepspeed.initialize(
        model=module, model_parameters=module.parameters(), config=ds_config
    )
    return engine, optimizer


def step_s_per_param(
    target: ComputeTarget, config: Mapping[str, Any], device: torch.device, reps: int
) -> dict[str, float]:
    """Seconds per element of this rank's partition of one ``engine.step()`` under ``config`` (a
    DeepSpeed config, ``sim.scenario.deepspeed_config``), its collectives left out, and the
    raw figures it came from."""
    import torch.distributed as dist

    from calibrate.collective_timer import timed_collectives, timed_waits

    whole = [tuple(s.shape) for s in param_specs(target.model)]
    shapes = leading_shapes(whole, OPTIMIZER_ELEMENTS * dist.get_world_size())
    records: list[tuple[str, float, float, int]] = []
    step_s: list[float] = []
    # the wrappers are in place before the engine exists (DeepSpeed keeps its all-gather function);
    # it issues most collectives with async_op=True, so the host blocks in Work.wait
    with timed_collectives(records), timed_waits(records):
        engine, optimizer = _engine(_Parameters(shapes), config)
        scale = torch.ones((), device=device)
        for rep in range(WARMUP_STEPS + max(reps, 5)):
            engine.backward(engine(scale))
            evict(device)  # a step finds the optimizer's state out of cache (calibrate.cache_state)
            t0 = synced_now(device)
            engine.step()
            t1 = synced_now(device)
            if rep >= WARMUP_STEPS:
                step_s.append(t1 - t0 - blocked_s(records, t0, t1))
    partition = _partition_numel(optimizer)
    engine.destroy()
    mean_s = statistics.fmean(step_s)
    return {"step_s": mean_s, "partition_numel": float(partition), "s_per_param": mean_s / partition}


class _ChainLoss(torch.nn.Module):
    """The calibration's decoder layers with the loss DeepSpeed's engine returns."""

    def __init__(self, chain: torch.nn.Module):
        super().__init__()
        self.chain = chain

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.chain(h).float().sum()


def _copy_bytes(target: ComputeTarget, config: Mapping[str, Any], world: int) -> tuple[int, int]:
    """Bytes of the copies the ZeRO schedules charge one decoder layer in forward and backward:
    each gradient into the IPG bucket, then (stages 1/2) this rank's slice of the reduced bucket
    into ``grads_in_partition`` or (stage 3) the bucket's flatten and partition add
    (``sim.schedule.zero``, ``zero3``). The forward copies none for modules that own one weight."""
    numel = sum(math.prod(s) for s in target.block_param_shapes())
    param_bytes = TORCH_DTYPES[target.param_dtype].itemsize
    reduce_dtype = config.get("communication_data_type", target.param_dtype)
    reduce_bytes = TORCH_DTYPES[reduce_dtype].itemsize
    if config["zero_optimization"]["stage"] == 3:
        return 0, round(numel * param_bytes + numel * reduce_bytes * (1 + 1 / world))
    return 0, numel * param_bytes + numel // world * param_bytes


def layer_overhead(
    target: ComputeTarget, config: Mapping[str, Any], device: torch.device, reps: int, copy_Bps: float
) -> dict[str, float]:
    """Seconds DeepSpeed adds per decoder layer in forward and backward (its module hooks under
    ZeRO-3, its gradient hooks and bucket bookkeeping under ZeRO-1/2) beyond the collectives and
    the copies the schedules charge: ``CHAIN`` layers of the scenario's dimensions on ``TINY_SEQ``
    tokens through the engine, against the same layers plain, interleaved (raw: before the floor)."""
    import torch.distributed as dist

    from calibrate.collective_timer import timed_collectives, timed_waits
    from calibrate.fsdp_overhead import CHAIN, TINY_SEQ, _chain, _step

    compute = TORCH_DTYPES[target.param_dtype]
    plain = _chain(target, device, compute)
    records: list[tuple[str, float, float, int]] = []
    samples: dict[str, list[tuple[float, float]]] = {"plain": [], "deepspeed": []}
    hidden = target.model.hidden
    with timed_collectives(records), timed_waits(records):
        engine, _ = _engine(_ChainLoss(_chain(target, device, compute)), config)  # cast as the engine would
        for rep in range(WARMUP_STEPS + max(reps, 10)):
            plain_s = _step(plain, hidden, device, compute)  # no collectives: the layers alone
            x = torch.randn(1, TINY_SEQ, hidden, device=device, dtype=compute, requires_grad=True)
            t0 = synced_now(device)
            loss = engine(x)
            t1 = synced_now(device)
            engine.backward(loss)
            t2 = synced_now(device)
            engine.step()  # not timed: DeepSpeed needs it before the next backward
            if rep >= WARMUP_STEPS:
                samples["plain"].append(plain_s)
                samples["deepspeed"].append(
                    (t1 - t0 - blocked_s(records, t0, t1), t2 - t1 - blocked_s(records, t1, t2))
                )
    engine.destroy()
    copies = _copy_bytes(target, config, dist.get_world_size())
    out = {}
    for index, phase in enumerate(("forward", "backward")):
        extra = statistics.fmean(s[index] for s in samples["deepspeed"]) - statistics.fmean(
            s[index] for s in samples["plain"]
        )
        out[f"{phase}_raw_s"] = extra / CHAIN - copies[index] / copy_Bps
    return out
