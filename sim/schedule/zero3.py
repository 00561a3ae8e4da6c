"""DeepSpeed ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``, DeepSpeed 0.19.8), as an engine
``Program``: parameters fetched module by module by the ``PartitionedParameterCoordinator``
(``deepspeed/runtime/zero/partitioned_param_coordinator.py``), gradients reduce-scattered in
buckets (``stage3.py``).

- The trace: every module with parameters in the order the step uses it (forward, the
  recomputation of a checkpointed block, backward). Parameters at or below
  ``stage3_param_persistence_threshold`` elements are persistent: gathered after every step and
  never released.
- ``fetch_sub_module``: one all-gather of the module's parameters that are not available
  (``all_gather_coalesced``: a single parameter into its own padded buffer; several into one flat
  buffer of their padded partitions, then copied out into one tensor each), the compute stream
  waits for it; then, from the trace's parameter queue, a prefetch of up to
  ``stage3_prefetch_bucket_size`` elements (bounded by ``stage3_max_live_parameters`` less what is
  available) in one more all-gather.
- ``release_sub_module`` after the module ran: each non-persistent parameter is freed unless a
  prefetch already took it for a later use, or a module within ``stage3_max_reuse_distance``
  elements of parameters ahead in the trace uses it again.
- Gradients: copied into the IPG bucket and reduce-scattered bucket by bucket
  (``sim.schedule.zero3_reduce``); the step per ``sub_group_size`` group and the persistent
  parameters' all-gathers after it (``sim.schedule.zero3_step``).
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind
from sim.schedule.base import Activations, ScheduleBuilder
from sim.schedule.step import StepConfig
from sim.schedule.zero3_reduce import GradientBuckets
from sim.schedule.zero3_step import emit_zero3_step
from sim.schedule.zero3_trace import ModuleCall, SegmentUse, segment_uses
from sim.schedule.zero_state import gathered_numel, persistent, zero_params
from sim.workload.model import ParamSpec, layer_prefix


@dataclass(kw_only=True)
class Coordinator:
    """The ``PartitionedParameterCoordinator``'s state over one micro-batch."""

    queue: list[tuple[str, int]]  # (parameter, trace step) in trace order: __param_queue
    head: int = 0
    available: dict[str, str] = field(default_factory=dict)  # parameter -> its gathered tensor
    inflight: dict[str, int] = field(default_factory=dict)  # parameter -> the all-gather bringing it
    fetched_for: dict[str, int] = field(default_factory=dict)  # __most_recent_step_id_param_fetched_for
    n_available: int = 0


