"""The NO_SHARD schedule: DistributedDataParallel with gradient buckets.

Every rank holds the full fp32 parameters, gradients and optimizer state. DDP (``torch/nn/parallel/
distributed.py``, reducer.cpp) fills buckets of ``bucket_cap_mb`` in reverse parameter order and
all-reduces a bucket as soon as the backward pass has produced all of its gradients; with the
default ``gradient_as_bucket_view=False`` the buckets are a second, persistent copy of the
gradients, copied back into ``param.grad`` once all reductions are done. Under autocast
(``param_dtype`` below fp32) each layer's cast weights are kept for its backward.
"""

from sim.events import MemoryCategory as Mem
from sim.events import OpKind, Stream
from sim.program import Alloc, Program
from sim.step_config import OPTIMIZER_STATES, StepConfig
from sim.topology import GroupKind
from sim.units import ROOT


def bucket_ready_segments(cfg: StepConfig) -> list[tuple[int, int]]:
    """(segment index whose backward completes the bucket, bucket numel) in reduction order."""
    seg_of = {p.name: i for i, seg in enumerate(cfg.segments) for p in seg.params}
    params = [p for u in cfg.units for p in u.params if p.name in seg_of]
    buckets: list[tuple[int, int]] = []
    numel, ready = 0, len(cfg.segments)
    for spec in reversed(params):  # DDP buckets parameters in reverse registration order
        numel += spec.numel
        ready = min(ready, seg_of[spec.name])  # backward runs segments in reverse
        if numel * cfg.reduce_bytes >= cfg.ddp_bucket_bytes:
            buckets.append((ready, numel))
            numel, ready = 0, len(cfg.segments)
    if numel:
        buckets.append((ready, numel))
    return buckets


def build_ddp_program(cfg: StepConfig) -> Program:
    p = Program()
    costs, segs = cfg.costs, cfg.segments
    total = sum(u.numel for u in cfg.units)
    p.initial.append(Alloc("params", Mem.PARAMS, total * cfg.master_bytes))
    p.initial.append(Alloc("buffers", Mem.PARAMS, cfg.buffer_bytes))
    p.initial.append(
        Alloc("optimizer", Mem.OPTIMIZER, OPTIMIZER_STATES[cfg.optimizer] * total * cfg.master_bytes)
    )
    p.initial.append(Alloc("ddp_buckets", Mem.COMM_BUFFERS, total * cfg.reduce_bytes))
    buckets = bucket_ready_segments(cfg)
    grad_labels: list[str] = []
    waits: list[int] = []
    last_all_reduce: int | None = None
    for mb in range(cfg.grad_accum):
        saved, casts = {}, {}
        for i, seg in enumerate(segs):
            allocs = [Alloc(f"act:{i}:mb{mb}", Mem.ACTIVATIONS, costs.saved_bytes(seg))]
            saved[i] = f"act:{i}:mb{mb}"
            if cfg.param_bytes != cfg.master_bytes:  # autocast's cast copy, saved for backward
                casts[i] = f"cast_params:{i}:mb{mb}"
                allocs.append(Alloc(casts[i], Mem.PARAMS, sum(x.numel for x in seg.params) * cfg.param_bytes))
            temp = f"fwd_temp:{i}:mb{mb}"
            allocs.append(Alloc(temp, Mem.OTHER, costs.forward_transient_bytes(seg)))
            p.emit(
                Stream.COMPUTE, OpKind.FORWARD, seg.name, seg.unit, mb, costs.forward_s(seg),
                deps=tuple(waits), allocs=tuple(allocs), frees=(temp,),
            )  # fmt: skip
            waits = []
        reductions = []
        for i in reversed(range(len(segs))):
            seg = segs[i]
            bwd_temp = Alloc(f"bwd_temp:{i}:mb{mb}", Mem.OTHER, costs.backward_transient_bytes(seg))
            grads = []
            if mb == 0:
                grad_labels.append(f"grads:{i}")
                grads.append(
                    Alloc(f"grads:{i}", Mem.GRADS, sum(x.numel for x in seg.params) * cfg.master_bytes)
                )
            frees = [bwd_temp.label, saved[i]] + ([casts[i]] if i in casts else [])
            op = p.emit(
                Stream.COMPUTE, OpKind.BACKWARD, seg.name, seg.unit, mb, costs.backward_s(seg),
                allocs=(bwd_temp,), frees=tuple(frees), end_allocs=tuple(grads),
            )  # fmt: skip
            for b, (ready, numel) in enumerate(buckets):
                if ready == i:
                    deps = (op,) if last_all_reduce is None else (op, last_all_reduce)
                    nbytes = numel * cfg.reduce_bytes
                    last_all_reduce = p.emit(
                        Stream.ALL_REDUCE, OpKind.ALL_REDUCE, f"all_reduce bucket {b}", seg.unit, mb,
                        cfg.collective_s("all_reduce", nbytes, GroupKind.REPLICATE, cfg.reduce_dtype),
                        deps=deps, group=GroupKind.REPLICATE, bytes=nbytes,
                    )  # fmt: skip
                    reductions.append(last_all_reduce)
        # The reducer's finalize copies the buckets back into param.grad on the compute stream.
        copy = p.emit(
            Stream.COMPUTE, OpKind.COPY, "ddp bucket copy-out", ROOT, mb,
            costs.copy_s(total * cfg.master_bytes), deps=tuple(reductions),
        )  # fmt: skip
        waits = [copy]
    temp_bytes = total * cfg.master_bytes if cfg.optimizer == "adamw" else 0
    p.emit(
        Stream.COMPUTE, OpKind.OPTIMIZER, "optimizer step", ROOT, cfg.grad_accum - 1, costs.optimizer_s(total),
        deps=tuple(waits), allocs=(Alloc("optimizer_temp", Mem.OTHER, temp_bytes),),
        frees=("optimizer_temp", *grad_labels),
    )  # fmt: skip
    return p
