"""DeepSpeed ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``, DeepSpeed 0.19.8
``deepspeed/runtime/zero/stage_1_and_2.py``), written as an engine ``Program``.

- The parameters stay whole on every rank in the training dtype: forward and backward issue no
  parameter collective.
- Gradients go through the IPG bucket (``reduce_independent_p_g_buckets_and_remove_grads``): each
  gradient, as autograd produces it, is copied into a contiguous buffer of
  ``reduce_bucket_size`` elements (``contiguous_gradients``) and its own storage dropped; when the
  next gradient would overflow the bucket, the bucket is reduced (``reduce_ipg_grads`` ->
  ``average_tensor``: with ``use_multi_rank_bucket_allreduce``, DeepSpeed's default, one
  all-reduce of the whole bucket) and each rank copies its partition's slice into
  ``grads_in_partition``. With ``overlap_comm`` the all-reduce runs on the reduction stream
  (double buffers: a bucket's copies wait for the all-reduce that last used its buffer); without
  it the compute stream waits. A gradient larger than the bucket is all-reduced on its own.
- Stage 2 reduces as gradients appear, every micro-batch; stage 1 (without ``overlap_comm``)
  keeps every gradient until the accumulation boundary, then reduces them in parameter order
  (``reduce_gradients``).
- The step (``DeepSpeedZeroOptimizer.step``): the overflow flag (1 byte; not in fp32, measured)
  and the gradient norm (fp32) all-reduced, the gradient partition cast to fp32, the optimizer on the fp32 master
  partition (fp16: unscaled first), the partition copied back into the training-dtype parameters,
  and one all-gather of the flat parameter group (``all_gather_into_tensor_dp_groups``:
  ``allgather_bucket_size`` only matters where ``all_gather_into_tensor`` is missing).
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc, Program
from sim.core.topology import GroupKind
from sim.schedule.base import Activations, ScheduleBuilder
from sim.schedule.step import StepConfig
from sim.schedule.zero_state import flat_padded_numel, grads_in_partition_numel, zero_params
from sim.workload.model import ParamSpec
from sim.workload.units import ROOT

OVERFLOW_FLAG_BYTES = 1  # has_overflow: a one-element uint8 tensor, all-reduced with MAX
NORM_BYTES = 4  # the global gradient norm, one fp32 element


@dataclass(kw_only=True)
class Bucket:
    """The IPG bucket being filled: its elements, the ops that filled it, the gradients in it."""

    elements: int = 0
    copies: list[int] = field(default_factory=list)
    grads: list[str] = field(default_factory=list)  # gradients freed when it is reduced


class Zero12ScheduleBuilder(ScheduleBuilder):
    def __init__(self, cfg: StepConfig):
        super().__init__(cfg)
        assert cfg.zero is not None and cfg.zero.stage in (1, 2)
        self.zero = cfg.zero
        self.n = cfg.world_size
        self.flat = flat_padded_numel(cfg)
        # the first decoder layer's parameters: what one layer's measured hook time covers
        self.layer_params = sum(len(s.params) for s in cfg.segments if s.block == 0)
        self.bucket = Bucket()
        self.buffer_index = 0
        self.buffer_free: dict[int, int] = {}  # double buffer index -> the all-reduce that last read it
        self.reductions: list[int] = []
        self.grads: dict[str, str] = {}  # parameter -> its live gradient's label
        self.buckets_label: str | None = None  # the IPG buffers while a backward holds them
        self.partition_label: str | None = None  # grads_in_partition, from its first copy to the step
        self.pending_allocs: list[Alloc] = []  # allocated by the next op issued
        self.offloads: list[int] = []  # ZeRO-Offload: gradient copies to the host
        self.mb = Activations()

    def build(self) -> Program:
        cfg = self.cfg
        for index in range(cfg.grad_accum):
            self.mb = Activations()
            for i in range(len(cfg.segments)):
                self._hooks(i, index, forward=True)
                self.forward_segment(i, index, self.mb)
            self._backward(index)
        self._step()
        return self.program

    # -- backward and the gradient buckets -------------------------------------------------

    def _setup_buckets(self, mb: int) -> None:
        """``setup_buckets`` at the first gradient: the IPG buffers (two with ``overlap_comm``)."""
        if self.buckets_label is not None or not self.zero.contiguous_gradients:
            return
        self.buckets_label = self.label("ipg_buckets", ROOT, mb)
        count = 2 if self.zero.overlap_comm else 1
        nbytes = count * self.zero.reduce_bucket_size * self.cfg.param_bytes
        self.pending_allocs.append(Alloc(label=self.buckets_label, category=Mem.COMM_BUFFERS, bytes=nbytes))

    def _backward(self, mb: int) -> None:
        cfg = self.cfg
        eager = self.zero.stage == 2 or self.zero.overlap_comm  # reduce as gradients appear
        boundary = mb == cfg.grad_accum - 1
        recomputed: set[int] = set()
        op = -1
        for i in reversed(range(len(cfg.segments))):
            seg = cfg.segments[i]
            if self.checkpointed(i) and seg.block not in recomputed:
                self.recompute_block(seg.block, mb, self.mb)  # type: ignore[arg-type]
                recomputed.add(seg.block)  # type: ignore[arg-type]
            fresh = [p for p in seg.params if p.name not in self.grads]
            allocs = []
            for p in fresh:
                self.grads[p.name] = self.label(f"grad {p.name}", seg.unit, mb)
                allocs.append(
                    Alloc(label=self.grads[p.name], category=Mem.GRADS, bytes=p.numel * cfg.param_bytes)
                )
            self._hooks(i, mb, forward=False)
            op = self.backward_segment(i, mb, self.mb, end_allocs=tuple(allocs))
            if eager and fresh:
                self._setup_buckets(mb)
                for p in reversed(fresh):
                    self._add_to_bucket(p, seg.unit, mb, op)
        if not eager and boundary:  # stage 1: reduce_gradients, in parameter order
            self._setup_buckets(mb)
            for p in zero_params(cfg):
                self._add_to_bucket(p, ROOT, mb, op)
        if eager or boundary:
            self._reduce_bucket(mb)  # the epilogue: what is left in the bucket
            self.compute_waits = list(self.reductions)  # it synchronises before the next step
            if self.buckets_label is not None:  # _release_ipg_buffers
                self.program.add_frees(self.reductions[-1], self.buckets_label)
                self.buckets_label = None

    def _hooks(self, i: int, mb: int, *, forward: bool) -> None:
        """DeepSpeed's measured host work per parameter (its gradient hooks and the bucket
        bookkeeping; ``calibrate.deepspeed_overhead``), one decoder layer's measured time spread
        over the layer's parameters; zero unless the host is the device."""
        costs, seg = self.cfg.costs, self.cfg.segments[i]
        per_layer_s = costs.deepspeed_layer_forward_s if forward else costs.deepspeed_layer_backward_s
        if per_layer_s > 0 and seg.params and self.layer_params:
            name = f"deepspeed hooks {seg.params[0].name.rsplit('.', 1)[0]}"  # the module hooked
            self.compute(OpKind.HOST, name, seg.unit, mb, per_layer_s * len(seg.params) / self.layer_params)

    def _add_to_bucket(self, p: ParamSpec, unit: str, mb: int, after: int) -> None:
        cfg = self.cfg
        if self.bucket.elements + p.numel > self.zero.reduce_bucket_size:
            self._reduce_bucket(mb)
        bucket = self.bucket
        grad = self.grads.pop(p.name)
        if p.numel > self.zero.reduce_bucket_size or not self.zero.contiguous_gradients:
            # an oversized gradient (or no contiguous buffer) is reduced where it lies
            bucket.grads.append(grad)
            bucket.elements += p.numel
            bucket.copies.append(after)
            if p.numel > self.zero.reduce_bucket_size:
                self._reduce_bucket(mb)
            return
        waits = (self.buffer_free[self.buffer_index],) if self.buffer_index in self.buffer_free else ()
        copy = self.compute(
            OpKind.COPY,
            f"ipg bucket copy {p.name}",
            unit,
            mb,
            cfg.costs.copy_s(p.numel * cfg.param_bytes),
            deps=waits,
            allocs=tuple(self.pending_allocs),
            frees=(grad,),
        )
        self.pending_allocs = []
        bucket.copies.append(copy)
        bucket.elements += p.numel

    def _reduce_bucket(self, mb: int) -> None:
        """``reduce_ipg_grads``: one all-reduce of the bucket, then this rank's slice copied into
        ``grads_in_partition``."""
        cfg, bucket = self.cfg, self.bucket
        if bucket.elements == 0:
            return
        nbytes = bucket.elements * cfg.reduce_bytes
        partition_copy_s = cfg.costs.copy_s(bucket.elements // self.n * cfg.param_bytes)
        offload = self.zero.offload_optimizer.value != "none"
        if self.partition_label is None and self.zero.contiguous_gradients and not offload:
            self._allocate_partition(mb)
        ar = self.collective(
            OpKind.ALL_REDUCE,
            Stream.ALL_REDUCE,
            ROOT,
            nbytes,
            GroupKind.SHARD,
            cfg.reduce_dtype,
            mb=mb,
            deps=tuple(bucket.copies),
            allocs=tuple(self.pending_allocs),
            frees=tuple(bucket.grads),
            extra_s=partition_copy_s,
            name=f"all_reduce ipg bucket ({bucket.elements:,} elements)",
        )
        self.pending_allocs = []
        self.reductions.append(ar)
        if offload:
            self._offload_partition(bucket.elements, mb, ar)
        if self.zero.overlap_comm:
            self.buffer_free[self.buffer_index] = ar
            self.buffer_index = 1 - self.buffer_index
        else:
            self.compute_waits.append(ar)
        self.bucket = Bucket()

    def _allocate_partition(self, mb: int) -> None:
        """The first ``copy_grads_in_partition`` allocates ``grads_in_partition`` (ZeRO-Offload
        copies to the host instead); it lives until the step has read it."""
        self.partition_label = self.label("grads_in_partition", ROOT, mb)
        nbytes = grads_in_partition_numel(self.cfg) * self.cfg.param_bytes
        self.pending_allocs.append(Alloc(label=self.partition_label, category=Mem.GRADS, bytes=nbytes))

    def _offload_partition(self, elements: int, mb: int, after: int) -> None:
        """ZeRO-Offload (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``): this rank's slice of a
        reduced bucket copied to the host's fp32 gradient partition."""
        nbytes = elements // self.n * self.cfg.master_bytes
        d2h_s = self.cfg.host_costs.d2h_s(nbytes)
        self.offloads.append(
            self.transfer(Stream.D2H, "d2h gradient partition", ROOT, mb, nbytes, d2h_s, deps=(after,))
        )

    # -- the optimizer step -----------------------------------------------------------------

    def _scalar_all_reduce(self, name: str, nbytes: int) -> None:
        op = self.collective(
            OpKind.ALL_REDUCE,
            Stream.ALL_REDUCE,
            ROOT,
            nbytes,
            GroupKind.SHARD,
            "fp32",
            mb=self.cfg.grad_accum - 1,
            deps=tuple(self.compute_waits),
            name=name,
        )
        self.compute_waits = [op]

    def _step(self) -> None:
        cfg, mb = self.cfg, self.cfg.grad_accum - 1
        part = self.flat // self.n
        if cfg.param_bytes != cfg.master_bytes:  # the overflow check runs for fp16 and bf16, not fp32
            self._scalar_all_reduce("all_reduce overflow flag", OVERFLOW_FLAG_BYTES)
        self._scalar_all_reduce("all_reduce gradient norm", NORM_BYTES)
        if self.zero.offload_optimizer.value != "none":
            self._offloaded_step(part, mb)
            return
        fp32_grad = "fp32_grad_partition"
        convert_s = cfg.costs.copy_s(part * (cfg.param_bytes + cfg.master_bytes))
        scale_s = cfg.costs.copy_s(part * cfg.master_bytes) if self.zero.loss_scaling else 0.0  # unscale
        step_s = convert_s + scale_s + cfg.costs.optimizer_s(part)
        copy_back_s = cfg.costs.copy_s(part * (cfg.master_bytes + cfg.param_bytes))
        measured = cfg.costs.deepspeed_step_s_per_element
        if measured is not None:  # the whole step measured through the real engine, copy-back included
            step_s, copy_back_s = measured * part, 0.0
        self.compute(
            OpKind.OPTIMIZER,
            "optimizer step (fp32 partition)",
            ROOT,
            mb,
            step_s,
            allocs=(Alloc(label=fp32_grad, category=Mem.GRADS, bytes=part * cfg.master_bytes),),
            frees=(fp32_grad, *([self.partition_label] if self.partition_label else [])),
        )
        copy = self.compute(OpKind.COPY, "fp32 partition -> params", ROOT, mb, copy_back_s)
        self.collective(
            OpKind.ALL_GATHER,
            Stream.ALL_GATHER,
            ROOT,
            self.flat * cfg.param_bytes,
            GroupKind.SHARD,
            cfg.param_dtype,
            mb=mb,
            deps=(copy,),
            name="all_gather parameter partitions",
        )

    def _offloaded_step(self, part: int, mb: int) -> None:
        """ZeRO-Offload: DeepSpeed's CPU Adam on the host partition, then the updated partition
        copied in (training dtype) and all-gathered."""
        cfg = self.cfg
        scale_s = cfg.host_costs.cpu_adam_s(0)  # unscaling is fused into CPU Adam's pass
        step = self.host_optimizer(
            "optimizer step (DeepSpeed CPU Adam)",
            mb,
            cfg.host_costs.cpu_adam_s(part) + scale_s,
            (*self.compute_waits, *self.offloads),
        )
        nbytes = part * cfg.param_bytes
        h2d = self.transfer(
            Stream.H2D,
            "h2d parameter partition",
            ROOT,
            mb,
            nbytes,
            cfg.host_costs.h2d_s(nbytes),
            deps=(step,),
        )
        self.collective(
            OpKind.ALL_GATHER,
            Stream.ALL_GATHER,
            ROOT,
            self.flat * cfg.param_bytes,
            GroupKind.SHARD,
            cfg.param_dtype,
            mb=mb,
            deps=(h2d,),
            name="all_gather parameter partitions",
        )


def build_zero12_program(cfg: StepConfig) -> Program:
    return Zero12ScheduleBuilder(cfg).build()