class Zero3ScheduleBuilder(ScheduleBuilder):
    def __init__(self, cfg: StepConfig):
        super().__init__(cfg)
        assert cfg.zero is not None and cfg.zero.stage == 3
        self.zero = cfg.zero
        self.n = cfg.world_size
        self.uses = segment_uses(cfg)
        self.calls = [c for u in self.uses for c in u.calls]  # the trace: every fetch_sub_module
        # the first decoder layer's module calls per pass (forward with recompute, and backward):
        # what one layer's measured hook time covers
        self.layer_calls = {
            phase: sum(
                1
                for u in self.uses
                for c in u.calls
                if _in_first_layer(c.module) and (u.phase is OpKind.BACKWARD) == (phase is OpKind.BACKWARD)
            )
            for phase in (OpKind.FORWARD, OpKind.BACKWARD)
        }
        self.specs = {p.name: p for p in zero_params(cfg)}
        self.persist = {name for name, p in self.specs.items() if persistent(cfg, p)}
        self.buckets = GradientBuckets(emitter=self, zero=self.zero)
        self.coord = Coordinator(queue=[])
        self.acts = Activations()

    def build(self) -> Program:
        queue = [
            (p.name, t) for t, c in enumerate(self.calls) for p in sorted(c.params, key=lambda p: p.name)
        ]
        for mb in range(self.cfg.grad_accum):
            self.acts = Activations()
            self.coord = Coordinator(queue=queue, fetched_for=dict.fromkeys(self.specs, -1))
            t = 0
            deferred: list[tuple[int, ModuleCall]] = []  # calls whose module computes in a later use
            for use in self.uses:
                called = []
                for call in use.calls:
                    self._fetch(t, call, mb, self.cfg.segments[use.segment].unit)
                    called.append((t, call))
                    t += 1
                self._hooks(use, mb)
                if not use.compute:
                    deferred += called
                    continue
                op = self._run(use, mb)
                if use.phase is OpKind.BACKWARD:
                    called, deferred = deferred + called, []
                for k, call in called:
                    self._release(k, call, op)
            self.buckets.reduce_bucket(mb)  # independent_gradient_partition_epilogue
            self.compute_waits = list(self.buckets.reductions)
        emit_zero3_step(self, self.zero, self.specs, self.persist)
        return self.program

    def _hooks(self, use: SegmentUse, mb: int) -> None:
        """DeepSpeed's measured host work around module calls (fetch, release, partition
        bookkeeping; ``calibrate.deepspeed_overhead``), spread evenly over a decoder layer's calls
        of the pass; zero unless the host is the device."""
        costs = self.cfg.costs
        forward = use.phase is not OpKind.BACKWARD
        per_layer_s = costs.deepspeed_layer_forward_s if forward else costs.deepspeed_layer_backward_s
        calls = self.layer_calls[OpKind.FORWARD if forward else OpKind.BACKWARD]
        if per_layer_s <= 0 or not calls:
            return
        unit = self.cfg.segments[use.segment].unit
        for call in use.calls:  # the modules outside the layers (embedding, head, root) at the same rate
            name = f"deepspeed hooks {call.module or '(root)'}"
            self.compute(OpKind.HOST, name, unit, mb, per_layer_s / calls)

    def _run(self, use: SegmentUse, mb: int) -> int:
        i = use.segment
        if use.phase is OpKind.FORWARD:
            return self.forward_segment(i, mb, self.acts)
        if use.phase is OpKind.RECOMPUTE:
            return self._recompute_segment(i, mb)
        grads = list(self.cfg.segments[i].params)
        # with overlap_comm the bucket copy reads a gradient on the reduce-and-partition stream,
        # which ``__add_grad_to_ipg_bucket`` records before dropping it
        overlap = self.zero.overlap_comm
        allocs = tuple(
            Alloc(
                label=self._grad_label(p, mb),
                category=Mem.GRADS,
                bytes=p.numel * self.cfg.param_bytes,
                record_stream=overlap,
            )
            for p in grads
        )
        op = self.backward_segment(i, mb, self.acts, end_allocs=allocs)
        for p in grads:
            self.buckets.add_grad(p, mb, op, self._grad_label(p, mb))
        return op

    def _recompute_segment(self, i: int, mb: int) -> int:
        seg, fig = self.cfg.segments[i], self.cfg.figures[i]
        saved = self.label("recomputed_activations", seg.unit, mb)
        transient = self.label("recompute_temp", seg.unit, mb)
        self.acts.saved[i] = saved
        return self.compute(
            OpKind.RECOMPUTE,
            seg.name,
            seg.unit,
            mb,
            fig.recompute_s,
            allocs=self.saved_and_transient(
                Alloc(
                    label=saved, category=Mem.ACTIVATIONS, bytes=fig.saved_bytes, pieces=fig.tensors("saved")
                ),
                Alloc(
                    label=transient,
                    category=Mem.OTHER,
                    bytes=fig.forward_transient_bytes,
                    pieces=fig.tensors("forward_transient"),
                ),
                fig.forward_order,
            ),
            frees=(transient,),
            host_s=fig.forward_host_s,
            launches=fig.forward_launches,
        )

    @staticmethod
    def _grad_label(p: ParamSpec, mb: int) -> str:
        return f"grad:{p.name}:mb{mb}"

    # -- fetch and release ---------------------------------------------------------------------

    def _all_gather(self, names: list[str], mb: int, unit: str) -> None:
        """``all_gather_coalesced`` of ``names`` (parameters not available): one collective."""
        cfg, coord = self.cfg, self.coord
        if not names:
            return
        padded = sum(gathered_numel(self.specs[n], self.n) for n in names)
        allocs = []
        frees: list[str] = []
        if len(names) == 1:  # gathered into the parameter's own padded buffer
            label = self.label(f"gathered {names[0]}", unit, mb)
            # made on the all-gather stream, used on the compute stream: ``free_param`` records
            # the compute stream before dropping it
            allocs.append(
                Alloc(label=label, category=Mem.PARAMS, bytes=padded * cfg.param_bytes, record_stream=True)
            )
            coord.available[names[0]] = label
        else:  # one flat buffer, then each parameter copied out of it when waited for
            flat = self.label("all_gather_flat", unit, mb)
            allocs.append(Alloc(label=flat, category=Mem.COMM_BUFFERS, bytes=padded * cfg.param_bytes))
            frees.append(flat)
            for n in names:
                label = self.label(f"gathered {n}", unit, mb)
                allocs.append(
                    Alloc(label=label, category=Mem.PARAMS, bytes=self.specs[n].numel * cfg.param_bytes)
                )
                coord.available[n] = label
        deps = self._bring_in_partitions(padded // self.n * cfg.param_bytes, mb, unit)
        op = self.collective(
            OpKind.ALL_GATHER,
            Stream.ALL_GATHER,
            unit,
            padded * cfg.param_bytes,
            GroupKind.SHARD,
            cfg.param_dtype,
            mb=mb,
            deps=deps,
            allocs=tuple(allocs),
            frees=tuple(frees),
            extra_s=cfg.costs.copy_s(padded * cfg.param_bytes) if len(names) > 1 else 0.0,
        )
        for n in names:
            coord.inflight[n] = op
            coord.n_available += self.specs[n].numel

    def _bring_in_partitions(self, nbytes: int, mb: int, unit: str) -> tuple[int, ...]:
        """``offload_param``: the partitions come from pinned host memory (``ds_tensor.to(device)``
        in ``all_gather_coalesced``), read from NVMe first under ZeRO-Infinity."""
        device = self.zero.offload_param.value
        if device == "none":
            return ()
        host = self.cfg.host_costs
        deps: tuple[int, ...] = ()
        if device == "nvme":
            deps = (
                self.transfer(Stream.NVME, f"nvme read {unit}", unit, mb, nbytes, host.nvme_read_s(nbytes)),
            )
        return (
            self.transfer(
                Stream.H2D, f"h2d partitions {unit}", unit, mb, nbytes, host.h2d_s(nbytes), deps=deps
            ),
        )

    def _fetch(self, k: int, call: ModuleCall, mb: int, unit: str) -> None:
        coord = self.coord
        needed = [p.name for p in sorted(call.params, key=lambda p: p.name)]
        self._all_gather([n for n in needed if n not in coord.available and n not in self.persist], mb, unit)
        self.compute_waits += [coord.inflight.pop(n) for n in needed if n in coord.inflight]
        # pop this module's own entries off the queue, then prefetch what follows
        own = {n for n in needed if coord.fetched_for[n] < k}
        while own and coord.head < len(coord.queue):
            name, step = coord.queue[coord.head]
            coord.head += 1
            coord.fetched_for[name] = step
            own.discard(name)
        budget = min(self.zero.max_live_parameters - coord.n_available, self.zero.prefetch_bucket_size)
        chosen: list[str] = []
        numel = 0
        while coord.head < len(coord.queue) and numel < budget:
            name, step = coord.queue[coord.head]
            coord.head += 1
            coord.fetched_for[name] = max(coord.fetched_for[name], step)
            if name not in coord.available and name not in self.persist and name not in chosen:
                chosen.append(name)
                numel += self.specs[name].numel
        self._all_gather(chosen, mb, unit)

    def _release(self, k: int, call: ModuleCall, after: int) -> None:
        """``release_sub_module`` of call ``k`` (DeepSpeed's step id is then k + 1)."""
        coord = self.coord
        keep = {p.name for p in call.params if p.name in self.persist or coord.fetched_for[p.name] > k + 1}
        traversed = 0
        for later in self.calls[k + 1 :]:
            if traversed >= self.zero.max_reuse_distance:
                break
            for p in later.params:
                keep.add(p.name)
                traversed += p.numel
        for p in call.params:
            if p.name not in keep and p.name in coord.available:
                self.program.add_frees(after, coord.available.pop(p.name))
                coord.n_available -= p.numel


def build_zero3_program(cfg: StepConfig) -> Program:
    return Zero3ScheduleBuilder(cfg).build()


def _in_first_layer(module: str) -> bool:
    return module == layer_prefix(0) or module.startswith(layer_prefix(0) + ".")
