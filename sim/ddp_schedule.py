"""The NO_SHARD schedule: DistributedDataParallel with gradient buckets.

Every rank holds the full fp32 parameters, gradients and optimizer state. DDP (``torch/nn/parallel/
distributed.py``, reducer.cpp) fills buckets of ``bucket_cap_mb`` in reverse parameter order and
all-reduces a bucket as soon as the backward pass has produced all of its gradients; with the
default ``gradient_as_bucket_view=False`` the buckets are a second, persistent copy of the
gradients, copied back into ``param.grad`` once all reductions are done. Under autocast
(``param_dtype`` below fp32) each layer's cast weights are kept for its backward.
"""

from typing import Any

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


class DdpScheduleBuilder:
    """One DDP step in host order; with checkpointing each block keeps only its input and is
    recomputed just before its backward, as for FSDP."""

    def __init__(self, cfg: StepConfig):
        self.cfg, self.p = cfg, Program()
        self.total = sum(u.numel for u in cfg.units)
        self.buckets = bucket_ready_segments(cfg)
        self.grad_labels: list[str] = []
        self.waits: list[int] = []  # compute-stream dependencies of the next op
        self.last_all_reduce: int | None = None

    def build(self) -> Program:
        cfg, b = self.cfg, self.cfg.master_bytes
        self.p.initial += [
            Alloc("params", Mem.PARAMS, self.total * b),
            Alloc("buffers", Mem.PARAMS, cfg.buffer_bytes),
            Alloc("optimizer", Mem.OPTIMIZER, OPTIMIZER_STATES[cfg.optimizer] * self.total * b),
            Alloc("ddp_buckets", Mem.COMM_BUFFERS, self.total * cfg.reduce_bytes),
        ]
        for mb in range(cfg.grad_accum):
            self.saved: dict[int, str] = {}
            self.casts: dict[int, str] = {}
            self.block_inputs: dict[int, str] = {}
            self._forward(mb)
            reductions = self._backward(mb)
            # the reducer's finalize copies the buckets back into param.grad on the compute stream
            copy = self._compute(OpKind.COPY, "ddp bucket copy-out", ROOT, mb, cfg.costs.copy_s(self.total * b),
                                 deps=tuple(reductions))  # fmt: skip
            self.waits = [copy]
        temp = self.total * b if cfg.optimizer == "adamw" else 0
        self._compute(
            OpKind.OPTIMIZER, "optimizer step", ROOT, cfg.grad_accum - 1, cfg.costs.optimizer_s(self.total),
            allocs=(Alloc("optimizer_temp", Mem.OTHER, temp),), frees=("optimizer_temp", *self.grad_labels),
        )  # fmt: skip
        return self.p

    def _compute(self, kind: OpKind, name: str, unit: str, mb: int, duration_s: float, **kw: Any) -> int:
        deps = tuple(kw.pop("deps", ())) + tuple(self.waits)
        self.waits = []
        return self.p.emit(Stream.COMPUTE, kind, name, unit, mb, duration_s, deps=deps, **kw)

    def _checkpointed(self, i: int) -> bool:
        return self.cfg.checkpointing and self.cfg.segments[i].block is not None

    def _forward(self, mb: int) -> None:
        cfg, costs = self.cfg, self.cfg.costs
        for i, seg in enumerate(cfg.segments):
            allocs, frees = [], []
            if self._checkpointed(i) and seg.block not in self.block_inputs:
                self.block_inputs[seg.block] = f"block_input:{seg.block}:mb{mb}"  # type: ignore[index]
                allocs.append(Alloc(self.block_inputs[seg.block], Mem.ACTIVATIONS, cfg.block_input_bytes))  # type: ignore[index]
            label = f"act:{i}:mb{mb}"
            allocs.append(Alloc(label, Mem.ACTIVATIONS, costs.saved_bytes(seg)))
            if self._checkpointed(i):  # intermediates live only while the block runs
                frees.append(label)
            else:
                self.saved[i] = label
            if cfg.param_bytes != cfg.master_bytes:  # autocast's cast copy, saved for backward
                self.casts[i] = f"cast_params:{i}:mb{mb}"
                numel = sum(x.numel for x in seg.params)
                allocs.append(Alloc(self.casts[i], Mem.PARAMS, numel * cfg.param_bytes))
            temp = Alloc(f"fwd_temp:{i}:mb{mb}", Mem.OTHER, costs.forward_transient_bytes(seg))
            self._compute(OpKind.FORWARD, seg.name, seg.unit, mb, costs.forward_s(seg),
                          allocs=(*allocs, temp), frees=(*frees, temp.label))  # fmt: skip

    def _recompute(self, block: int, mb: int) -> None:
        costs = self.cfg.costs
        for i, seg in enumerate(self.cfg.segments):
            if seg.block == block:
                self.saved[i] = f"recomputed:{i}:mb{mb}"
                temp = Alloc(f"recompute_temp:{i}:mb{mb}", Mem.OTHER, costs.forward_transient_bytes(seg))
                self._compute(OpKind.RECOMPUTE, seg.name, seg.unit, mb, costs.recompute_s(seg),
                              allocs=(Alloc(self.saved[i], Mem.ACTIVATIONS, costs.saved_bytes(seg)), temp),
                              frees=(temp.label,))  # fmt: skip

    def _backward(self, mb: int) -> list[int]:
        cfg, costs, segs = self.cfg, self.cfg.costs, self.cfg.segments
        reductions: list[int] = []
        for i in reversed(range(len(segs))):
            seg = segs[i]
            if self._checkpointed(i) and i not in self.saved:
                self._recompute(seg.block, mb)  # type: ignore[arg-type]
            temp = Alloc(f"bwd_temp:{i}:mb{mb}", Mem.OTHER, costs.backward_transient_bytes(seg))
            grads = []
            if mb == 0:
                self.grad_labels.append(f"grads:{i}")
                grads.append(
                    Alloc(f"grads:{i}", Mem.GRADS, sum(x.numel for x in seg.params) * cfg.master_bytes)
                )
            frees = [temp.label, self.saved.pop(i)] + ([self.casts[i]] if i in self.casts else [])
            first_of_block = self._checkpointed(i) and (i == 0 or segs[i - 1].block != seg.block)
            if first_of_block:
                frees.append(self.block_inputs.pop(seg.block))  # type: ignore[arg-type]
            op = self._compute(OpKind.BACKWARD, seg.name, seg.unit, mb, costs.backward_s(seg),
                               allocs=(temp,), frees=tuple(frees), end_allocs=tuple(grads))  # fmt: skip
            reductions += self._all_reduce_ready_buckets(i, op, mb)
        return reductions

    def _all_reduce_ready_buckets(self, seg_index: int, after: int, mb: int) -> list[int]:
        cfg, ops = self.cfg, []
        for b, (ready, numel) in enumerate(self.buckets):
            if ready == seg_index:
                deps = (after,) if self.last_all_reduce is None else (after, self.last_all_reduce)
                nbytes = numel * cfg.reduce_bytes
                self.last_all_reduce = self.p.emit(
                    Stream.ALL_REDUCE, OpKind.ALL_REDUCE, f"all_reduce bucket {b}", cfg.segments[seg_index].unit,
                    mb, cfg.collective_s("all_reduce", nbytes, GroupKind.REPLICATE, cfg.reduce_dtype),
                    deps=deps, group=GroupKind.REPLICATE, bytes=nbytes, host_async=True,
                )  # fmt: skip
                ops.append(self.last_all_reduce)
        return ops


def build_ddp_program(cfg: StepConfig) -> Program:
    return DdpScheduleBuilder(cfg).build()
