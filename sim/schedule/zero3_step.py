"""Stage 3's optimizer step (``stage3.py``, DeepSpeed 0.19.8), emitted through the ZeRO-3
schedule's ``OpEmitter`` once its gradients are reduced: one all-reduce of the overflow flag and
the gradient norm; then per ``sub_group_size`` group the gradient partition cast to fp32, the
optimizer, the fp32 partition copied into the training-dtype partition (on the host under
ZeRO-Offload, its states swapped from NVMe under ZeRO-Infinity); then one all-gather per
persistent parameter (``_post_step``).
"""

from math import ceil

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc
from sim.core.topology import GroupKind
from sim.schedule.emit import OpEmitter
from sim.schedule.zero_state import gathered_numel, partition_numel
from sim.workload.model import ParamSpec
from sim.workload.options import OPTIMIZER_STATES, ZeroOptions
from sim.workload.units import ROOT

STEP_SCALARS_BYTES = 8  # stage 3's one all-reduce of the overflow flag and the gradient norm


def emit_zero3_step(e: OpEmitter, zero: ZeroOptions, specs: dict[str, ParamSpec], persist: set[str]) -> None:
    """The step over this rank's partitions of ``specs`` (every parameter, in the model's
    order), after the ops in ``e.compute_waits``; ``persist``: the persistent parameters."""
    cfg, mb = e.cfg, e.cfg.grad_accum - 1
    part = sum(partition_numel(p, cfg.world_size) for p in specs.values())
    scalars = e.collective(
        OpKind.ALL_REDUCE,
        Stream.ALL_REDUCE,
        ROOT,
        STEP_SCALARS_BYTES,
        GroupKind.SHARD,
        "fp32",
        mb=mb,
        deps=tuple(e.compute_waits),
        name="all_reduce overflow flag and gradient norm",
    )
    e.compute_waits = [scalars]
    groups = max(1, ceil(part / zero.sub_group_size))
    for g in range(groups):
        numel = min(zero.sub_group_size, part - g * zero.sub_group_size)
        if zero.offload_optimizer.value != "none":
            _offloaded_sub_group(e, zero, g, numel, mb)
            continue
        label = f"fp32_grad_partition:{g}"
        e.compute(
            OpKind.OPTIMIZER,
            f"optimizer step (sub-group {g})",
            ROOT,
            mb,
            cfg.costs.copy_s(numel * (cfg.param_bytes + 2 * cfg.master_bytes)) + cfg.costs.optimizer_s(numel)
            if cfg.costs.deepspeed_step_s_per_element is None
            else cfg.costs.deepspeed_step_s_per_element * numel,  # measured through the real engine
            allocs=(Alloc(label=label, category=Mem.GRADS, bytes=numel * cfg.master_bytes),),
            frees=(label,),
        )
    _gather_persistent(e, specs, persist, mb)


def _offloaded_sub_group(e: OpEmitter, zero: ZeroOptions, g: int, numel: int, mb: int) -> None:
    """One sub-group stepped on the host (ZeRO-Offload / ZeRO-Infinity): under NVMe its fp32
    master and states (12 B per element) are swapped in, stepped by DeepSpeed's CPU Adam and
    swapped out, one after another; then its training-dtype partition goes back to the device
    (or, with ``offload_param``, stays on the host or goes to NVMe)."""
    cfg, host, nvme = e.cfg, e.cfg.host_costs, zero.offload_optimizer.value == "nvme"
    states = numel * cfg.master_bytes * (OPTIMIZER_STATES[cfg.optimizer] + 1)
    deps = tuple(e.compute_waits)
    if nvme:
        deps = (_nvme(e, f"nvme read states {g}", mb, states, host.nvme_read_s(states), deps),)
    step = e.host_optimizer(
        f"optimizer step (DeepSpeed CPU Adam, sub-group {g})", mb, host.cpu_adam_s(numel), deps
    )
    if nvme:
        _nvme(e, f"nvme write states {g}", mb, states, host.nvme_write_s(states), (step,))
    nbytes, where = numel * cfg.param_bytes, zero.offload_param.value
    if where == "none":
        h2d = e.transfer(Stream.H2D, f"h2d partition {g}", ROOT, mb, nbytes, host.h2d_s(nbytes), deps=(step,))
        e.compute_waits = [h2d]
    elif where == "nvme":
        _nvme(e, f"nvme write partition {g}", mb, nbytes, host.nvme_write_s(nbytes), (step,))


def _nvme(e: OpEmitter, name: str, mb: int, nbytes: int, duration_s: float, deps: tuple[int, ...]) -> int:
    return e.transfer(Stream.NVME, name, ROOT, mb, nbytes, duration_s, deps=deps)


def _gather_persistent(e: OpEmitter, specs: dict[str, ParamSpec], persist: set[str], mb: int) -> None:
    """``_post_step``: each persistent parameter all-gathered on its own."""
    for name in sorted(persist, key=list(specs).index):
        e.collective(
            OpKind.ALL_GATHER,
            Stream.ALL_GATHER,
            ROOT,
            gathered_numel(specs[name], e.cfg.world_size) * e.cfg.param_bytes,
            GroupKind.SHARD,
            e.cfg.param_dtype,
            mb=mb,
            deps=(),
            name=f"all_gather persistent {name}",
        )
