"""The FSDP1 schedule of one training step (``torch.distributed.fsdp.FullyShardedDataParallel``).

It replays the host order of torch 2.13's ``fsdp/_runtime_utils.py`` over one ``FlatParameter``
per wrapped module (``fsdp/_flat_param.py``):
- ``_unshard``: ``pre_unshard`` (mixed precision: the fp32 shard cast into ``_mp_shard`` on the
  pre-unshard stream), the rate limiter (``limit_all_gathers``: before a third all-gather the host
  waits for the free event of the unit resharded two frees ago, ``_limiter_utils._FreeEventQueue``),
  then the all-gather straight into the padded unsharded flat parameter on the unshard stream;
  the ``_mp_shard`` is freed after it (``post_unshard``). No copy-out: the parameters are views.
- pre-forward: unshard unless prefetched, the compute stream waits for the unshard stream, then
  ``forward_prefetch`` unshards the next unit of the pre-forward order (the root first).
- post-forward: FULL_SHARD and HYBRID_SHARD free the unsharded flat parameter (not the root);
  the free is recorded as an event for the rate limiter.
- pre-backward (a hook on the unit's outputs; the root's fires first): unshard unless
  prefetched, wait, and with ``BACKWARD_PRE`` prefetch the unit before it in post-forward order.
- post-backward (on the flat parameter's ``AccumulateGrad``, once autograd's split backward has
  concatenated the views' gradients into one flat gradient): reshard (every sharded strategy
  frees in backward), ``BACKWARD_POST`` prefetch, then on the post-backward stream the cast to
  ``reduce_dtype``, the pad to the world-size multiple, the reduce-scatter into a new shard (HSDP:
  then an all-reduce across replicas), the cast back to fp32 and the accumulation into
  ``_saved_grad_shard``. NO_SHARD all-reduces the whole flat gradient instead. The unsharded
  gradients live until the reduction has consumed them (``record_stream``).
- the root's final callback makes the compute stream wait for the post-backward and all-reduce
  streams, and ``_catch_all_reshard`` frees what no hook resharded.
- A frozen ``FlatParameter`` (LoRA's base under PEFT's wrap policy, ``requires_grad=False``) has
  no post-backward hook and no gradient: ``_register_post_backward_reshard_only_hook`` reshards it
  once its unit's inputs have their gradients, i.e. right after its backward; where no input needs
  one (the first block, fed by the frozen embedding; the root) the final callback's catch-all does.
  Its unsharded flat parameter is in its own dtype, cast only where that differs from ``param_dtype``.
Collectives of one process group run one at a time in issue order (one communicator). The
flat parameters' facts are ``sim.schedule.fsdp1_flat``'s, the reduction ``sim.schedule.fsdp1_reduce``'s.
"""

from collections import deque
from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind
from sim.schedule.base import Activations, ScheduleBuilder, UnitLayout
from sim.schedule.fsdp1_flat import FlatParams
from sim.schedule.fsdp1_reduce import GradientReduction
from sim.schedule.model_state import numel_per_rank
from sim.schedule.step import StepConfig
from sim.workload.options import BackwardPrefetch, Fsdp1Options
from sim.workload.units import ROOT

MAX_INFLIGHT_ALL_GATHERS = 2  # _FreeEventQueue._max_num_inflight_all_gathers ("empirically chosen")


@dataclass(kw_only=True)
class Microbatch(Activations):
    """The handles' flags and buffers between hooks, for one micro-batch."""

    index: int
    unsharded: dict[str, str] = field(default_factory=dict)  # unit -> its unsharded flat parameter
    prefetched: set[str] = field(default_factory=set)  # FlatParamHandle._prefetched
    needs_pre_forward: set[str] = field(default_factory=set)  # _needs_pre_forward_unshard
    needs_pre_backward: set[str] = field(default_factory=set)  # _needs_pre_backward_unshard
    view_grads: dict[str, list[str]] = field(default_factory=dict)  # the views' gradients, per unit
    post_forward_order: list[str] = field(default_factory=list)
    pre_backward_done: set[str] = field(default_factory=set)


