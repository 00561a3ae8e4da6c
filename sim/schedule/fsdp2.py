"""The FSDP2 schedule of one training step, written as an engine ``Program``.

It replays what ``torch.distributed.fsdp.fully_shard`` does on the host, in host order
(torch 2.13, ``_fully_shard/_fsdp_param_group.py``, ``_fsdp_state.py``, ``_fsdp_collectives.py``):
- pre-forward: ``unshard`` issues the all-gather on the all-gather stream; ``wait_for_unshard``
  copies out on the compute stream. In forward the previous unit's all-gather output is freed
  only after this copy-out, and later all-gathers wait for that copy-out (implicit prefetch).
- post-forward reshards unless ``reshard_after_forward`` is False; the root never reshards.
- pre-backward re-gathers and prefetches the unit that ran before this one in forward.
- post-backward copies gradients into the reduce-scatter input on the compute stream after the
  previous unit's reduce-scatter has finished (one input buffer in flight), then reduce-scatters
  (and, for HSDP, all-reduces across replicas). Units whose input is the token ids, and the
  root, reduce in the final callback, which also makes the compute stream wait for every reduction.
Collectives of one process group run one at a time in issue order, as on one NCCL communicator.
On a one-rank shard group (``world_size == 1``, or HYBRID_SHARD with ``shard_group_size = 1``)
FSDP2 issues neither all-gather nor reduce-scatter: ``wait_for_unshard`` copies each sharded
parameter into its unsharded storage, and ``foreach_reduce`` copies the reduce-scatter input into
its output (``_fsdp_param_group.py`` / ``_fsdp_collectives.py``, ``world_size == 1``).
With ``CPUOffloadPolicy`` the shards come from the host before each all-gather and the reduced
gradients go back after each reduction (``sim.schedule.fsdp2_offload``).
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind
from sim.dtypes import FLOAT_DTYPES
from sim.schedule.base import Activations, ScheduleBuilder, UnitLayout
from sim.schedule.fsdp2_offload import OffloadBytes, OffloadCopies
from sim.schedule.model_state import numel_per_rank, stored_bytes
from sim.schedule.step import StepConfig
from sim.workload.params import ParamSpec
from sim.workload.units import ROOT, WrapUnit, padded_numel


@dataclass(kw_only=True)
class Microbatch(Activations):
    """FSDP2's per-micro-batch state (the FSDPParamGroups' flags and buffers between hooks)."""

    index: int
    unsharded: dict[str, str] = field(default_factory=dict)  # unit -> its unsharded parameters
    # unit -> (all-gather op, output label); (None, None) where no all-gather runs (one rank)
    pending: dict[str, tuple[int | None, str | None]] = field(default_factory=dict)
    ag_wait: int | None = None  # the copy-out the all-gather stream waits for
    deferred: tuple[str, int] | None = None  # previous forward all-gather output and its copy-out
    rs_states: list[tuple[int, str]] = field(default_factory=list)  # reduce-scatters whose input lives
    unsharded_grads: dict[str, list[str]] = field(default_factory=dict)
    post_forward_order: list[str] = field(default_factory=list)
    pre_backward_done: set[str] = field(default_factory=set)
    post_backward_done: set[str] = field(default_factory=set)


def cast_to_param_dtype(cfg: StepConfig, p: ParamSpec) -> bool:
    """FSDP2 casts a parameter to ``param_dtype`` when it is a float of another dtype
    (``FSDPParam.init_dtype_attrs``): the fp32 trainable ones under mixed precision."""
    stored = p.dtype or "fp32"
    return stored in FLOAT_DTYPES and stored != cfg.param_dtype


def gathered_bytes(cfg: StepConfig, p: ParamSpec) -> int:
    """Bytes per element FSDP2 all-gathers and unshards ``p`` in."""
    return cfg.param_bytes if cast_to_param_dtype(cfg, p) else stored_bytes(cfg, p)


@dataclass(frozen=True, kw_only=True)
class UnitBytes:
    """One unit's FSDP2 buffers: the all-gather output (= its unsharded parameters), the copy-in
    cast buffer of the parameters cast to ``param_dtype``, the bytes the copy-in reads, and the
    padded elements with gradients (what it reduce-scatters)."""

    gather: int
    cast: int
    copy_in: int
    grad_padded: int
    grad_numel: int  # the unsharded gradients (what accumulates without gradient sync)
    offload: OffloadBytes  # CPUOffloadPolicy: the shards' copy to the device

    @staticmethod
    def of(cfg: StepConfig, unit: WrapUnit) -> "UnitBytes":
        w = cfg.shard_size
        pad = [(p, padded_numel(p, w)) for p in unit.params]
        return UnitBytes(
            gather=sum(n * gathered_bytes(cfg, p) for p, n in pad),
            cast=sum(n // w * cfg.param_bytes for p, n in pad if cast_to_param_dtype(cfg, p)),
            copy_in=sum(n // w * max(gathered_bytes(cfg, p), stored_bytes(cfg, p)) for p, n in pad),
            grad_padded=sum(n for p, n in pad if p.trainable),
            grad_numel=sum(p.numel for p in unit.params if p.trainable),
            offload=OffloadBytes(
                h2d=sum(n // w * stored_bytes(cfg, p) for p, n in pad),
                kept=sum(n // w * stored_bytes(cfg, p) for p, n in pad if not cast_to_param_dtype(cfg, p)),
                cast=sum(n // w * cfg.param_bytes for p, n in pad if cast_to_param_dtype(cfg, p)),
                staging=max(
                    (n // w * stored_bytes(cfg, p) for p, n in pad if cast_to_param_dtype(cfg, p)), default=0
                ),
            ),
        )


class Fsdp2ScheduleBuilder(ScheduleBuilder):
    def __init__(self, cfg: StepConfig):
        super().__init__(cfg)
        self.w = cfg.shard_size
        self.layout = UnitLayout.of(cfg)
        self.sizes = {u.name: UnitBytes.of(cfg, u) for u in cfg.units}  # the parameters' bytes by dtype
        self.reductions: list[int] = []  # every reduction so far: the final callback waits for them
        self.accumulated: dict[str, str] = {}  # unit -> its unsharded gradients kept across micro-batches
        self.reduced: set[str] = set()  # units reduced once already (their sharded gradients exist)
        self.mb = Microbatch(index=0)
        offload = cfg.fsdp2_offload
        # CPUOffloadPolicy where the device is not the host: shards on the host, copies over PCIe
        self.offload = OffloadCopies(self, offload.pin_memory) if offload and cfg.fsdp2_host_state else None

    def build(self) -> Program:
        for index in range(self.cfg.grad_accum):
            self.mb = Microbatch(index=index, unsharded_grads={u.name: [] for u in self.cfg.units})
            self._forward()
            self._backward()
        self.optimizer_step()
        return self.program

    # -- unshard ---------------------------------------------------------------------------

    def _unshard(self, unit: str) -> None:
        """``FSDPParamGroup.unshard``: the all-gather (its copy-in cast included), unless pending."""
        mb = self.mb
        if unit in mb.unsharded or unit in mb.pending:
            return
        if self.w == 1:  # no all-gather: the copy happens in wait_for_unshard
            mb.pending[unit] = (None, None)
            return
        cfg, sizes = self.cfg, self.sizes[unit]
        out = self.label("all_gather_output", unit, mb.index)
        allocs = [Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=sizes.gather)]
        frees: list[str] = []
        deps = (mb.ag_wait,) if mb.ag_wait is not None else ()
        if self.offload is not None:  # the shards come from the host first, cast on the device
            h2d, consumed = self.offload.h2d(unit, mb.index, sizes.offload, deps)
            deps, frees = (h2d,), list(consumed)
        elif sizes.cast:  # copy-in casts the shards of the parameters cast to param_dtype first
            cast = self.label("all_gather_input", unit, mb.index)
            allocs.append(Alloc(label=cast, category=Mem.COMM_BUFFERS, bytes=sizes.cast))
            frees.append(cast)
        # the copy-in (the shard into the send buffer, cast to param_dtype) runs just before the
        # collective on the all-gather stream: it is part of this op's time
        copy_in_s = cfg.costs.copy_s(sizes.copy_in)
        op = self.collective(
            OpKind.ALL_GATHER,
            Stream.ALL_GATHER,
            unit,
            sizes.gather,
            GroupKind.SHARD,
            cfg.param_dtype,
            mb=self.mb.index,
            deps=deps,
            allocs=tuple(allocs),
            frees=tuple(frees),
            extra_s=copy_in_s,
        )
        mb.pending[unit] = (op, out)

    def _wait_for_unshard(self, unit: str, *, forward: bool) -> None:
        """``wait_for_unshard``: the copy-out into the unsharded parameters, on the compute stream."""
        mb = self.mb
        if unit not in mb.pending:
            return
        ag_op, out = mb.pending.pop(unit)
        frees: list[str] = []
        if forward and mb.deferred is not None:
            frees.append(mb.deferred[0])
            mb.ag_wait = mb.deferred[1]
            mb.deferred = None
        if not forward and out is not None:
            frees.append(out)
        nbytes = self.sizes[unit].gather
        params = self.label("unsharded_params", unit, mb.index)
        # FSDP2's per-unit host work in forward rides on the pre-forward copy-out
        host_s = self.cfg.costs.fsdp_forward_overhead_s if forward else 0.0
        name = f"all_gather copy-out {unit}" if ag_op is not None else f"unshard copy {unit}"
        copy_out = self.compute(
            OpKind.COPY,
            name,
            unit,
            mb.index,
            self.cfg.costs.copy_s(nbytes) + host_s,
            deps=(ag_op,) if ag_op is not None else (),
            allocs=(Alloc(label=params, category=Mem.PARAMS, bytes=nbytes),),
            frees=tuple(frees),
        )
        if out is not None:
            if forward:
                mb.deferred = (out, copy_out)
            # the next all-gather starts after this copy-out: FSDP2 allocates in host order, where
            # the previous unit's all-gather output is freed here, before the next is allocated
            mb.ag_wait = copy_out
        mb.unsharded[unit] = params

    def _release_deferred(self) -> str | None:
        """The root's post-forward (and the end of backward) drop the last deferred all-gather
        output; returns its label, freed when the current op ends."""
        mb = self.mb
        if mb.deferred is None:
            return None
        out, copy_out = mb.deferred
        mb.ag_wait, mb.deferred = copy_out, None
        return out

    # -- forward ---------------------------------------------------------------------------

    def _pre_forward(self, unit: str) -> None:
        self.host(f"fsdp2 pre-forward {unit}", unit, self.mb.index, self.cfg.costs.fsdp_forward_host_s)
        self._unshard(unit)
        self._wait_for_unshard(unit, forward=True)
        units = self.layout.forward_units
        start = units.index(unit) + 1 if unit != ROOT else 0
        for nxt in units[start : start + self.cfg.forward_prefetch]:
            self._unshard(nxt)

    def _forward(self) -> None:
        cfg, layout, mb = self.cfg, self.layout, self.mb
        self._pre_forward(ROOT)
        last = len(cfg.segments) - 1
        for i, seg in enumerate(cfg.segments):
            if seg.unit != ROOT and i == layout.first_seg[seg.unit]:
                self._pre_forward(seg.unit)
            post_forward = seg.unit != ROOT and i == layout.last_seg[seg.unit]
            frees = []
            if post_forward and cfg.reshard_after_forward and seg.unit in mb.unsharded:
                frees.append(mb.unsharded.pop(seg.unit))
            if i == last and (released := self._release_deferred()) is not None:
                frees.append(released)
            op = self.forward_segment(i, mb.index, mb, extra_frees=tuple(frees))
            if post_forward:
                mb.post_forward_order.append(seg.unit)
        mb.post_forward_order.append(ROOT)
        # the host issues the backward's first all-gathers (the root's pre-backward prefetch) after
        # the whole forward, whose last transients (the loss's) it has freed by then: FSDP2
        # allocates in host order, so the all-gather stream waits for the forward's end
        mb.ag_wait = op

    # -- backward --------------------------------------------------------------------------

    def _pre_backward(self, unit: str) -> None:
        mb = self.mb
        if unit in mb.pre_backward_done:
            return
        mb.pre_backward_done.add(unit)
        self._unshard(unit)
        self._wait_for_unshard(unit, forward=False)
        order = mb.post_forward_order
        index = len(order) - 1 - order[::-1].index(unit)
        for target in order[max(0, index - self.cfg.backward_prefetch) : index][::-1]:
            self._unshard(target)

    def _on_recompute_segment(self, unit: str, mb: int) -> None:
        if unit != ROOT and unit not in self.mb.pre_backward_done:
            self._unshard(unit)  # forward hooks run again; post-forward skips the reshard
            self._wait_for_unshard(unit, forward=True)

    def _backward(self) -> None:
        cfg, mb = self.cfg, self.mb
        self._pre_backward(ROOT)
        recomputed: set[int] = set()
        op = -1
        for i in reversed(range(len(cfg.segments))):
            seg = cfg.segments[i]
            if self.checkpointed(i) and seg.block not in recomputed:
                self._pre_backward(seg.unit)
                self.recompute_block(seg.block, mb.index, mb)  # type: ignore[arg-type]
                recomputed.add(seg.block)  # type: ignore[arg-type]
            self._pre_backward(seg.unit)
            grad_bytes = sum(p.numel for p in cfg.gradient_params[i] if p.trainable) * cfg.param_bytes
            grads: tuple[Alloc, ...] = ()
            if grad_bytes or not cfg.finetuned:  # frozen parameters leave no gradient
                label = self.label("unsharded_grads", seg.unit, mb.index)
                mb.unsharded_grads[seg.unit].append(label)
                grads = (Alloc(label=label, category=Mem.GRADS, bytes=grad_bytes),)
            op = self.backward_segment(i, mb.index, mb, end_allocs=grads)
            if i == self.layout.first_seg[seg.unit] and self.layout.needs_grad[seg.unit]:
                self._post_backward(seg.unit, op)
        self._final_callback(op)

    def _post_backward(self, unit: str, after: int) -> None:
        """``post_backward``: the reduce-scatter copy-in on the compute stream, then the
        reduce-scatter (a copy on one rank) and, for HSDP, the all-reduce across replicas. A unit
        without gradients (only frozen parameters) just reshards when ``after`` ends."""
        mb = self.mb
        if unit in mb.post_backward_done:
            return
        mb.post_backward_done.add(unit)
        cfg = self.cfg
        self.host(f"fsdp2 post-backward {unit}", unit, mb.index, cfg.costs.fsdp_backward_host_s)
        padded = self.sizes[unit].grad_padded
        shard = padded // self.w
        grads = mb.unsharded_grads.pop(unit)
        frees = list(grads)
        if unit in mb.unsharded:
            frees.append(mb.unsharded.pop(unit))
        if not padded:  # no gradient: FSDP2 reshards and returns before reducing
            self.program.add_frees(after, *frees)
            return
        if not (cfg.sync_every_microbatch or mb.index == cfg.grad_accum - 1):
            self._accumulate(unit, frees)
            return
        added: list[str] = []
        if unit in self.accumulated:  # this backward's gradients are added into the kept ones first
            added = grads
            frees = [f for f in frees if f not in added] + [self.accumulated.pop(unit)]
        # one reduce-scatter input in flight (set_reduce_scatter_max_input_buffers): the compute
        # stream waits for the previous reduce-scatter and drops its input before allocating this one
        deps, released = [op for op, _ in mb.rs_states], [label for _, label in mb.rs_states]
        mb.rs_states = []
        rs_input = self.label("reduce_scatter_input", unit, mb.index)
        # the copy-in, and FSDP2's per-unit host work in backward (pre-backward unshard, post-backward reduce)
        copy_in_s = (
            cfg.costs.copy_s(padded * max(cfg.param_bytes, cfg.reduce_bytes))
            + cfg.costs.fsdp_backward_overhead_s
        )
        allocs, output_frees = self._reduce_outputs(unit, shard)
        copy_in = self.compute(
            OpKind.COPY,
            f"reduce_scatter copy-in {unit}",
            unit,
            mb.index,
            copy_in_s,
            deps=tuple(deps),
            start_frees=(*released, *added),
            allocs=(Alloc(label=rs_input, category=Mem.COMM_BUFFERS, bytes=padded * cfg.reduce_bytes),),
            frees=tuple(frees),
        )
        mb.rs_states.append((self._reduce(unit, copy_in, shard, allocs, output_frees), rs_input))

    def _reduce(
        self, unit: str, copy_in: int, shard: int, allocs: tuple[Alloc, ...], output_frees: tuple[str, ...]
    ) -> int:
        """The reduce-scatter (a copy on one rank), HSDP's all-reduce, and with CPU offload the copy of
        the reduced shard to the host on the post-reduce stream; returns the reduce-scatter."""
        cfg, mb = self.cfg, self.mb
        padded = shard * self.w
        tail = (
            ()
            if self.offload is None or self.offload.reduce_stream_tail is None
            else (self.offload.reduce_stream_tail,)
        )
        device_frees, output_frees = (output_frees, ()) if self.offload is not None else ((), output_frees)
        rs_frees = () if cfg.hybrid else output_frees
        if self.w == 1:  # no reduce-scatter: the input is copied into the output
            rs = self.compute(
                OpKind.COPY,
                f"reduce copy {unit}",
                unit,
                mb.index,
                cfg.costs.copy_s(padded * cfg.reduce_bytes),
                deps=(copy_in,),
                allocs=allocs,
                frees=rs_frees,
            )
        else:
            rs = self.collective(
                OpKind.REDUCE_SCATTER,
                Stream.REDUCE_SCATTER,
                unit,
                padded * cfg.reduce_bytes,
                GroupKind.SHARD,
                cfg.reduce_dtype,
                mb=self.mb.index,
                deps=(copy_in,) if cfg.hybrid else (copy_in, *tail),
                allocs=allocs,
                frees=rs_frees,
            )
        last = rs
        if cfg.hybrid:
            last = self.collective(
                OpKind.ALL_REDUCE,
                Stream.ALL_REDUCE,
                unit,
                shard * cfg.reduce_bytes,
                GroupKind.REPLICATE,
                cfg.reduce_dtype,
                mb=self.mb.index,
                deps=(rs, *tail),
                frees=output_frees,
            )
        if self.offload is not None:  # the post-reduce event is recorded after the copy to the host
            last = self.offload.d2h(unit, mb.index, shard * cfg.master_bytes, last, device_frees)
        self.reductions.append(last)
        return rs

    def _accumulate(self, unit: str, frees: list[str]) -> None:
        """``set_requires_gradient_sync(False)``: post-backward reshards and keeps the unsharded
        gradients (``to_accumulated_grad_if_needed``: cast to ``reduce_dtype`` when it differs), and
        later micro-batches add theirs into them; one reduction on the last micro-batch."""
        cfg, mb = self.cfg, self.mb
        acc_bytes = cfg.reduce_bytes if cfg.reduce_dtype != cfg.param_dtype else cfg.param_bytes
        nbytes = self.sizes[unit].grad_numel * acc_bytes
        allocs: tuple[Alloc, ...] = ()
        if unit not in self.accumulated:
            self.accumulated[unit] = self.label("accumulated_grads", unit, mb.index)
            allocs = (Alloc(label=self.accumulated[unit], category=Mem.GRADS, bytes=nbytes),)
        self.compute(
            OpKind.COPY,
            f"accumulate grads {unit}",
            unit,
            mb.index,
            cfg.costs.copy_s(nbytes),
            allocs=allocs,
            frees=tuple(frees),
        )

    def _reduce_outputs(self, unit: str, shard: int) -> tuple[tuple[Alloc, ...], tuple[str, ...]]:
        """The sharded gradients (the unit's first reduction) and, when cast or accumulated, a
        separate reduce-scatter output freed once the reduction is done."""
        cfg, mb = self.cfg, self.mb
        allocs, frees = [], []
        if self.offload is not None:  # CPUOffloadPolicy: the sharded gradients live on the host
            out = self.label("reduce_scatter_output", unit, mb.index)
            return (Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=shard * cfg.reduce_bytes),), (out,)
        first = unit not in self.reduced
        self.reduced.add(unit)
        if first:
            grads = self.label("sharded_grads", unit, mb.index)
            self.grad_labels.append(grads)
            allocs.append(Alloc(label=grads, category=Mem.GRADS, bytes=shard * cfg.master_bytes))
        if not first or cfg.reduce_bytes != cfg.master_bytes:
            out = self.label("reduce_scatter_output", unit, mb.index)
            allocs.append(Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=shard * cfg.reduce_bytes))
            frees.append(out)
        return tuple(allocs), tuple(frees)

    def _final_callback(self, last_op: int) -> None:
        """The root's final callback: pending reductions (root first), the last reduce-scatter
        input dropped, and the compute stream made to wait for every reduction."""
        for unit in [ROOT] + [u.name for u in self.cfg.units if u.name != ROOT]:
            self._post_backward(unit, last_op)
        for rs_op, rs_input in self.mb.rs_states:
            self.program.add_frees(rs_op, rs_input)
        self.mb.rs_states = []
        released = self._release_deferred()
        if released is not None:
            self.program.add_frees(last_op, released)
        self.compute_waits = list(self.reductions)

    def optimizer_step(self) -> None:
        if self.offload is None:
            super().optimizer_step()
        else:
            self.offload.optimizer_step(self.cfg.grad_accum - 1, numel_per_rank(self.cfg))


def build_fsdp2_program(cfg: StepConfig) -> Program:
    return Fsdp2ScheduleBuilder(cfg).build()
