"""FSDP2's ``offload_policy=CPUOffloadPolicy(pin_memory=...)``: the PCIe copies and the CPU step.

What torch 2.13 does (``_fully_shard/_fsdp_param.py``, ``_fsdp_collectives.py``,
``_fsdp_param_group.py``), and how the FSDP2 schedule replays it:
- ``FSDPParam._init_sharded_param``: every padded shard moves to the CPU (``pin_memory()`` when
  pinned); the device keeps no sharded parameter, gradient or optimizer state.
- All-gather copy-in (``_get_param_all_gather_inputs``; offload turns the foreach-copy fast path off,
  so ``FSDPParam.all_gather_inputs`` runs per parameter on the all-gather copy-in stream): the shard
  ``.to(device, non_blocking=True)``, then cast to ``param_dtype``. A host-to-device copy on the
  ``h2d`` stream before the all-gather, into a device copy of the shards as stored; a parameter cast
  to ``param_dtype`` keeps only its cast, its stored copy being dropped at once (the largest of those
  is a transient of the copy). From pinned memory the copy is asynchronous; from pageable memory CUDA
  stages it through a pinned buffer and returns once the data is staged (CUDA Runtime API, "API
  synchronization behavior"): the host waits for the copy.
- Post-reduce (``foreach_reduce``, on the post-reduce stream: the reduce-scatter's, HSDP's all-reduce's):
  the reduced shard cast to the parameter's dtype, then ``.to("cpu", non_blocking=pin_memory)``; the
  device gradient is dropped at once ("future RS-stream ops run after the copy"). A device-to-host copy
  on the ``d2h`` stream after the reduction, which the next reduction of that stream waits for. Pinned:
  the host records ``grad_offload_event``, which ``finalize_backward`` synchronises on before the
  optimizer; pageable: the copy is blocking and the host waits for it in the post-backward hook.
- The optimizer steps the CPU shards (``torch.optim`` on CPU tensors, ``HostCosts.cpu_torch_optimizer_s``)
  on the host, after every gradient has arrived.
Where the device is the host (a CPU machine) ``Tensor.to`` returns the tensor itself: nothing moves,
and the schedule is FSDP2's without offload (``StepConfig.fsdp2_host_state``).
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory as Mem
from sim.core.events import Stream
from sim.core.program import Alloc
from sim.schedule.base import ScheduleBuilder


@dataclass(frozen=True, kw_only=True)
class OffloadBytes:
    """One unit's host-to-device copy: the shards as the host stores them (``h2d``), the part that stays
    as it is until the copy-in (``kept``: parameters not cast), the cast shards in ``param_dtype``
    (``cast``) and the largest shard of a cast parameter as stored (``staging``, freed after its cast)."""

    h2d: int
    kept: int
    cast: int
    staging: int


@dataclass
class OffloadCopies:
    """The copies and the CPU step of one FSDP2 step with ``CPUOffloadPolicy``."""

    builder: ScheduleBuilder
    pinned: bool
    d2h_ops: list[int] = field(default_factory=list)
    reduce_stream_tail: int | None = None  # the last D2H: the next reduction on that stream follows it

    def h2d(
        self, unit: str, mb: int, sizes: OffloadBytes, deps: tuple[int, ...]
    ) -> tuple[int, tuple[str, ...]]:
        """The unit's shards copied to the device before its all-gather; returns the copy and the device
        buffers the all-gather's copy-in consumes (freed when it ends)."""
        b = self.builder
        kept, cast, staging = (
            b.label(what, unit, mb) for what in ("offloaded_shard", "all_gather_input", "h2d_staging")
        )
        allocs = [
            Alloc(label=kept, category=Mem.COMM_BUFFERS, bytes=sizes.kept),
            Alloc(label=cast, category=Mem.COMM_BUFFERS, bytes=sizes.cast),
            Alloc(label=staging, category=Mem.COMM_BUFFERS, bytes=sizes.staging),
        ]
        op = b.transfer(
            Stream.H2D,
            f"h2d {unit}",
            unit,
            mb,
            sizes.h2d,
            b.cfg.host_costs.h2d_s(sizes.h2d, pinned=self.pinned),
            deps=deps,
            allocs=tuple(allocs),
            frees=(staging,),
        )
        if not self.pinned:
            b.host_wait(f"pageable h2d {unit}", op, mb)
        return op, (kept, cast)

    def d2h(self, unit: str, mb: int, nbytes: int, after: int, device_frees: tuple[str, ...]) -> int:
        """The unit's reduced gradient shard (``nbytes`` in the parameters' dtype) copied to the host
        after ``after``, the last reduction; the device buffers ``device_frees`` go when it is done.
        A reduction in ``reduce_dtype`` other than the parameters' is cast on the device first."""
        b = self.builder
        cfg = b.cfg
        allocs: tuple[Alloc, ...] = ()
        frees = device_frees
        if cfg.reduce_bytes != cfg.master_bytes:
            cast = b.label("sharded_grad_cast", unit, mb)
            allocs, frees = (Alloc(label=cast, category=Mem.GRADS, bytes=nbytes),), (*device_frees, cast)
        op = b.transfer(
            Stream.D2H,
            f"d2h gradient {unit}",
            unit,
            mb,
            nbytes,
            cfg.host_costs.d2h_s(nbytes, pinned=self.pinned),
            deps=(after,),
            allocs=allocs,
            frees=frees,
        )
        self.d2h_ops.append(op)
        self.reduce_stream_tail = op
        if not self.pinned:
            b.host_wait(f"pageable d2h {unit}", op, mb)
        return op

    def optimizer_step(self, mb: int, numel: int) -> None:
        """``finalize_backward`` waits for every gradient copy; the optimizer then steps the CPU shards."""
        b = self.builder
        cost = b.cfg.host_costs.cpu_torch_optimizer_s(b.cfg.optimizer, numel)
        b.host_optimizer("optimizer step (CPU)", mb, cost, (*b.compute_waits, *self.d2h_ops))
