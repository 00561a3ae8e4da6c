"""Stage 3's gradient reduction (``stage3.py``, DeepSpeed 0.19.8): each gradient copied into the
IPG bucket (``reduce_bucket_size`` elements) on the reduction stream, its own storage dropped; a
full bucket reduce-scattered (``reduce_scatter_coalesced``: every gradient padded to a multiple of
N, one reduce-scatter) and added into the rank's gradient partitions, which ZeRO-Offload then
copies to the host. With ``overlap_comm`` (stage 3's default) this runs beside the backward pass;
the next bucket's copies wait for the previous reduce-scatter. The ZeRO-3 schedule
(``sim.schedule.zero3``) hands it each gradient as the backward makes it.
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import OpKind, Stream
from sim.core.program import Alloc
from sim.core.topology import GroupKind
from sim.schedule.emit import OpEmitter
from sim.schedule.zero_state import gathered_numel
from sim.workload.model import ParamSpec
from sim.workload.options import ZeroOptions
from sim.workload.units import ROOT


@dataclass(kw_only=True)
class Bucket:
    elements: int = 0  # padded to the partition multiple, as reduce_scatter_coalesced pads
    copies: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class GradientBuckets:
    """The IPG buckets of one stage-3 step, issued through ``emitter``."""

    emitter: OpEmitter
    zero: ZeroOptions
    bucket: Bucket = field(default_factory=Bucket)
    last_reduce: int | None = None
    reductions: list[int] = field(default_factory=list)  # every one so far: the step waits for them

    def add_grad(self, p: ParamSpec, mb: int, after: int, grad_label: str) -> None:
        """``__add_grad_to_ipg_bucket`` of gradient ``grad_label``, made by op ``after`` (reduce
        the bucket first if the gradient would overflow it)."""
        e, cfg = self.emitter, self.emitter.cfg
        padded = gathered_numel(p, cfg.world_size)
        if self.bucket.elements + padded > self.zero.reduce_bucket_size:
            self.reduce_bucket(mb)
        deps = (after,) if self.last_reduce is None else (after, self.last_reduce)
        copy = e.program.emit(
            stream=Stream.REDUCE_SCATTER if self.zero.overlap_comm else Stream.COMPUTE,
            kind=OpKind.COPY,
            name=f"ipg bucket copy {p.name}",
            unit=ROOT,
            microbatch=mb,
            duration_s=cfg.costs.copy_s(p.numel * cfg.param_bytes),
            deps=e.issued(deps),
            frees=(grad_label,),
        )
        self.bucket.copies.append(copy)
        self.bucket.elements += padded

    def reduce_bucket(self, mb: int) -> None:
        """``__reduce_and_partition_ipg_grads``: pad and interleave, reduce-scatter, add the
        partitions into the gradient partitions."""
        e, cfg, bucket, n = self.emitter, self.emitter.cfg, self.bucket, self.emitter.cfg.world_size
        if bucket.elements == 0:
            return
        flat = e.label("reduce_scatter_flat", ROOT, mb)
        rs = e.collective(
            OpKind.REDUCE_SCATTER,
            Stream.REDUCE_SCATTER,
            ROOT,
            bucket.elements * cfg.reduce_bytes,
            GroupKind.SHARD,
            cfg.reduce_dtype,
            mb=mb,
            deps=tuple(bucket.copies),
            allocs=(Alloc(label=flat, category=Mem.COMM_BUFFERS, bytes=bucket.elements * cfg.reduce_bytes),),
            frees=(flat,),
            extra_s=cfg.costs.copy_s(bucket.elements * cfg.reduce_bytes) * (1 + 1 / n),
            name=f"reduce_scatter ipg bucket ({bucket.elements:,} elements)",
        )
        self.last_reduce = rs
        self.reductions.append(rs)
        if self.zero.offload_optimizer.value != "none":  # the fp32 gradient partition lives on the host
            nbytes = bucket.elements // n * cfg.master_bytes
            d2h_s = cfg.host_costs.d2h_s(nbytes)
            self.reductions.append(
                e.transfer(Stream.D2H, "d2h gradient partition", ROOT, mb, nbytes, d2h_s, deps=(rs,))
            )
        if not self.zero.overlap_comm:
            e.compute_waits.append(rs)
        self.bucket = Bucket()
