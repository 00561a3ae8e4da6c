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

Only where the host is the device (a CPU): on a GPU the step's kernels are the GPU cost model's,
and its host work runs ahead of them.
"""

import math
import statistics
from collections.abc import Mapping
from typing import Any

import torch

from calibrate.compute import ComputeTarget
from calibrate.overheads import OPTIMIZER_ELEMENTS
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


def _shapes(target: ComputeTarget, world: int) -> list[tuple[int, ...]]:
    chosen: list[tuple[int, ...]] = []
    total = 0
    for spec in param_specs(target.model):
        n = math.prod(spec.shape)
        if chosen and total + n > OPTIMIZER_ELEMENTS * world:
            break
        chosen.append(tuple(spec.shape))
        total += n
    return chosen


def _partition_numel(optimizer: Any) -> int:
    """Elements of this rank's fp32 partition, as the ZeRO optimizer holds it (stages 1/2: the
    flat group's slice; stage 3: each parameter's partition, flattened per sub-group)."""
    groups = getattr(optimizer, "single_partition_of_fp32_groups", None)
    if groups is None:
        groups = optimizer.fp32_partitioned_groups_flat
    return sum(int(t.numel()) for t in groups)


def step_s_per_param(
    target: ComputeTarget, config: Mapping[str, Any], device: torch.device, reps: int
) -> dict[str, float]:
    """Seconds per element of this rank's partition of one ``engine.step()`` under ``config`` (a
    DeepSpeed config, ``sim.scenario.deepspeed_config``), its collectives left out, and the
    raw figures it came from."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    from calibrate.collective_timer import timed_collectives

    # as validation.build_deepspeed: no shared-memory all-reduce build (AutoTP inference only)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    world = dist.get_world_size()
    shapes = _shapes(target, world)
    ds_config = dict(config) | {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
    }
    records: list[tuple[str, float, float, int]] = []
    step_s: list[float] = []
    # the wrapper is in place before the engine exists: DeepSpeed keeps its all-gather function
    with timed_collectives(records):
        module = _Parameters(shapes)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=module, model_parameters=module.parameters(), config=ds_config
        )
        scale = torch.ones((), device=device)
        for rep in range(WARMUP_STEPS + max(reps, 5)):
            engine.backward(engine(scale))
            t0 = synced_now(device)
            engine.step()
            t1 = synced_now(device)
            comm = sum(e - s for _, s, e, _ in records if s >= t0 and e <= t1)
            if rep >= WARMUP_STEPS:
                step_s.append(t1 - t0 - comm)
    partition = _partition_numel(optimizer)
    engine.destroy()
    mean_s = statistics.fmean(step_s)
    return {"step_s": mean_s, "partition_numel": float(partition), "s_per_param": mean_s / partition}
