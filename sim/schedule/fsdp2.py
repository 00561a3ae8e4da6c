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
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind
from sim.schedule.base import Activations, ScheduleBuilder, UnitLayout
from sim.schedule.step import StepConfig
from sim.workload.units import ROOT


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


class Fsdp2ScheduleBuilder(ScheduleBuilder):
    def __init__(self, cfg: StepConfig):
        super().__init__(cfg)
        self.w = cfg.shard_size
        self.layout = UnitLayout.of(cfg)
        self.reductions: list[int] = []  # every reduction so far: the final callback waits for them
        self.mb = Microbatch(index=0)

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
        cfg, padded = self.cfg, self.layout.padded[unit]
        out = self.label("all_gather_output", unit, mb.index)
        allocs = [Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=padded * cfg.param_bytes)]
        frees = []
        if cfg.param_bytes != cfg.master_bytes:  # copy-in casts the shard to param_dtype first
            cast = self.label("all_gather_input", unit, mb.index)
            allocs.append(
                Alloc(label=cast, category=Mem.COMM_BUFFERS, bytes=padded // self.w * cfg.param_bytes)
            )
            frees.append(cast)
        # the copy-in (the shard into the send buffer, cast to param_dtype) runs just before the
        # collective on the all-gather stream: it is part of this op's time
        copy_in_s = cfg.costs.copy_s(padded // self.w * max(cfg.param_bytes, cfg.master_bytes))
        op = self.collective(
            OpKind.ALL_GATHER,
            Stream.ALL_GATHER,
            unit,
            padded * cfg.param_bytes,
            GroupKind.SHARD,
            cfg.param_dtype,
            mb=self.mb.index,
            deps=(mb.ag_wait,) if mb.ag_wait is not None else (),
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
        nbytes = self.layout.padded[unit] * self.cfg.param_bytes
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
            else:
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
            self.forward_segment(i, mb.index, mb, extra_frees=tuple(frees))
            if post_forward:
                mb.post_forward_order.append(seg.unit)
        mb.post_forward_order.append(ROOT)

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
            grads = self.label("unsharded_grads", seg.unit, mb.index)
            mb.unsharded_grads[seg.unit].append(grads)
            grad_bytes = sum(p.numel for p in seg.params) * cfg.param_bytes
            op = self.backward_segment(
                i, mb.index, mb, end_allocs=(Alloc(label=grads, category=Mem.GRADS, bytes=grad_bytes),)
            )
            if i == self.layout.first_seg[seg.unit] and self.layout.needs_grad[seg.unit]:
                self._post_backward(seg.unit)
        self._final_callback(op)

    def _post_backward(self, unit: str) -> None:
        """``post_backward``: the reduce-scatter copy-in on the compute stream, then the
        reduce-scatter (a copy on one rank) and, for HSDP, the all-reduce across replicas."""
        mb = self.mb
        if unit in mb.post_backward_done:
            return
        mb.post_backward_done.add(unit)
        cfg = self.cfg
        self.host(f"fsdp2 post-backward {unit}", unit, mb.index, cfg.costs.fsdp_backward_host_s)
        padded = self.layout.padded[unit]
        shard = padded // self.w
        frees = list(mb.unsharded_grads.pop(unit))
        if unit in mb.unsharded:
            frees.append(mb.unsharded.pop(unit))
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
            start_frees=tuple(released),
            allocs=(Alloc(label=rs_input, category=Mem.COMM_BUFFERS, bytes=padded * cfg.reduce_bytes),),
            frees=tuple(frees),
        )
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
                deps=(copy_in,),
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
                deps=(rs,),
                frees=output_frees,
            )
        mb.rs_states.append((rs, rs_input))
        self.reductions.append(last)

    def _reduce_outputs(self, unit: str, shard: int) -> tuple[tuple[Alloc, ...], tuple[str, ...]]:
        """The sharded gradients (first micro-batch) and, when cast or accumulated, a separate
        reduce-scatter output freed once the reduction is done."""
        cfg, mb = self.cfg, self.mb
        allocs, frees = [], []
        if mb.index == 0:
            grads = self.label("sharded_grads", unit, mb.index)
            self.grad_labels.append(grads)
            allocs.append(Alloc(label=grads, category=Mem.GRADS, bytes=shard * cfg.master_bytes))
        if mb.index > 0 or cfg.reduce_bytes != cfg.master_bytes:
            out = self.label("reduce_scatter_output", unit, mb.index)
            allocs.append(Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=shard * cfg.reduce_bytes))
            frees.append(out)
        return tuple(allocs), tuple(frees)

    def _final_callback(self, last_op: int) -> None:
        """The root's final callback: pending reductions (root first), the last reduce-scatter
        input dropped, and the compute stream made to wait for every reduction."""
        for unit in [ROOT] + [u.name for u in self.cfg.units if u.name != ROOT]:
            self._post_backward(unit)
        for rs_op, rs_input in self.mb.rs_states:
            self.program.add_frees(rs_op, rs_input)
        self.mb.rs_states = []
        released = self._release_deferred()
        if released is not None:
            self.program.add_frees(last_op, released)
        self.compute_waits = list(self.reductions)


def build_fsdp2_program(cfg: StepConfig) -> Program:
    return Fsdp2ScheduleBuilder(cfg).build()
