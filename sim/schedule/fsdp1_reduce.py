"""FSDP1's gradient reduction on the post-backward stream (torch 2.13 ``fsdp/_runtime_utils.py``):
``_reduce_grad`` casts the flat gradient to ``reduce_dtype``, pads it to a multiple of the world
size, reduce-scatters it into a new shard (HSDP: then all-reduces it across replicas), casts it
back to fp32 and accumulates it into ``_saved_grad_shard``; ``_reduce_grad_no_shard`` (NO_SHARD)
all-reduces the whole flat gradient. The FSDP1 schedule (``sim.schedule.fsdp1``) calls it from
its post-backward hook.
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc
from sim.core.topology import GroupKind
from sim.schedule.base import ScheduleBuilder
from sim.schedule.fsdp1_flat import FlatParams


@dataclass
class GradientReduction:
    """The reductions of one FSDP1 step, issued through ``builder``."""

    builder: ScheduleBuilder
    flat: FlatParams
    padded: dict[str, int]  # unit -> its flat parameter's elements padded to the world size
    offload: bool  # CPUOffload: each reduced shard is copied to the host
    reductions: list[int] = field(default_factory=list)  # every one so far: the final callback waits
    offloaded_grads: list[str] = field(default_factory=list)  # CPUOffload: the device _saved_grad_shard

    def reduce_scatter(self, unit: str, mb: int, after: int, flat_grad: str) -> None:
        """``_reduce_grad``: cast, pad, reduce-scatter (HSDP: all-reduce), cast back, accumulate,
        and with CPUOffload the copy of the new shard to the host."""
        b, cfg, flat = self.builder, self.builder.cfg, self.flat
        padded = self.padded[unit]
        shard = padded // flat.shard_size
        allocs, frees, extra_s = self._inputs(unit, mb, flat_grad)
        out, saved, cast_s = self._output(unit, mb, shard)
        extra_s += cast_s
        output_frees = (out.label,) if out.category is Mem.COMM_BUFFERS else ()
        rs = b.collective(
            OpKind.REDUCE_SCATTER,
            Stream.REDUCE_SCATTER,
            unit,
            padded * flat.reduce_bytes[unit],
            GroupKind.SHARD,
            flat.reduce_dtype[unit],
            mb=mb,
            deps=(after,),
            allocs=(*allocs, out),
            frees=tuple(frees) + (() if cfg.hybrid else output_frees),
            end_allocs=() if cfg.hybrid else saved,
            extra_s=0.0 if cfg.hybrid else extra_s,
        )
        last = rs
        if cfg.hybrid:
            last = b.collective(
                OpKind.ALL_REDUCE,
                Stream.ALL_REDUCE,
                unit,
                shard * flat.reduce_bytes[unit],
                GroupKind.REPLICATE,
                flat.reduce_dtype[unit],
                mb=mb,
                deps=(rs,),
                frees=output_frees,
                end_allocs=saved,
                extra_s=extra_s,
            )
        self.reductions.append(last)
        if self.offload:  # ``_offload_grad``: the sharded gradient copied out to its pinned ``_cpu_grad``
            nbytes = shard * cfg.master_bytes
            d2h_s = cfg.host_costs.d2h_s(nbytes)
            d2h = b.transfer(Stream.D2H, f"d2h gradient {unit}", unit, mb, nbytes, d2h_s, deps=(last,))
            self.reductions.append(d2h)  # the final callback synchronises on it

    def all_reduce(self, unit: str, mb: int, after: int, flat_grad: str | None) -> None:
        """``_reduce_grad_no_shard``: the whole flat gradient all-reduced in ``reduce_dtype`` and
        cast back to fp32; from the second micro-batch autograd accumulates into ``.grad`` first."""
        b, cfg, flat = self.builder, self.builder.cfg, self.flat
        numel = flat.numel[unit]
        param_b, reduce_b = flat.param_bytes[unit], flat.reduce_bytes[unit]
        allocs: list[Alloc] = []
        frees: list[str] = []
        saved: tuple[Alloc, ...] = ()
        if flat_grad is not None:
            frees.append(flat_grad)
        if reduce_b != param_b:
            buffer = b.label("reduce_dtype_grad", unit, mb)
            becomes_grad = mb == 0 and reduce_b == cfg.master_bytes
            category = Mem.GRADS if becomes_grad else Mem.COMM_BUFFERS
            allocs.append(Alloc(label=buffer, category=category, bytes=numel * reduce_b))
            if becomes_grad:
                b.grad_labels.append(buffer)
            else:
                frees.append(buffer)
        if mb == 0 and param_b != cfg.master_bytes and reduce_b != cfg.master_bytes:
            label = b.label("grads", unit, mb)
            b.grad_labels.append(label)
            saved = (Alloc(label=label, category=Mem.GRADS, bytes=numel * cfg.master_bytes),)
        self.reductions.append(
            b.collective(
                OpKind.ALL_REDUCE,
                Stream.ALL_REDUCE,
                unit,
                numel * reduce_b,
                flat.reduce_group,
                flat.reduce_dtype[unit],
                mb=mb,
                deps=(after,),
                allocs=tuple(allocs),
                frees=tuple(frees),
                end_allocs=saved,
                extra_s=cfg.costs.copy_s(numel * reduce_b) if allocs or saved else 0.0,
            )
        )

    def _inputs(self, unit: str, mb: int, flat_grad: str) -> tuple[list[Alloc], list[str], float]:
        """The reduce-scatter's inputs: the cast to ``reduce_dtype`` and the world-size pad, each a
        new tensor freed with the flat gradient when the reduction is done (``record_stream``)."""
        b, cfg, flat = self.builder, self.builder.cfg, self.flat
        padded, numel = self.padded[unit], flat.numel[unit]
        param_b, reduce_b = flat.param_bytes[unit], flat.reduce_bytes[unit]
        allocs: list[Alloc] = []
        frees, extra_s = [flat_grad], 0.0
        if param_b != reduce_b:  # flat_param.grad.to(reduce_dtype)
            cast = b.label("reduce_dtype_grad", unit, mb)
            allocs.append(Alloc(label=cast, category=Mem.COMM_BUFFERS, bytes=numel * reduce_b))
            frees.append(cast)
            extra_s += cfg.costs.copy_s(numel * max(param_b, reduce_b))
        if padded > numel:  # F.pad to a multiple of the world size
            pad = b.label("padded_grad", unit, mb)
            allocs.append(Alloc(label=pad, category=Mem.COMM_BUFFERS, bytes=padded * reduce_b))
            frees.append(pad)
            extra_s += cfg.costs.copy_s(padded * reduce_b)
        return allocs, frees, extra_s

    def _output(self, unit: str, mb: int, shard: int) -> tuple[Alloc, tuple[Alloc, ...], float]:
        """The new shard the reduce-scatter writes, and (first micro-batch, cast dtype) the fp32
        tensor that becomes ``_saved_grad_shard`` after it."""
        b, cfg = self.builder, self.builder.cfg
        reduce_b = self.flat.reduce_bytes[unit]
        is_saved = mb == 0 and reduce_b == cfg.master_bytes  # becomes _saved_grad_shard
        out = b.label("sharded_grads" if is_saved else "reduce_scatter_output", unit, mb)
        category = Mem.GRADS if is_saved else Mem.COMM_BUFFERS
        keep = self.offloaded_grads if self.offload else b.grad_labels
        if is_saved:
            keep.append(out)
            return Alloc(label=out, category=category, bytes=shard * reduce_b), (), 0.0
        saved: tuple[Alloc, ...] = ()
        if mb == 0:  # cast back to fp32: the new tensor is _saved_grad_shard
            label = b.label("sharded_grads", unit, mb)
            keep.append(label)
            saved = (Alloc(label=label, category=Mem.GRADS, bytes=shard * cfg.master_bytes),)
        extra_s = cfg.costs.copy_s(shard * cfg.master_bytes) if saved else 0.0
        return Alloc(label=out, category=category, bytes=shard * reduce_b), saved, extra_s