class Fsdp1ScheduleBuilder(ScheduleBuilder):
    def __init__(self, cfg: StepConfig):
        super().__init__(cfg)
        assert cfg.fsdp1 is not None
        self.opts: Fsdp1Options = cfg.fsdp1
        self.layout = UnitLayout.of(cfg)
        self.flat = FlatParams.of(cfg)
        self.reduction = GradientReduction(
            builder=self, flat=self.flat, padded=self.layout.padded, offload=self.opts.offload_params
        )
        self.catch_all: list[str] = []  # frozen units the final callback's catch-all reshards
        self.free_events: deque[int] = deque()  # the rate limiter's queue of free events
        self.last_unshard: int | None = None  # the unshard stream's last op: what compute waits for
        self.unshard_after: int | None = None  # the unshard streams wait for this compute op
        self.last_compute: int | None = None
        self.mb = Microbatch(index=0)
        # each block's own unit: the owner of its first segment (the root's under ``linear`` wrap)
        self.block_owner: dict[int | None, str] = {}
        for seg in cfg.segments:
            self.block_owner.setdefault(seg.block, seg.unit)

    def build(self) -> Program:
        units = [u.name for u in self.cfg.units]
        for index in range(self.cfg.grad_accum):
            self.mb = Microbatch(index=index, view_grads={u: [] for u in units})
            if self.opts.forward_prefetch:
                self.mb.needs_pre_forward = set(units)
            self._forward()
            self._backward()
        if self.opts.offload_params:
            self._host_optimizer_step()
        else:
            self.optimizer_step()
        return self.program

    def _host_optimizer_step(self) -> None:
        """CPUOffload: ``prepare_gradient_for_optim`` drops the device gradients (``.grad`` is the
        pinned ``_cpu_grad``) and the optimizer steps the CPU shards (``torch.optim.AdamW``)."""
        cfg = self.cfg
        last = self.compute(OpKind.COPY, "prepare_gradient_for_optim", ROOT, cfg.grad_accum - 1, 0.0)
        self.program.add_frees(last, *self.reduction.offloaded_grads)
        cost_s = cfg.host_costs.cpu_torch_optimizer_s(cfg.optimizer, numel_per_rank(cfg))
        self.host_optimizer("optimizer step (CPU)", cfg.grad_accum - 1, cost_s, (last,))

    def _compute(self, op: int) -> int:
        self.last_compute = op
        return op

    # -- unshard and reshard -------------------------------------------------------------

    def _unshard(self, unit: str) -> None:
        """``_unshard``: pre-unshard (the cast), the rate limiter, the all-gather (sharded
        strategies, unless already unsharded) or, for NO_SHARD, the cast as the unsharded copy."""
        mb = self.mb
        already = unit in mb.unsharded
        if self.opts.limit_all_gathers and len(self.free_events) >= MAX_INFLIGHT_ALL_GATHERS:
            self._host_wait(self.free_events.popleft())
        if already:
            return
        deps: tuple[int, ...] = (self.unshard_after,) if self.unshard_after is not None else ()
        shard = self.layout.padded[unit] // self.flat.shard_size
        if not self.flat.sharded:
            if self.flat.mixed(unit):
                self._cast_unsharded(unit, shard, deps)
            return
        allocs, frees, cast_s, deps = self._pre_unshard(unit, shard, deps)
        padded = self.layout.padded[unit]
        label = self.label("unsharded_flat_param", unit, mb.index)
        # made on the unshard stream, used on the compute stream: ``_free_unsharded_flat_param``
        # records the compute stream before freeing it
        allocs.append(
            Alloc(
                label=label,
                category=Mem.PARAMS,
                bytes=padded * self.flat.param_bytes[unit],
                record_stream=True,
            )
        )
        self.last_unshard = self.collective(
            OpKind.ALL_GATHER,
            Stream.ALL_GATHER,
            unit,
            padded * self.flat.param_bytes[unit],
            GroupKind.SHARD,
            self.flat.param_dtype[unit],
            mb=mb.index,
            deps=deps,
            allocs=tuple(allocs),
            frees=tuple(frees),
            extra_s=cast_s,
        )
        mb.unsharded[unit] = label

    def _pre_unshard(
        self, unit: str, shard: int, deps: tuple[int, ...]
    ) -> tuple[list[Alloc], list[str], float, tuple[int, ...]]:
        """``pre_unshard`` of a sharded strategy: CPUOffload's copy of the fp32 shard to the device,
        mixed precision's cast into ``_mp_shard`` (the all-gather input, freed in ``post_unshard``)."""
        cfg, mb = self.cfg, self.mb
        allocs: list[Alloc] = []
        frees: list[str] = []
        cast_s = 0.0
        if self.opts.offload_params:
            copy = self.label("offloaded_shard_on_device", unit, mb.index)
            deps = (self._h2d(unit, shard * self.flat.stored_bytes[unit], copy, deps),)  # the shard as stored
            frees.append(copy)
        if self.flat.mixed(unit):
            cast = self.label("mp_shard", unit, mb.index)
            # the all-gather reads it on the unshard stream (``record_stream`` in
            # ``_use_unsharded_flat_param``)
            allocs.append(
                Alloc(
                    label=cast, category=Mem.COMM_BUFFERS, bytes=shard * cfg.param_bytes, record_stream=True
                )
            )
            frees.append(cast)
            cast_s = cfg.costs.copy_s(shard * max(cfg.param_bytes, self.flat.stored_bytes[unit]))
        return allocs, frees, cast_s, deps

    def _cast_unsharded(self, unit: str, numel: int, deps: tuple[int, ...]) -> None:
        """NO_SHARD with mixed precision: the low-precision flat parameter, kept until the reshard."""
        cfg, mb = self.cfg, self.mb
        label = self.label("low_precision_params", unit, mb.index)
        self.last_unshard = self.program.emit(
            stream=Stream.ALL_GATHER,
            kind=OpKind.COPY,
            name=f"cast {unit}",
            unit=unit,
            microbatch=mb.index,
            duration_s=cfg.costs.copy_s(numel * self.flat.stored_bytes[unit]),
            deps=self.issued(deps),
            allocs=(Alloc(label=label, category=Mem.PARAMS, bytes=numel * cfg.param_bytes),),
        )
        mb.unsharded[unit] = label

    def _h2d(self, unit: str, nbytes: int, label: str, deps: tuple[int, ...]) -> int:
        """A host-to-device copy over PCIe into a new device buffer ``label``."""
        # used by the unshard stream's all-gather (``record_stream`` in ``_all_gather_flat_param``)
        alloc = Alloc(label=label, category=Mem.PARAMS, bytes=nbytes, record_stream=True)
        h2d_s = self.cfg.host_costs.h2d_s(nbytes)
        return self.transfer(
            Stream.H2D, f"h2d {unit}", unit, self.mb.index, nbytes, h2d_s, deps=deps, allocs=(alloc,)
        )

    def _host_wait(self, op: int) -> None:
        """The rate limiter: the host blocks until ``op`` has run (``event.synchronize()``)."""
        self.host_wait("fsdp1 rate limiter", op, self.mb.index)

    def _wait_for_unshard(self) -> None:
        """``current_stream().wait_stream(unshard_stream)``: the next compute op waits."""
        if self.last_unshard is not None:
            self.compute_waits.append(self.last_unshard)

    def _reshard(self, unit: str, *, free: bool, after: int) -> None:
        """``_reshard``: free the unsharded flat parameter once ``after`` (the last compute op) is
        done, and queue that free for the rate limiter; NO_SHARD frees its low-precision copy."""
        mb = self.mb
        mb.prefetched.discard(unit)
        low_precision_no_shard = not self.flat.sharded and self.flat.mixed(unit)
        if unit not in mb.unsharded or not (free or low_precision_no_shard):
            return
        self.program.add_frees(after, mb.unsharded.pop(unit))
        if free and self.opts.limit_all_gathers:
            self.free_events.append(after)

    # -- forward -----------------------------------------------------------------------------

    def _pre_forward(self, unit: str) -> None:
        mb, costs = self.mb, self.cfg.costs
        self.host(f"fsdp1 pre-forward {unit}", unit, mb.index, costs.fsdp_forward_host_s)
        if unit not in mb.prefetched:
            self._unshard(unit)
        mb.needs_pre_forward.discard(unit)
        self._wait_for_unshard()
        if costs.fsdp_forward_overhead_s > 0:  # the host is the device: FSDP1's hooks take its time
            self._compute(
                self.compute(
                    OpKind.HOST, f"fsdp1 pre-forward {unit}", unit, mb.index, costs.fsdp_forward_overhead_s
                )
            )
        order = [ROOT, *self.layout.forward_units]
        index = order.index(unit) + 1
        if self.opts.forward_prefetch and index < len(order):
            target = order[index]
            if target in mb.needs_pre_forward and target not in mb.prefetched:
                self._unshard(target)
                mb.prefetched.add(target)

    def _post_forward(self, unit: str, after: int) -> None:
        mb = self.mb
        mb.post_forward_order.append(unit)
        free = unit != ROOT and self.flat.sharded and self.cfg.strategy.reshards_after_forward
        self._reshard(unit, free=free, after=after)
        mb.needs_pre_backward.add(unit)

    def _forward(self) -> None:
        cfg, layout = self.cfg, self.layout
        self.unshard_after = self.last_compute  # _root_pre_forward: _wait_for_computation_stream
        self._pre_forward(ROOT)
        op = -1
        for i, seg in enumerate(cfg.segments):
            if seg.unit != ROOT and i == layout.first_seg[seg.unit]:
                self._pre_forward(seg.unit)
            op = self._compute(self.forward_segment(i, self.mb.index, self.mb))
            if seg.unit != ROOT and i == layout.last_seg[seg.unit]:
                self._post_forward(seg.unit, op)
        self._post_forward(ROOT, op)
        self.unshard_after = None

    # -- recompute ---------------------------------------------------------------------------

    def _wrapped_in_checkpoint(self, i: int) -> bool:
        """Segment ``i`` belongs to a unit wrapped inside its checkpointed block (PEFT's adapters,
        ``linear`` wrap's units): ``apply_activation_checkpointing`` wraps the decoder layer inside
        its own ``FullyShardedDataParallel``, so the recompute runs the hooks of the units nested in
        it, not those of the block's unit (the owner of its first segment) or the root."""
        seg = self.cfg.segments[i]
        return seg.unit not in (ROOT, self.block_owner[seg.block])

    def _recompute_hooks_run(self, i: int) -> bool:
        """The recompute runs segment ``i``'s unit's forward hooks: it is nested in the block and
        its pre-backward has not run yet (``_pre_forward`` returns at once for a handle in
        ``BACKWARD_PRE``: the block's last unit, whose output's gradient arrives before the first
        saved tensor is unpacked, keeps what its pre-backward gathered)."""
        return self._wrapped_in_checkpoint(i) and self.cfg.segments[i].unit not in self.mb.pre_backward_done

    def _before_recompute(self, i: int, mb: int) -> None:
        """A nested unit's ``_pre_forward`` in the recompute: it all-gathers again what its
        forward resharded (measured: 29 all-gathers in a real FSDP1 step of 2 checkpointed blocks
        with 4 adapter units each, against 21 without the recompute's)."""
        unit = self.cfg.segments[i].unit
        if not self._recompute_hooks_run(i) or i != self.layout.first_seg[unit]:
            return
        self.host(f"fsdp1 pre-forward {unit} (recompute)", unit, mb, self.cfg.costs.fsdp_forward_host_s)
        self._unshard(unit)
        self._wait_for_unshard()

    def _after_recompute(self, i: int, op: int) -> None:
        """The nested unit's ``_post_forward`` in the recompute: resharded again (FULL_SHARD),
        its pre-backward unshards it once more."""
        unit = self.cfg.segments[i].unit
        if not self._recompute_hooks_run(i) or i != self.layout.last_seg[unit]:
            return
        self._reshard(unit, free=self.flat.sharded and self.cfg.strategy.reshards_after_forward, after=op)
        self.mb.needs_pre_backward.add(unit)

    # -- backward ----------------------------------------------------------------------------

    def _pre_backward(self, unit: str) -> None:
        mb = self.mb
        if unit in mb.pre_backward_done:
            return
        mb.pre_backward_done.add(unit)
        self.host(f"fsdp1 pre-backward {unit}", unit, mb.index, self.cfg.costs.fsdp_backward_host_s)
        if unit in mb.needs_pre_backward:
            if unit not in mb.prefetched:
                self._unshard(unit)
            self._wait_for_unshard()
        mb.needs_pre_backward.discard(unit)
        if self.opts.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_backward(unit)

    def _prefetch_backward(self, unit: str) -> None:
        """Unshard the unit that ran just before ``unit`` in forward (post-forward order)."""
        mb = self.mb
        index = mb.post_forward_order.index(unit)
        if index == 0:
            return
        target = mb.post_forward_order[index - 1]
        if target in mb.needs_pre_backward and target not in mb.prefetched:
            self._unshard(target)
            mb.prefetched.add(target)

    def _backward(self) -> None:
        cfg, mb, layout = self.cfg, self.mb, self.layout
        self._pre_backward(ROOT)
        recomputed: set[int] = set()
        for i in reversed(range(len(cfg.segments))):
            seg = cfg.segments[i]
            if seg.unit != ROOT and i == layout.last_seg[seg.unit]:
                self._pre_backward(seg.unit)
            if self.checkpointed(i) and seg.block not in recomputed:
                self.recompute_block(seg.block, mb.index, mb)  # type: ignore[arg-type]
                recomputed.add(seg.block)  # type: ignore[arg-type]
            end_allocs: tuple[Alloc, ...] = ()
            if self.flat.trains[seg.unit]:
                grad_bytes = sum(p.numel for p in cfg.gradient_params[i]) * self.flat.param_bytes[seg.unit]
                grads = self.label("view_grads", seg.unit, mb.index)
                mb.view_grads[seg.unit].append(grads)
                end_allocs = (Alloc(label=grads, category=Mem.GRADS, bytes=grad_bytes),)
            op = self._compute(self.backward_segment(i, mb.index, mb, end_allocs=end_allocs))
            if i == layout.first_seg[seg.unit]:
                if self.flat.trains[seg.unit]:
                    self._post_backward(seg.unit)
                else:
                    self._post_backward_reshard_only(seg.unit, op)
        self._final_callback()

    def _post_backward_reshard_only(self, unit: str, after: int) -> None:
        """A frozen flat parameter: no gradient to reduce; resharded (and ``BACKWARD_POST``
        prefetching) by the hook on its inputs' gradients, or, with none, by the catch-all."""
        if not self.layout.needs_grad[unit]:
            self.catch_all.append(unit)
            return
        self.host(
            f"fsdp1 post-backward reshard {unit}", unit, self.mb.index, self.cfg.costs.fsdp_backward_host_s
        )
        self._reshard(unit, free=self.flat.sharded, after=after)
        if self.opts.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch_backward(unit)

    def _final_callback(self) -> None:
        """The root's final callback: the compute stream waits for the reductions, then
        ``_catch_all_reshard`` frees what no hook resharded."""
        self.compute_waits = list(self.reduction.reductions)
        if self.catch_all and self.last_compute is not None:
            for unit in self.catch_all:
                self._reshard(unit, free=self.flat.sharded, after=self.last_compute)
        self.catch_all = []

    def _post_backward(self, unit: str) -> None:
        """The flat gradient (autograd concatenates the views' gradients), the post-backward
        reshard and prefetch, then the reduction on the post-backward stream."""
        cfg, mb = self.cfg, self.mb
        self.host(f"fsdp1 post-backward {unit}", unit, mb.index, cfg.costs.fsdp_backward_host_s)
        flat_bytes = self.flat.numel[unit] * self.flat.param_bytes[unit]
        final = not self.flat.sharded and mb.index == 0 and self.flat.param_bytes[unit] == cfg.master_bytes
        flat_grad = self.label("grads" if final else "flat_grad", unit, mb.index)
        if final:  # NO_SHARD in fp32: the flat gradient is the .grad the optimizer reads
            self.grad_labels.append(flat_grad)
        cat = self._compute(
            self.compute(
                OpKind.COPY,
                f"flat gradient {unit}",
                unit,
                mb.index,
                cfg.costs.copy_s(flat_bytes) + cfg.costs.fsdp_backward_overhead_s,
                # reduced on the post-backward stream, which ``_post_backward_hook`` records
                allocs=(
                    Alloc(label=flat_grad, category=Mem.GRADS, bytes=flat_bytes, record_stream=not final),
                ),
                frees=tuple(mb.view_grads.pop(unit)),
            )
        )
        self._reshard(unit, free=self.flat.sharded, after=cat)
        if self.opts.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch_backward(unit)
        if not self.flat.sharded:
            self.reduction.all_reduce(unit, mb.index, cat, None if final else flat_grad)
            return
        self.reduction.reduce_scatter(unit, mb.index, cat, flat_grad)


def build_fsdp1_program(cfg: StepConfig) -> Program:
    return Fsdp1ScheduleBuilder(cfg).build()
