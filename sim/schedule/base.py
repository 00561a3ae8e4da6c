"""What every training schedule shares, written once: compute-stream ops in host order, the
forward pass of one segment (with activation checkpointing's block inputs), the recomputation of
a checkpointed block, the backward pass of one segment, and the optimizer step.

A schedule (``sim.schedule.fsdp2``, ``sim.schedule.ddp``, and those to come) extends
``ScheduleBuilder`` with its communication and parameter handling, through the hooks named
``_on_*``. Per-micro-batch state is a fresh dataclass per micro-batch, never reset in place.
"""

from dataclasses import dataclass, field

from sim.core.events import MemoryCategory, OpKind, Stream
from sim.core.program import Alloc, Program
from sim.schedule.model_state import numel_per_rank, resident_allocs
from sim.schedule.step import StepConfig
from sim.workload.options import OptimizerName
from sim.workload.units import ROOT


@dataclass(kw_only=True)
class Activations:
    """One micro-batch's saved activations: segment index -> label, block -> its kept input."""

    saved: dict[int, str] = field(default_factory=dict)
    block_inputs: dict[int, str] = field(default_factory=dict)
    kept: dict[int, str] = field(default_factory=dict)  # segment -> outputs op-level SAC keeps


class ScheduleBuilder:
    def __init__(self, cfg: StepConfig):
        self.cfg = cfg
        self.program = Program(initial=resident_allocs(cfg))
        self.compute_waits: list[int] = []  # ops the next compute-stream op waits for
        self.grad_labels: list[str] = []  # gradients the optimizer step consumes
        self.host_cursor: int | None = None  # the host's last op: nothing it issues starts before
        self._counter = 0

    def label(self, what: str, unit: str, mb: int) -> str:
        """A buffer label unique within the program."""
        self._counter += 1
        return f"{what}:{unit}:mb{mb}:{self._counter}"

    def host(self, name: str, unit: str, mb: int, duration_s: float) -> None:
        """Host work (eager dispatch, FSDP2's hooks) on the host stream, which runs ahead of the
        device: what the host issues after it cannot start before it ends."""
        if duration_s > 0:
            self.host_cursor = self.program.emit(
                stream=Stream.HOST,
                kind=OpKind.HOST,
                name=name,
                unit=unit,
                microbatch=mb,
                duration_s=duration_s,
            )

    def issued(self, deps: tuple[int, ...]) -> tuple[int, ...]:
        """``deps`` and the host's position: an op cannot start before the host has issued it."""
        return deps if self.host_cursor is None else (*deps, self.host_cursor)

    def compute(
        self,
        kind: OpKind,
        name: str,
        unit: str,
        mb: int,
        duration_s: float,
        *,
        deps: tuple[int, ...] = (),
        allocs: tuple[Alloc, ...] = (),
        frees: tuple[str, ...] = (),
        end_allocs: tuple[Alloc, ...] = (),
        start_frees: tuple[str, ...] = (),
        host_s: float = 0.0,
    ) -> int:
        """An op on the compute stream, after ``host_s`` of host dispatch; it also waits for whatever
        the host last waited on."""
        self.host(f"dispatch {name}", unit, mb, host_s)
        deps = self.issued(deps + tuple(self.compute_waits))
        self.compute_waits = []
        return self.program.emit(
            stream=Stream.COMPUTE,
            kind=kind,
            name=name,
            unit=unit,
            microbatch=mb,
            duration_s=duration_s,
            deps=deps,
            allocs=allocs,
            frees=frees,
            end_allocs=end_allocs,
            start_frees=start_frees,
        )

    def checkpointed(self, i: int) -> bool:
        return self.cfg.checkpoint.covers(self.cfg.segments[i].block)

    def first_of_block(self, i: int) -> bool:
        segs = self.cfg.segments
        return i == 0 or segs[i - 1].block != segs[i].block

    # -- forward and recompute ------------------------------------------------------------

    def forward_segment(
        self,
        i: int,
        mb: int,
        acts: Activations,
        *,
        extra_allocs: tuple[Alloc, ...] = (),
        extra_frees: tuple[str, ...] = (),
    ) -> int:
        """Segment ``i``'s forward: it saves its activations (a checkpointed block only its input,
        its intermediates living while the block runs) and holds its transient while it runs."""
        cfg, seg, fig = self.cfg, self.cfg.segments[i], self.cfg.figures[i]
        allocs: list[Alloc] = []
        frees: list[str] = []
        if self.checkpointed(i) and seg.block not in acts.block_inputs:
            kept = self.label("block_input", seg.unit, mb)
            acts.block_inputs[seg.block] = kept  # type: ignore[index]
            allocs.append(Alloc(label=kept, category=MemoryCategory.ACTIVATIONS, bytes=cfg.block_input_bytes))
        saved = self.label("activations", seg.unit, mb)
        allocs.append(Alloc(label=saved, category=MemoryCategory.ACTIVATIONS, bytes=fig.saved_bytes))
        if self.checkpointed(i):
            frees.append(saved)
            if cfg.checkpoint.selective_op and fig.sac_kept_bytes:
                acts.kept[i] = self.label("sac_kept", seg.unit, mb)
                allocs.append(
                    Alloc(label=acts.kept[i], category=MemoryCategory.ACTIVATIONS, bytes=fig.sac_kept_bytes)
                )
        else:
            acts.saved[i] = saved
        transient = self.label("forward_temp", seg.unit, mb)
        allocs += [
            *extra_allocs,
            Alloc(label=transient, category=MemoryCategory.OTHER, bytes=fig.forward_transient_bytes),
        ]
        frees += [transient, *extra_frees]
        return self.compute(
            OpKind.FORWARD,
            seg.name,
            seg.unit,
            mb,
            fig.forward_s,
            allocs=tuple(allocs),
            frees=tuple(frees),
            host_s=fig.forward_host_s,
        )

    def recompute_block(self, block: int, mb: int, acts: Activations) -> None:
        """Checkpointing's second forward of ``block``, just before its backward: every segment's
        activations are saved again (less what op-level SAC kept) and its transient held while it runs."""
        selective = self.cfg.checkpoint.selective_op
        for i, seg in enumerate(self.cfg.segments):
            if seg.block != block:
                continue
            self._on_recompute_segment(seg.unit, mb)
            fig = self.cfg.figures[i]
            recomputed_bytes = max(0, fig.saved_bytes - fig.sac_kept_bytes) if selective else fig.saved_bytes
            saved = self.label("recomputed_activations", seg.unit, mb)
            transient = self.label("recompute_temp", seg.unit, mb)
            acts.saved[i] = saved
            self.compute(
                OpKind.RECOMPUTE,
                seg.name,
                seg.unit,
                mb,
                fig.sac_recompute_s if selective else fig.recompute_s,
                allocs=(
                    Alloc(label=saved, category=MemoryCategory.ACTIVATIONS, bytes=recomputed_bytes),
                    Alloc(label=transient, category=MemoryCategory.OTHER, bytes=fig.forward_transient_bytes),
                ),
                frees=(transient,),
                host_s=fig.forward_host_s,
            )

    def _on_recompute_segment(self, unit: str, mb: int) -> None:
        """Before a segment is recomputed (FSDP2 gathers its unit again)."""

    # -- backward and the optimizer -----------------------------------------------------------

    def backward_segment(
        self,
        i: int,
        mb: int,
        acts: Activations,
        *,
        end_allocs: tuple[Alloc, ...],
        extra_frees: tuple[str, ...] = (),
    ) -> int:
        """Segment ``i``'s backward: it frees the activations it consumes (and, first in its block,
        the block's kept input) and leaves ``end_allocs`` (its gradients) behind."""
        seg, fig = self.cfg.segments[i], self.cfg.figures[i]
        transient = self.label("backward_temp", seg.unit, mb)
        frees = [transient, acts.saved.pop(i), *extra_frees]
        if i in acts.kept:
            frees.append(acts.kept.pop(i))
        if seg.block is not None and seg.block in acts.block_inputs and self.first_of_block(i):
            frees.append(acts.block_inputs.pop(seg.block))
        return self.compute(
            OpKind.BACKWARD,
            seg.name,
            seg.unit,
            mb,
            fig.backward_s,
            allocs=(
                Alloc(label=transient, category=MemoryCategory.OTHER, bytes=fig.backward_transient_bytes),
            ),
            frees=tuple(frees),
            end_allocs=end_allocs,
            host_s=fig.backward_host_s,
        )

    def optimizer_step(self) -> None:
        """One step over the parameters this rank holds; ``zero_grad(set_to_none=True)`` after it.
        foreach AdamW holds one fp32 temporary per parameter (the sqrt of exp_avg_sq)."""
        cfg = self.cfg
        numel = numel_per_rank(cfg)
        temp = "optimizer_temp"
        temp_bytes = numel * cfg.master_bytes if cfg.optimizer is OptimizerName.ADAMW else 0
        self.compute(
            OpKind.OPTIMIZER,
            "optimizer step",
            ROOT,
            cfg.grad_accum - 1,
            cfg.costs.optimizer_s(numel),
            allocs=(Alloc(label=temp, category=MemoryCategory.OTHER, bytes=temp_bytes),),
            frees=(temp, *self.grad_labels),
        )
