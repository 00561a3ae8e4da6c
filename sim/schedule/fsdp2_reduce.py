"""FSDP2's gradient reduction, from its post-backward hook (torch 2.13
``_fully_shard/_fsdp_param_group.py`` ``post_backward``, ``_fsdp_collectives.py``
``foreach_reduce``): the reduce-scatter copy-in on the compute stream after the previous
reduce-scatter has finished (one input buffer in flight), the reduce-scatter (a copy on a
one-rank shard group) and, for HSDP, the all-reduce across replicas; without gradient sync the
unsharded gradients accumulate instead, reduced once on the last micro-batch: in a copy cast to
``reduce_dtype`` where it differs, else in the unsharded parameters' own ``.grad``, to which
autograd adds each later micro-batch's gradients in place (``accumulates_in_place``; the real
no-sync step, fp32 and bf16, was 0.4 to 1.8 % above the simulated one while those were held as
buffers of their own, ``tests/test_no_sync_memory.py``). With
``CPUOffloadPolicy`` the reduced shard then goes to the host (``sim.schedule.fsdp2_offload``).
On a group sharded over more than one rank, torch 2.13's ``foreach_reduce`` keeps the group's
last unsharded gradient (a Llama block's norm weight; the root's ``lm_head`` weight:
``ParamGroups.held_grad``) until it returns, past the reduce-scatter output's allocation: its loop
over the gradients, run only when ``world_size > 1``, leaves ``unsharded_grad`` bound
(``tests/test_tracker_hooks.py``). That gradient is freed with the reduce-scatter, the others at
the copy-in. Where the root's reduce-scatter makes the peak it counts: Llama-3-8B on 2 ranks, bf16
reduced in fp32, checkpointed, fused AdamW, 1 x 1,024, was 1.5 % below the real step without it
(68.44 against 69.50 GB, fake mode, 2026-12-07) and is exact with it; llama-5m likewise, 4.2 %
(``tests/test_held_gradient.py``).
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc
from sim.core.topology import GroupKind
from sim.schedule.base import ScheduleBuilder
from sim.schedule.fsdp2_offload import OffloadCopies
from sim.schedule.fsdp2_params import ParamGroups


@dataclass
class GradientReduction:
    """The reductions of one FSDP2 step, issued through ``builder``."""

    builder: ScheduleBuilder
    groups: ParamGroups
    offload: OffloadCopies | None
    reductions: list[int] = field(default_factory=list)  # every one so far: the final callback waits
    # group -> the gradients kept across micro-batches (their labels: the reduce-dtype copy, or, where
    # no cast is needed, the first micro-batch's own unsharded gradients)
    accumulated: dict[str, list[str]] = field(default_factory=dict)
    kept_held: dict[str, str] = field(default_factory=dict)  # group -> its held gradient, kept in place
    reduced: set[str] = field(default_factory=set)  # groups reduced once already (sharded gradients exist)

    def post_backward(
        self,
        group: str,
        mb: int,
        grads: list[str],
        frees: list[str],
        in_flight: list[tuple[int, str]],
        held: str | None = None,
    ) -> list[tuple[int, str]]:
        """One parameter group's reduction of this backward's unsharded gradients ``grads`` (its
        copy-in frees ``frees`` too), after the reduce-scatters ``in_flight`` (op, input label);
        ``held``: the gradient of ``grads`` that lives until the reduce-scatter is issued (module
        docstring). Returns the reduce-scatters whose input then lives."""
        b, cfg = self.builder, self.builder.cfg
        if not (cfg.sync_every_microbatch or mb == cfg.grad_accum - 1):
            self._accumulate(group, mb, grads, frees, held)
            return in_flight
        if group in self.accumulated:  # the held tensor is then the kept gradients' own: apart only
            held = self.kept_held.pop(group, None)  # where they are the first backward's, kept in place
        if held is not None:
            frees = [f for f in frees if f != held]
        padded = self.groups.sizes[group].grad_padded
        shard = padded // self.groups.shard_size[group]
        added: list[str] = []
        if group in self.accumulated:  # this backward's gradients are added into the kept ones first
            added = grads
            frees = [f for f in frees if f not in added]
            frees += [f for f in self.accumulated.pop(group) if f != held]
        # one reduce-scatter input in flight (set_reduce_scatter_max_input_buffers): the compute
        # stream waits for the previous reduce-scatter and drops its input before allocating this one
        deps, released = [op for op, _ in in_flight], [label for _, label in in_flight]
        rs_input = b.label("reduce_scatter_input", group, mb)
        # the copy-in, and FSDP2's per-unit host work in backward (pre-backward unshard, post-backward reduce)
        copy_in_s = (
            cfg.costs.copy_s(padded * max(cfg.param_bytes, cfg.reduce_bytes))
            + cfg.costs.fsdp_backward_overhead_s
        )
        allocs, output_frees = self._outputs(group, mb, shard)
        copy_in = b.compute(
            OpKind.COPY,
            f"reduce_scatter copy-in {group}",
            self.groups.unit_of[group],
            mb,
            copy_in_s,
            deps=tuple(deps),
            start_frees=(*released, *added),
            allocs=(Alloc(label=rs_input, category=Mem.COMM_BUFFERS, bytes=padded * cfg.reduce_bytes),),
            frees=tuple(frees),
        )
        return [(self._reduce(group, mb, copy_in, shard, allocs, output_frees, held), rs_input)]

    def _reduce(
        self,
        group: str,
        mb: int,
        copy_in: int,
        shard: int,
        allocs: tuple[Alloc, ...],
        output_frees: tuple[str, ...],
        held: str | None,
    ) -> int:
        """The reduce-scatter (a copy on one rank; ``held`` freed when it ends), HSDP's all-reduce,
        and with CPU offload the copy of the reduced shard to the host on the post-reduce stream;
        returns the reduce-scatter."""
        b, cfg = self.builder, self.builder.cfg
        owner, w = self.groups.unit_of[group], self.groups.shard_size[group]
        padded = shard * w
        tail = (
            ()
            if self.offload is None or self.offload.reduce_stream_tail is None
            else (self.offload.reduce_stream_tail,)
        )
        device_frees, output_frees = (output_frees, ()) if self.offload is not None else ((), output_frees)
        rs_frees = (() if cfg.hybrid else output_frees) + ((held,) if held is not None else ())
        if w == 1:  # no reduce-scatter: the input is copied into the output
            rs = b.compute(
                OpKind.COPY,
                f"reduce copy {group}",
                owner,
                mb,
                cfg.costs.copy_s(padded * cfg.reduce_bytes),
                deps=(copy_in,),
                allocs=allocs,
                frees=rs_frees,
            )
        else:
            rs = b.collective(
                OpKind.REDUCE_SCATTER,
                Stream.REDUCE_SCATTER,
                owner,
                padded * cfg.reduce_bytes,
                self.groups.kind[group],
                cfg.reduce_dtype,
                mb=mb,
                deps=(copy_in,) if cfg.hybrid else (copy_in, *tail),
                allocs=allocs,
                frees=rs_frees,
                name=f"reduce_scatter {group}",
            )
        last = rs
        if cfg.hybrid:
            last = b.collective(
                OpKind.ALL_REDUCE,
                Stream.ALL_REDUCE,
                owner,
                shard * cfg.reduce_bytes,
                GroupKind.REPLICATE,
                cfg.reduce_dtype,
                mb=mb,
                deps=(rs, *tail),
                frees=output_frees,
            )
        if self.offload is not None:  # the post-reduce event is recorded after the copy to the host
            last = self.offload.d2h(group, mb, shard * cfg.master_bytes, last, device_frees)
        self.reductions.append(last)
        return rs

    def accumulates_in_place(self, group: str) -> bool:
        """Whether this backward's gradients of ``group`` go straight into the kept ones: they are
        the unsharded parameters' own ``.grad`` (no cast to ``reduce_dtype``), to which autograd's
        ``AccumulateGrad`` adds each new gradient in place as it is made (``variable_grad +=
        new_grad``), the new tensor then dropped: no buffer of this backward's gradients lives on."""
        return group in self.accumulated and not self._casts()

    def _casts(self) -> bool:
        """Whether kept gradients are a copy cast to ``reduce_dtype`` (``to_accumulated_grad_if_needed``)."""
        cfg = self.builder.cfg
        return cfg.reduce_dtype != cfg.param_dtype

    def _accumulate(self, group: str, mb: int, grads: list[str], frees: list[str], held: str | None) -> None:
        """``set_requires_gradient_sync(False)``: post-backward reshards and keeps the unsharded
        gradients: cast to ``reduce_dtype`` where it differs (``to_accumulated_grad_if_needed``, a
        copy; later micro-batches' gradients are added into it here,
        ``accumulate_unsharded_grad_if_needed``), else the first micro-batch's ``grads`` themselves,
        which later backwards add to in place (``accumulates_in_place``); one reduction on the last
        micro-batch."""
        b, cfg = self.builder, self.builder.cfg
        if group not in self.accumulated and not self._casts():
            assert set(frees) == set(grads), f"{group}: post-backward drops more than its gradients"
            self.accumulated[group] = list(grads)  # kept as they are: nothing to copy
            if held is not None:
                self.kept_held[group] = held
            return
        nbytes = self.groups.sizes[group].grad_numel * (
            cfg.reduce_bytes if self._casts() else cfg.param_bytes
        )
        allocs: tuple[Alloc, ...] = ()
        if group not in self.accumulated:
            self.accumulated[group] = [b.label("accumulated_grads", group, mb)]
            allocs = (Alloc(label=self.accumulated[group][0], category=Mem.GRADS, bytes=nbytes),)
        b.compute(
            OpKind.COPY,
            f"accumulate grads {group}",
            self.groups.unit_of[group],
            mb,
            cfg.costs.copy_s(nbytes),
            allocs=allocs,
            frees=tuple(frees),
        )

    def _outputs(self, group: str, mb: int, shard: int) -> tuple[tuple[Alloc, ...], tuple[str, ...]]:
        """The sharded gradients (the group's first reduction) and, when cast or accumulated, a
        separate reduce-scatter output freed once the reduction is done."""
        b, cfg = self.builder, self.builder.cfg
        allocs, frees = [], []
        if self.offload is not None:  # CPUOffloadPolicy: the sharded gradients live on the host
            out = b.label("reduce_scatter_output", group, mb)
            return (Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=shard * cfg.reduce_bytes),), (out,)
        first = group not in self.reduced
        self.reduced.add(group)
        if first:
            grads = b.label("sharded_grads", group, mb)
            b.grad_labels.append(grads)
            allocs.append(Alloc(label=grads, category=Mem.GRADS, bytes=shard * cfg.master_bytes))
        if not first or cfg.reduce_bytes != cfg.master_bytes:
            out = b.label("reduce_scatter_output", group, mb)
            allocs.append(Alloc(label=out, category=Mem.COMM_BUFFERS, bytes=shard * cfg.reduce_bytes))
            frees.append(out)
        return tuple(allocs), tuple(frees)
