"""The NO_SHARD schedule: DistributedDataParallel with gradient buckets.

Every rank holds the full fp32 parameters, gradients and optimizer state. DDP (``torch/nn/parallel/
distributed.py``, reducer.cpp) fills buckets of ``bucket_cap_mb`` in reverse parameter order and
all-reduces a bucket as soon as the backward pass has produced all of its gradients; with the
default ``gradient_as_bucket_view=False`` the buckets are a second, persistent copy of the
gradients, copied back into ``param.grad`` once all reductions are done. Under autocast
(``param_dtype`` below fp32) each layer's cast weights are kept for its backward. With
checkpointing each block keeps only its input and is recomputed just before its backward, as
for FSDP.
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind
from sim.schedule.base import Activations, ScheduleBuilder
from sim.schedule.model_state import numel_per_rank
from sim.schedule.step import StepConfig
from sim.workload.units import ROOT


def bucket_ready_segments(cfg: StepConfig) -> list[tuple[int, int]]:
    """(segment index whose backward completes the bucket, bucket numel) in reduction order."""
    seg_of = {p.name: i for i, seg in enumerate(cfg.segments) for p in seg.params if p.trainable}
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


@dataclass(kw_only=True)
class Microbatch(Activations):
    index: int
    casts: dict[int, str] = field(default_factory=dict)  # segment -> autocast's weight copies


class DdpScheduleBuilder(ScheduleBuilder):
    def __init__(self, cfg: StepConfig):
        super().__init__(cfg)
        self.buckets = bucket_ready_segments(cfg)
        self.last_all_reduce: int | None = None

    def build(self) -> Program:
        cfg = self.cfg
        numel = numel_per_rank(cfg)
        for index in range(cfg.grad_accum):
            mb = Microbatch(index=index)
            self._forward(mb)
            reductions = self._backward(mb)
            if not (cfg.sync_every_microbatch or index == cfg.grad_accum - 1):
                continue  # no_sync(): gradients accumulate in param.grad, no bucket is reduced
            # the reducer's finalize copies the buckets back into param.grad on the compute stream
            copy = self.compute(
                OpKind.COPY,
                "ddp bucket copy-out",
                ROOT,
                index,
                cfg.costs.copy_s(numel * cfg.master_bytes),
                deps=tuple(reductions),
            )
            self.compute_waits = [copy]
        self.optimizer_step()
        return self.program

    def _forward(self, mb: Microbatch) -> None:
        cfg = self.cfg
        for i, seg in enumerate(cfg.segments):
            casts: tuple[Alloc, ...] = ()
            if cfg.param_bytes != cfg.master_bytes:  # autocast's cast copy, saved for backward
                mb.casts[i] = self.label("cast_params", seg.unit, mb.index)
                numel = sum(x.numel for x in seg.params if x.dtype is None)
                casts = (Alloc(label=mb.casts[i], category=Mem.PARAMS, bytes=numel * cfg.param_bytes),)
            self.forward_segment(i, mb.index, mb, extra_allocs=casts)

    def _backward(self, mb: Microbatch) -> list[int]:
        cfg = self.cfg
        reductions: list[int] = []
        recomputed: set[int] = set()
        for i in reversed(range(len(cfg.segments))):
            seg = cfg.segments[i]
            if self.checkpointed(i) and seg.block not in recomputed:
                self.recompute_block(seg.block, mb.index, mb)  # type: ignore[arg-type]
                recomputed.add(seg.block)  # type: ignore[arg-type]
            grads: tuple[Alloc, ...] = ()
            grad_bytes = sum(x.numel for x in seg.params if x.trainable) * cfg.master_bytes
            if mb.index == 0:  # param.grad, in fp32, from the first micro-batch on
                label = self.label("grads", seg.unit, mb.index)
                self.grad_labels.append(label)
                grads = (Alloc(label=label, category=Mem.GRADS, bytes=grad_bytes),)
            casts = (mb.casts.pop(i),) if i in mb.casts else ()
            op = self.backward_segment(
                i,
                mb.index,
                mb,
                end_allocs=grads,
                extra_frees=casts,
                in_place_grad_bytes=0 if grads else grad_bytes,  # later ones: added to param.grad
            )
            if cfg.sync_every_microbatch or mb.index == cfg.grad_accum - 1:
                reductions += self._all_reduce_ready_buckets(i, op, mb.index)
        return reductions

    def _all_reduce_ready_buckets(self, seg_index: int, after: int, mb: int) -> list[int]:
        """The all-reduce of every bucket segment ``seg_index`` completes, issued by the reducer."""
        cfg, ops = self.cfg, []
        for b, (ready, numel) in enumerate(self.buckets):
            if ready != seg_index:
                continue
            deps = self.issued((after,) if self.last_all_reduce is None else (after, self.last_all_reduce))
            nbytes = numel * cfg.reduce_bytes
            cost = cfg.collective("all_reduce", nbytes, GroupKind.REPLICATE, cfg.reduce_dtype)
            self.last_all_reduce = self.program.emit(
                stream=Stream.ALL_REDUCE,
                kind=OpKind.ALL_REDUCE,
                name=f"all_reduce bucket {b}",
                unit=cfg.segments[seg_index].unit,
                microbatch=mb,
                duration_s=cost.time_s,
                deps=deps,
                group=GroupKind.REPLICATE,
                bytes=nbytes,
                algorithm=cost.algorithm,
                protocol=cost.protocol,
                channels=cost.channels,
                wire_fraction=cost.wire_fraction,
                host_async=True,
            )
            ops.append(self.last_all_reduce)
        return ops


def build_ddp_program(cfg: StepConfig) -> Program:
    return DdpScheduleBuilder(cfg).build()
