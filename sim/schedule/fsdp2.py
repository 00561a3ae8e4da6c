"""The FSDP2 schedule of one training step, written as an engine ``Program``.

It replays what ``torch.distributed.fsdp.fully_shard`` does on the host, in host order
(torch 2.13, ``_fully_shard/_fsdp_param_group.py``, ``_fsdp_state.py``, ``_fsdp_collectives.py``):
- pre-forward: ``unshard`` issues the all-gather on the all-gather stream; ``wait_for_unshard``
  copies out on the compute stream. In forward the previous unit's all-gather output is freed
  only after this copy-out, and later all-gathers wait for that copy-out (implicit prefetch).
- post-forward reshards unless ``reshard_after_forward`` is False; the root never reshards. An
  integer k (``FSDPParam.to_sharded_post_forward``) clones this rank's 1/k slice of each unsharded
  parameter (in the dtype it was gathered in) before freeing it; backward's all-gather then runs
  within the rank's group of k consecutive ranks (``_all_gather_process_group``, the post-forward
  mesh ``mesh.view(-1, k)``) from that slice, which ``to_unsharded`` frees after the copy-out.
- pre-backward re-gathers and prefetches the unit that ran before this one in forward.
- post-backward copies gradients into the reduce-scatter input on the compute stream after the
  previous unit's reduce-scatter has finished (one input buffer in flight), then reduce-scatters
  (and, for HSDP, all-reduces across replicas). Units whose input is the token ids, and the
  root, reduce in the final callback, which also makes the compute stream wait for every reduction.
Expert parallelism (``sim.workload.expert_parallel``): a block with experts is two FSDPParamGroups
(``fully_shard(block, shard_placement_fn=...)``, torch 2.13 ``_init_param_group``): its dense
parameters over the world, then its local experts over the ``world / E`` ranks holding them; each
hook runs per group (pre-forward and pre-backward in group order, the backward prefetch of the
previous block highest group first, post-backward last group first, as autograd fires them). An
all-to-all over the EP group runs before and after the experts' segment in forward, in a
checkpointed block's recompute, and in backward; the compute stream waits for each.
Collectives of one process group run one at a time in issue order, as on one NCCL communicator.
On a one-rank shard group (``world_size == 1``, or HYBRID_SHARD with ``shard_group_size = 1``)
FSDP2 issues neither all-gather nor reduce-scatter: ``wait_for_unshard`` copies each sharded
parameter into its unsharded storage, and ``foreach_reduce`` copies the reduce-scatter input into
its output (``_fsdp_param_group.py`` / ``_fsdp_collectives.py``, ``world_size == 1``).
With ``CPUOffloadPolicy`` the shards come from the host before each all-gather and the reduced
gradients go back after each reduction (``sim.schedule.fsdp2_offload``). The parameter groups
and their buffers' bytes are ``sim.schedule.fsdp2_params``'s, the reduction ``sim.schedule.fsdp2_reduce``'s.
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind
from sim.schedule.base import Activations, ScheduleBuilder, UnitLayout
from sim.schedule.fsdp2_offload import OffloadCopies
from sim.schedule.fsdp2_params import EXPERTS, ParamGroups
from sim.schedule.fsdp2_reduce import GradientReduction
from sim.schedule.model_state import numel_per_rank
from sim.schedule.step import StepConfig
from sim.workload.expert_parallel import is_expert_segment
from sim.workload.units import ROOT


@dataclass(kw_only=True)
class Microbatch(Activations):
    """FSDP2's per-micro-batch state (the FSDPParamGroups' flags and buffers between hooks)."""

    index: int
    unsharded: dict[str, str] = field(default_factory=dict)  # unit -> its unsharded parameters
    post_forward: dict[str, str] = field(default_factory=dict)  # unit -> its 1/k slice (integer reshard)
    # unit -> (all-gather op, output label); (None, None) where no all-gather runs (one rank)
    pending: dict[str, tuple[int | None, str | None]] = field(default_factory=dict)
    ag_wait: int | None = None  # the copy-out the all-gather stream waits for
    deferred: tuple[str, int] | None = None  # previous forward all-gather output and its copy-out
    rs_states: list[tuple[int, str]] = field(default_factory=list)  # reduce-scatters whose input lives
    unsharded_grads: dict[str, list[str]] = field(default_factory=dict)
    held_grads: dict[str, str] = field(default_factory=dict)  # group -> its held gradient's label
    post_forward_order: list[str] = field(default_factory=list)
    pre_backward_done: set[str] = field(default_factory=set)
    post_backward_done: set[str] = field(default_factory=set)


class Fsdp2ScheduleBuilder(ScheduleBuilder):
    def __init__(self, cfg: StepConfig):
        super().__init__(cfg)
        self.layout = UnitLayout.of(cfg)
        self.pg = ParamGroups.of(cfg)
        self.mb = Microbatch(index=0)
        offload = cfg.fsdp2_offload
        # CPUOffloadPolicy where the device is not the host: shards on the host, copies over PCIe
        self.offload = OffloadCopies(self, offload.pin_memory) if offload and cfg.fsdp2_host_state else None
        self.reduction = GradientReduction(builder=self, groups=self.pg, offload=self.offload)
        self.exchanged: list[str] = []  # all-to-all outputs the next compute op consumes

    def build(self) -> Program:
        for index in range(self.cfg.grad_accum):
            self.mb = Microbatch(index=index, unsharded_grads={g: [] for g in self.pg.unit_of})
            self._forward()
            self._backward()
        self.optimizer_step()
        return self.program

    # -- unshard ---------------------------------------------------------------------------

    def _unshard_unit(self, unit: str, *, reverse: bool = False) -> None:
        for g in reversed(self.pg.of_unit[unit]) if reverse else self.pg.of_unit[unit]:
            self._unshard(g)

    def _unshard(self, unit: str) -> None:
        """``FSDPParamGroup.unshard`` of one parameter group (``unit``: its name): the all-gather
        (its copy-in cast included), unless pending."""
        mb = self.mb
        if unit in mb.unsharded or unit in mb.pending:
            return
        if self.pg.shard_size[unit] == 1:  # no all-gather: the copy happens in wait_for_unshard
            mb.pending[unit] = (None, None)
            return
        cfg, sizes = self.cfg, self.pg.sizes[unit]
        out = self.label("all_gather_output", unit, mb.index)
        allocs = [Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=sizes.gather)]
        frees: list[str] = []
        deps = (mb.ag_wait,) if mb.ag_wait is not None else ()
        # a unit resharded to k ranks gathers from its post-forward slice, on the device and
        # already in param_dtype: no copy from the host, no cast
        from_slice = unit in mb.post_forward
        if (
            self.offload is not None and not from_slice
        ):  # the shards come from the host first, cast on the device
            h2d, consumed = self.offload.h2d(unit, mb.index, sizes.offload, deps)
            deps, frees = (h2d,), list(consumed)
        elif (
            sizes.cast and not from_slice
        ):  # copy-in casts the shards of the parameters cast to param_dtype first
            cast = self.label("all_gather_input", unit, mb.index)
            allocs.append(Alloc(label=cast, category=Mem.COMM_BUFFERS, bytes=sizes.cast))
            frees.append(cast)
        # the copy-in (the shard into the send buffer, cast to param_dtype) runs just before the
        # collective on the all-gather stream: it is part of this op's time
        copy_in_s = cfg.costs.copy_s(self._slice_bytes(unit) if from_slice else sizes.copy_in)
        op = self.collective(
            OpKind.ALL_GATHER,
            Stream.ALL_GATHER,
            self.pg.unit_of[unit],
            sizes.gather,
            GroupKind.POST_FORWARD if from_slice else self.pg.kind[unit],
            cfg.param_dtype,
            mb=self.mb.index,
            deps=deps,
            allocs=tuple(allocs),
            frees=tuple(frees),
            extra_s=copy_in_s,
            name=f"all_gather {unit}",
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
        if unit in mb.post_forward:  # to_unsharded drops the post-forward slice after the copy-out
            frees.append(mb.post_forward.pop(unit))
        nbytes = self.pg.sizes[unit].gather
        params = self.label("unsharded_params", unit, mb.index)
        # FSDP2's per-unit host work in forward rides on the pre-forward copy-out
        host_s = self.cfg.costs.fsdp_forward_overhead_s if forward else 0.0
        name = f"all_gather copy-out {unit}" if ag_op is not None else f"unshard copy {unit}"
        copy_out = self.compute(
            OpKind.COPY,
            name,
            self.pg.unit_of[unit],
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
        for g in self.pg.of_unit[unit]:  # each FSDPParamGroup's pre_forward: unshard, wait
            self._unshard(g)
            self._wait_for_unshard(g, forward=True)
        units = self.layout.forward_units
        start = units.index(unit) + 1 if unit != ROOT else 0
        for nxt in units[start : start + self.cfg.forward_prefetch]:
            self._unshard_unit(nxt)

    def _forward(self) -> None:
        cfg, layout, mb = self.cfg, self.layout, self.mb
        self._pre_forward(ROOT)
        last = len(cfg.segments) - 1
        op = -1
        for i, seg in enumerate(cfg.segments):
            if seg.unit != ROOT and i == layout.first_seg[seg.unit]:
                self._pre_forward(seg.unit)
            post_forward = seg.unit != ROOT and i == layout.last_seg[seg.unit]
            resharded = [
                g for g in self.pg.of_unit[seg.unit] if g in mb.unsharded and cfg.reshard_after_forward
            ]
            resharded = resharded if post_forward else []
            slices = cfg.post_forward_size is not None
            frees = [] if slices else [mb.unsharded.pop(g) for g in resharded]
            if i == last and (released := self._release_deferred()) is not None:
                frees.append(released)
            expert = is_expert_segment(seg, cfg.expert_modules)
            if expert:
                self._all_to_all("dispatch", seg.unit, after=op)
            op = self._consume(self.forward_segment(i, mb.index, mb, extra_frees=tuple(frees)))
            if expert:
                self._all_to_all("combine", seg.unit, after=op)
            for g in resharded if slices else []:
                self._reshard_to_slice(g)
            if post_forward:
                mb.post_forward_order.append(seg.unit)
        mb.post_forward_order.append(ROOT)
        # the host issues the backward's first all-gathers (the root's pre-backward prefetch) after
        # the whole forward, whose last transients (the loss's) it has freed by then: FSDP2
        # allocates in host order, so the all-gather stream waits for the forward's end
        mb.ag_wait = op

    def _all_to_all(self, what: str, unit: str, *, after: int) -> None:
        """Expert parallelism's token exchange over the EP group (torchtitan ``ExpertParallel``:
        ``_token_dispatch`` / ``_token_combine``, ``all_to_all_single_autograd``; autograd runs each
        again in backward): after the compute op ``after``, and the next compute op waits for it.
        Its output, a new tensor of the same rows, lives until that op ends (``_consume``)."""
        cfg, mb = self.cfg, self.mb
        out = self.label(f"all_to_all_{what.replace(' ', '_')}", unit, mb.index)
        op = self.collective(
            OpKind.ALL_TO_ALL,
            Stream.ALL_TO_ALL,
            unit,
            cfg.dispatch_bytes,
            GroupKind.EXPERT,
            cfg.param_dtype,
            mb=mb.index,
            deps=(after,) if after >= 0 else (),
            allocs=(Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=cfg.dispatch_bytes),),
            name=f"all_to_all {what} {unit}",
        )
        self.compute_waits.append(op)
        self.exchanged.append(out)

    def _consume(self, op: int) -> int:
        """The compute op ``op`` consumed the all-to-all outputs issued before it: freed when it ends."""
        if self.exchanged:
            self.program.add_frees(op, *self.exchanged)
            self.exchanged = []
        return op

    def _slice_bytes(self, unit: str) -> int:
        """A unit's post-forward slice: 1/k of its unsharded parameters (k divides the padding)."""
        assert self.cfg.post_forward_size is not None
        return self.pg.sizes[unit].gather // self.cfg.post_forward_size

    def _reshard_to_slice(self, unit: str) -> None:
        """``to_sharded_post_forward``: clone this rank's 1/k of the unsharded parameters, then
        free them (on the compute stream, right after the unit's forward)."""
        mb = self.mb
        nbytes = self._slice_bytes(unit)
        label = self.label("post_forward_params", unit, mb.index)
        self.compute(
            OpKind.COPY,
            f"reshard to {self.cfg.post_forward_size} ranks {unit}",
            unit,
            mb.index,
            self.cfg.costs.copy_s(nbytes),
            allocs=(Alloc(label=label, category=Mem.PARAMS, bytes=nbytes),),
            frees=(mb.unsharded.pop(unit),),
        )
        mb.post_forward[unit] = label

    # -- backward --------------------------------------------------------------------------

    def _pre_backward(self, unit: str) -> None:
        mb = self.mb
        if unit in mb.pre_backward_done:
            return
        mb.pre_backward_done.add(unit)
        for g in self.pg.of_unit[unit]:
            self._unshard(g)
            self._wait_for_unshard(g, forward=False)
        order = mb.post_forward_order
        index = len(order) - 1 - order[::-1].index(unit)
        # two groups per unit (EP): the last prefetches the previous unit's, highest index first
        for target in order[max(0, index - self.cfg.backward_prefetch) : index][::-1]:
            self._unshard_unit(target, reverse=True)

    def _before_recompute(self, i: int, mb: int) -> None:
        """Full checkpointing runs the block's forward again: its forward hooks (the unit gathered
        again; post-forward skips the reshard) and its all-to-alls included."""
        seg = self.cfg.segments[i]
        unit = seg.unit
        if unit != ROOT and unit not in self.mb.pre_backward_done:
            for g in self.pg.of_unit[unit]:
                self._unshard(g)
                self._wait_for_unshard(g, forward=True)
        if is_expert_segment(seg, self.cfg.expert_modules):
            self._all_to_all("dispatch recompute", unit, after=self.compute_tail)

    def _after_recompute(self, i: int, op: int) -> None:
        seg = self.cfg.segments[i]
        self._consume(op)
        if is_expert_segment(seg, self.cfg.expert_modules):
            self._all_to_all("combine recompute", seg.unit, after=op)

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
            expert = is_expert_segment(seg, cfg.expert_modules)
            group = seg.unit + EXPERTS if expert else seg.unit
            if grad_bytes or not cfg.finetuned:  # frozen parameters leave no gradient
                grads = self._segment_grads(i, group, grad_bytes)
            in_place = grad_bytes if self.reduction.accumulates_in_place(group) else 0
            if expert:
                self._all_to_all("combine backward", seg.unit, after=op)
            op = self._consume(
                self.backward_segment(i, mb.index, mb, end_allocs=grads, in_place_grad_bytes=in_place)
            )
            if expert:
                self._all_to_all("dispatch backward", seg.unit, after=op)
            if i == self.layout.first_seg[seg.unit] and self.layout.needs_grad[seg.unit]:
                self._post_backward(seg.unit, op)
        self._final_callback(op)

    def _segment_grads(self, i: int, group: str, grad_bytes: int) -> tuple[Alloc, ...]:
        """The unsharded gradients segment ``i``'s backward leaves for ``group``: one buffer, and
        apart from it the gradient ``foreach_reduce`` holds past the copy-in (``ParamGroups.held_grad``)
        where this segment makes it."""
        mb, cfg = self.mb, self.cfg
        unit = cfg.segments[i].unit
        if self.reduction.accumulates_in_place(group):  # added into the kept ones as they are made
            return ()
        held_name = self.pg.held_grad.get(group)
        held = next((p for p in cfg.gradient_params[i] if p.trainable and p.name == held_name), None)
        held_bytes = held.numel * cfg.param_bytes if held is not None else 0
        label = self.label("unsharded_grads", unit, mb.index)
        allocs = [Alloc(label=label, category=Mem.GRADS, bytes=grad_bytes - held_bytes)]
        if held is not None:
            mb.held_grads[group] = self.label("held_grad", unit, mb.index)
            allocs.append(Alloc(label=mb.held_grads[group], category=Mem.GRADS, bytes=held_bytes))
        allocs = [a for a in allocs if a.bytes or not cfg.finetuned]
        mb.unsharded_grads[group].extend(a.label for a in allocs)
        return tuple(allocs)

    def _post_backward(self, unit: str, after: int) -> None:
        """``post_backward``: the reduce-scatter copy-in on the compute stream, then the
        reduce-scatter (a copy on one rank) and, for HSDP, the all-reduce across replicas. A unit
        without gradients (only frozen parameters) just reshards when ``after`` ends."""
        mb = self.mb
        if unit in mb.post_backward_done:
            return
        mb.post_backward_done.add(unit)
        self.host(f"fsdp2 post-backward {unit}", unit, mb.index, self.cfg.costs.fsdp_backward_host_s)
        for g in reversed(self.pg.of_unit[unit]):  # autograd runs the last group's hook first
            self._post_backward_group(g, after)

    def _post_backward_group(self, group: str, after: int) -> None:
        """One parameter group's ``post_backward``: its unsharded parameters and gradients dropped,
        the gradients reduced (``sim.schedule.fsdp2_reduce``)."""
        mb = self.mb
        grads = mb.unsharded_grads.pop(group)
        frees = list(grads)
        if group in mb.unsharded:
            # ``reshard()`` comes before ``foreach_reduce``: the unsharded parameters are dropped
            # once the backward that read them has made its gradients, before the copy-in allocates
            self.program.add_frees(after, mb.unsharded.pop(group), after_outputs=True)
        if not self.pg.sizes[group].grad_padded:  # no gradient: FSDP2 reshards and returns before reducing
            self.program.add_frees(after, *frees)
            return
        held = mb.held_grads.pop(group, None)
        mb.rs_states = self.reduction.post_backward(group, mb.index, grads, frees, mb.rs_states, held)

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
        self.compute_waits = list(self.reduction.reductions)

    def optimizer_step(self) -> None:
        if self.offload is None:
            super().optimizer_step()
        else:
            self.offload.optimizer_step(self.cfg.grad_accum - 1, numel_per_rank(self.cfg))


def build_fsdp2_program(cfg: StepConfig) -> Program:
    return Fsdp2ScheduleBuilder(cfg).build()
