"""What every training schedule shares, written once (on ``sim.schedule.emit.OpEmitter``, which
puts ops into the program): the forward pass of one segment (with activation checkpointing's
block inputs), the recomputation of a checkpointed block, the backward pass of one segment, and
the optimizer step (``sim.schedule.optimizer``). Where long-lived activations (a kept output, a
KV cache, the eager attention masks) begin and end is ``sim.schedule.activation_life``'s.

A schedule (``sim.schedule.fsdp2``, ``sim.schedule.ddp``, and those to come) extends
``ScheduleBuilder`` with its communication and parameter handling, through the hooks named
``_on_*``. Per-micro-batch state is a fresh dataclass per micro-batch, never reset in place.
"""

from dataclasses import dataclass, field, replace

from sim.core.events import MemoryCategory, OpKind, RequestOrder
from sim.core.program import Alloc, Program
from sim.schedule.activation_life import (
    attention_segment,
    bias_grads_begun,
    bias_grads_ended,
    cache_appends,
    cache_holder,
    first_of_block,
    held_block_input_bytes,
    next_region_checkpointed,
    previous_output,
    stack_mask_end,
    stack_mask_made,
)
from sim.schedule.emit import OpEmitter
from sim.schedule.model_state import resident_allocs
from sim.schedule.optimizer import emit_optimizer_step
from sim.schedule.step import StepConfig
from sim.workload.units import ROOT, input_needs_grad


@dataclass(kw_only=True)
class Activations:
    """One micro-batch's saved activations: segment index -> label, block -> its kept input."""

    saved: dict[int, str] = field(default_factory=dict)
    block_inputs: dict[int, str] = field(default_factory=dict)
    kept: dict[int, str] = field(default_factory=dict)  # segment -> outputs op-level SAC keeps
    # block -> what of a checkpointed block's saves an unchecked region after it keeps
    kept_after_block: dict[int, list[str]] = field(default_factory=dict)
    kv_cache: list[str] = field(default_factory=list)  # model.use_cache: each block's cached K/V
    # each of the decoder stack's attention masks (by its place in ``StepConfig.stack_masks``): its
    # label, while it lives
    stack_masks: dict[int, str] = field(default_factory=dict)
    # each accumulated stack-bias gradient (by its place in ``StepConfig.stack_biases``): its
    # label, while it lives
    bias_grads: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class UnitLayout:
    """Where each unit's segments lie, and how FSDP hooks see it (computed once per step)."""

    padded: dict[str, int]
    first_seg: dict[str, int]
    last_seg: dict[str, int]
    forward_units: list[str]  # non-root units in forward order
    needs_grad: dict[str, bool]

    @staticmethod
    def of(cfg: StepConfig) -> "UnitLayout":
        segs = cfg.segments
        first = {u.name: min(i for i, s in enumerate(segs) if s.unit == u.name) for u in cfg.units}
        return UnitLayout(
            padded={u.name: cfg.padded_numel(u) for u in cfg.units},
            first_seg=first,
            last_seg={u.name: max(i for i, s in enumerate(segs) if s.unit == u.name) for u in cfg.units},
            forward_units=[s.unit for i, s in enumerate(segs) if s.unit != ROOT and first[s.unit] == i],
            needs_grad={u.name: input_needs_grad(u, list(segs)) for u in cfg.units},
        )


class ScheduleBuilder(OpEmitter):
    def __init__(self, cfg: StepConfig):
        super().__init__(cfg, Program(initial=resident_allocs(cfg) + previous_output(cfg)))
        # training.keep_outputs: the labels of the output the loop holds, and the micro-batch
        # whose cache it holds (freed when the next forward returns)
        self.held_output: list[str] = ["previous_output"] if cfg.kept_output_bytes else []
        self.held_cache: Activations | None = None
        self.grad_labels: list[str] = []  # gradients the optimizer step consumes

    def checkpointed(self, i: int) -> bool:
        return self.cfg.checkpoint.covers(self.cfg.segments[i].block)

    def first_of_block(self, i: int) -> bool:
        return first_of_block(self.cfg, i)

    # -- forward and recompute ------------------------------------------------------------

    def saved_and_transient(
        self, saved: Alloc, transient: Alloc, order: RequestOrder | None
    ) -> tuple[Alloc, Alloc]:
        """A forward's saved buffer and its transient, with the order in which its ops make and
        free their tensors (``SegmentFigures.forward_order``) on the first that holds bytes: the
        caching allocator's replay serves both in that order."""
        if order is None or not order.events:
            return saved, transient
        if saved.bytes > 0:
            partner = transient.label if transient.bytes > 0 else ""
            return replace(saved, order=replace(order, partner=partner)), transient
        if transient.bytes > 0:  # all it leaves live is the transient's (freed as the segment ends)
            return saved, replace(transient, order=order)
        return saved, transient

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
        seg, fig = self.cfg.segments[i], self.cfg.figures[i]
        allocs, frees, transient_alloc = self._forward_saves(i, mb, acts)
        end_allocs, output_frees = self._cache_and_output(i, mb, acts)
        frees += output_frees
        allocs += self._stack_masks_made(i, mb, acts)
        frees += self._stack_masks_dropped(i, acts, backward=False)
        allocs += [*extra_allocs, transient_alloc]
        frees += [transient_alloc.label, *extra_frees]
        return self.compute(
            OpKind.FORWARD,
            seg.name,
            seg.unit,
            mb,
            fig.forward_s,
            allocs=tuple(allocs),
            frees=tuple(frees),
            end_allocs=end_allocs,
            host_s=fig.forward_host_s,
            launches=fig.forward_launches,
        )

    def _forward_saves(self, i: int, mb: int, acts: Activations) -> tuple[list[Alloc], list[str], Alloc]:
        """What segment ``i``'s forward saves and allocates for itself, which of it the forward
        frees again (a checkpointed block's saves, recomputed in backward), and its transient."""
        cfg, seg, fig = self.cfg, self.cfg.segments[i], self.cfg.figures[i]
        allocs: list[Alloc] = []
        frees: list[str] = []
        block = seg.block
        if self.checkpointed(i) and block is not None and block not in acts.block_inputs:
            # less what a region before it that keeps its saves holds of it already
            kept_bytes = max(0, cfg.block_input_bytes[block] - held_block_input_bytes(cfg, block))
            if kept_bytes:
                kept = self.label("block_input", seg.unit, mb)
                acts.block_inputs[block] = kept
                allocs.append(Alloc(label=kept, category=MemoryCategory.ACTIVATIONS, bytes=kept_bytes))
        saved = self.label("activations", seg.unit, mb)
        saved_bytes, transient_bytes = fig.saved_bytes, fig.forward_transient_bytes
        saved_pieces, transient_pieces = fig.tensors("saved"), fig.tensors("forward_transient")
        order = fig.forward_order
        if self.checkpointed(i):  # no second copy of the block's kept input while the block runs
            saved_bytes, saved_pieces = self._less_block_input(i, saved_bytes, saved_pieces)
        if (
            self.checkpointed(i)
            and fig.checkpointed_forward_bytes is not None
            and not cfg.checkpoint.selective_op
        ):
            # measured: what the checkpointed block holds while the segment runs (a save lives
            # only to its last forward use), in place of all its saves plus its transient
            saved_bytes, transient_bytes = fig.checkpointed_forward_bytes, 0
            saved_pieces, transient_pieces = fig.tensors("checkpointed_forward"), ()
            order = fig.checkpointed_forward_order
        transient = self.label("forward_temp", seg.unit, mb)
        saved_alloc, transient_alloc = self.saved_and_transient(
            Alloc(label=saved, category=MemoryCategory.ACTIVATIONS, bytes=saved_bytes, pieces=saved_pieces),
            Alloc(
                label=transient, category=MemoryCategory.OTHER, bytes=transient_bytes, pieces=transient_pieces
            ),
            order,
        )
        allocs.append(saved_alloc)
        if self.checkpointed(i):
            frees.append(saved)
            allocs += self._kept_past_checkpoint(i, mb, acts)
        else:
            acts.saved[i] = saved
        return allocs, frees, transient_alloc

    def _less_block_input(self, i: int, nbytes: int, pieces: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """Checkpointed segment ``i``'s saved bytes and tensors, less, first in its block, the
        block's input, which its first op saves as it is (``SegmentFigures.block_input_saved_bytes``)
        and the checkpoint keeps already: taken from the first tensor, the op's own."""
        less = self.cfg.figures[i].block_input_saved_bytes
        if not less or not self.first_of_block(i):
            return nbytes, pieces
        if pieces and pieces[0] >= less:
            pieces = tuple(p for p in (pieces[0] - less, *pieces[1:]) if p > 0)
        else:
            pieces = ()
        return nbytes - less, pieces

    def _kept_past_checkpoint(self, i: int, mb: int, acts: Activations) -> list[Alloc]:
        """What a checkpointed segment's forward keeps for backward all the same: the saves that
        outlive the block when the next region is not checkpointed, and selective op
        checkpointing's kept outputs."""
        cfg, seg, fig = self.cfg, self.cfg.segments[i], self.cfg.figures[i]
        allocs: list[Alloc] = []
        if fig.saved_after_block_bytes and not next_region_checkpointed(cfg, i):
            label = self.label("kept_after_block", seg.unit, mb)
            acts.kept_after_block.setdefault(seg.block, []).append(label)  # type: ignore[arg-type]
            allocs.append(
                Alloc(label=label, category=MemoryCategory.ACTIVATIONS, bytes=fig.saved_after_block_bytes)
            )
        if cfg.checkpoint.selective_op and fig.sac_kept_bytes:
            acts.kept[i] = self.label("sac_kept", seg.unit, mb)
            allocs.append(
                Alloc(label=acts.kept[i], category=MemoryCategory.ACTIVATIONS, bytes=fig.sac_kept_bytes)
            )
        return allocs

    def _cache_and_output(self, i: int, mb: int, acts: Activations) -> tuple[tuple[Alloc, ...], list[str]]:
        """What segment ``i`` leaves behind when it ends (a checkpointed block's KV cache, the
        step's kept output), and what it frees (the output and cache held from before, or the
        cache nothing holds)."""
        cfg, seg = self.cfg, self.cfg.segments[i]
        block = seg.block
        frees: list[str] = []
        # model.use_cache: the cache keeps a checkpointed block's K/V past the block (an unchecked
        # block's are saved for its backward anyway: the cache shares their storage); until its
        # attention has run they are the block's own tensors, so the cache takes them from the
        # end of the segment that runs it
        cached = cfg.kv_cache_bytes[block] if cfg.kv_cache_bytes and block is not None else 0
        end_allocs: tuple[Alloc, ...] = ()
        if cached and self.checkpointed(i) and i == attention_segment(cfg, block):
            cache = self.label("kv_cache", seg.unit, mb)
            acts.kv_cache.append(cache)
            end_allocs = (Alloc(label=cache, category=MemoryCategory.ACTIVATIONS, bytes=cached),)
        if i == len(cfg.segments) - 1 and cfg.kept_output_bytes:  # the new output replaces the held one
            frees += self.held_output
            if self.held_cache is not None:
                frees += self.held_cache.kv_cache
                self.held_cache.kv_cache = []
            logits = self.label("model_output", seg.unit, mb)
            end_allocs = (
                *end_allocs,
                Alloc(label=logits, category=MemoryCategory.ACTIVATIONS, bytes=cfg.kept_output_bytes),
            )
            self.held_output, self.held_cache = [logits], acts
        elif i == len(cfg.segments) - 1 and cache_holder(cfg) is None:  # the output (and cache) dropped
            frees += acts.kv_cache
            acts.kv_cache = []
        return end_allocs, frees

    def _stack_masks_made(self, i: int, mb: int, acts: Activations) -> list[Alloc]:
        """HF's attention masks (``StepConfig.stack_masks``), built by their stack before its
        first block: allocated as that block's forward starts (``stack_mask_made``)."""
        allocs = []
        for k, mask in enumerate(self.cfg.stack_masks):
            if not stack_mask_made(self.cfg, k, i):
                continue
            acts.stack_masks[k] = self.label("stack_masks" if k == 0 else f"stack_masks#{k}", ROOT, mb)
            allocs.append(
                Alloc(label=acts.stack_masks[k], category=MemoryCategory.ACTIVATIONS, bytes=mask.bytes)
            )
        return allocs

    def _stack_masks_dropped(self, i: int, acts: Activations, *, backward: bool) -> list[str]:
        """The masks' frees, each at the end ``stack_mask_end`` names."""
        ending = [k for k in acts.stack_masks if stack_mask_end(self.cfg, k, i, backward=backward)]
        return [acts.stack_masks.pop(k) for k in ending]

    def recompute_block(self, block: int, mb: int, acts: Activations) -> None:
        """Checkpointing's second forward of ``block``, just before its backward: every segment's
        activations are saved again (less what op-level SAC kept) and its transient held while it
        runs; what the region after the block kept of its forward is gone by then (that region's
        backward has run), and is dropped as the recompute starts."""
        selective = self.cfg.checkpoint.selective_op
        start_frees = tuple(acts.kept_after_block.pop(block, ()))
        cache = self.cfg.kv_cache_bytes[block] if cache_appends(self.cfg) else 0
        for i, seg in enumerate(self.cfg.segments):
            if seg.block != block:
                continue
            self._before_recompute(i, mb)
            fig = self.cfg.figures[i]
            extra: tuple[Alloc, ...] = ()
            if cache:  # the recompute appends the block's K/V to the cache it still holds
                label = self.label("kv_cache_recomputed", seg.unit, mb)
                acts.kv_cache.append(label)
                extra, cache = (Alloc(label=label, category=MemoryCategory.ACTIVATIONS, bytes=cache),), 0
            recomputed_bytes = max(0, fig.saved_bytes - fig.sac_kept_bytes) if selective else fig.saved_bytes
            saved = self.label("recomputed_activations", seg.unit, mb)
            transient = self.label("recompute_temp", seg.unit, mb)
            acts.saved[i] = saved
            whole = recomputed_bytes == fig.saved_bytes  # op-level SAC recomputes part of it
            pieces = fig.tensors("saved") if whole else ()
            if whole:  # what its first op saves of the block's input is the kept input: not made again
                recomputed_bytes, pieces = self._less_block_input(i, recomputed_bytes, pieces)
            saved_alloc, transient_alloc = self.saved_and_transient(
                Alloc(
                    label=saved,
                    category=MemoryCategory.ACTIVATIONS,
                    bytes=recomputed_bytes,
                    pieces=pieces,
                ),
                self._recompute_transient(i, transient),
                fig.forward_order if whole and not selective else None,
            )
            op = self.compute(
                OpKind.RECOMPUTE,
                seg.name,
                seg.unit,
                mb,
                fig.sac_recompute_s if selective else fig.recompute_s,
                allocs=(saved_alloc, transient_alloc, *extra),
                frees=(transient,),
                start_frees=start_frees,
                host_s=fig.forward_host_s,
                launches=fig.forward_launches,
            )
            start_frees = ()
            self._after_recompute(i, op)

    def _recompute_transient(self, i: int, label: str) -> Alloc:
        """What segment ``i``'s recompute holds beyond its saves while it runs: what its block's
        ops make (``SegmentFigures.recompute_transient_bytes``), where measured; else its forward
        transient."""
        fig = self.cfg.figures[i]
        figure = "forward_transient" if fig.recompute_transient_bytes is None else "recompute_transient"
        return Alloc(
            label=label,
            category=MemoryCategory.OTHER,
            bytes=getattr(fig, f"{figure}_bytes"),
            pieces=fig.tensors(figure),
        )

    def _before_recompute(self, i: int, mb: int) -> None:
        """Just before segment ``i``'s recompute is issued (FSDP2 gathers its unit again, then
        expert parallelism's dispatch)."""

    def _after_recompute(self, i: int, op: int) -> None:
        """Just after segment ``i``'s recompute ``op`` is issued (expert parallelism's combine)."""

    # -- backward and the optimizer -----------------------------------------------------------

    def backward_segment(
        self,
        i: int,
        mb: int,
        acts: Activations,
        *,
        end_allocs: tuple[Alloc, ...],
        extra_frees: tuple[str, ...] = (),
        in_place_grad_bytes: int = 0,
    ) -> int:
        """Segment ``i``'s backward: it frees the activations it consumes (and, first in its block,
        the block's kept input) and leaves ``end_allocs`` (its gradients) behind; while it runs it
        holds its ops' transient and the gradients its later ops made (``backward_held``).
        ``in_place_grad_bytes``: gradients it adds into kept ones instead (accumulation into an
        existing ``.grad``), each alive only while its op runs."""
        seg, fig = self.cfg.segments[i], self.cfg.figures[i]
        transient = self.label("backward_temp", seg.unit, mb)
        consumed = acts.saved[i]
        frees = [
            transient,
            acts.saved.pop(i),
            *extra_frees,
            *self._stack_masks_dropped(i, acts, backward=True),
        ]
        if i in acts.kept:
            frees.append(acts.kept.pop(i))
        frees += self._block_input_frees(i, acts)
        end_allocs = (
            *end_allocs,
            *self._kept_output_cache(i, mb, acts),
            *self._bias_grads_begun(i, mb, acts),
        )
        # the gradients the segment's ops make before its last op's backward are alive beside it
        kept = sum(a.bytes for a in end_allocs if a.category is MemoryCategory.GRADS)
        held_bytes, held_pieces = fig.backward_held(
            kept or in_place_grad_bytes, in_place=not kept and in_place_grad_bytes > 0
        )
        return self.compute(
            OpKind.BACKWARD,
            seg.name,
            seg.unit,
            mb,
            fig.backward_s,
            allocs=(
                Alloc(
                    label=transient,
                    category=MemoryCategory.OTHER,
                    bytes=held_bytes,
                    pieces=held_pieces,
                    order=self._backward_order(i, consumed),
                ),
            ),
            frees=tuple(frees),
            end_allocs=end_allocs,
            start_frees=tuple(
                acts.bias_grads.pop(k) for k in bias_grads_ended(self.cfg, i) if k in acts.bias_grads
            ),
            host_s=fig.backward_host_s,
            launches=fig.backward_launches,
        )

    def _bias_grads_begun(self, i: int, mb: int, acts: Activations) -> tuple[Alloc, ...]:
        """The stack biases' accumulated gradients segment ``i``'s backward leaves
        (``bias_grads_begun``), alive until the backward of the block that made the bias."""
        allocs = []
        for k in bias_grads_begun(self.cfg, i):
            acts.bias_grads[k] = self.label("bias_grad" if k == 0 else f"bias_grad#{k}", ROOT, mb)
            allocs.append(
                Alloc(
                    label=acts.bias_grads[k],
                    category=MemoryCategory.OTHER,
                    bytes=self.cfg.stack_biases[k].bytes,
                )
            )
        return tuple(allocs)

    def _block_input_frees(self, i: int, acts: Activations) -> list[str]:
        """What the first backward segment of a block releases: the block's kept input, and the
        K/V cache where this block's region is the one that lets it go."""
        block = self.cfg.segments[i].block
        if block is None or not self.checkpointed(i) or not self.first_of_block(i):
            return []
        frees = [acts.block_inputs.pop(block)] if block in acts.block_inputs else []
        if block == cache_holder(self.cfg):
            frees += acts.kv_cache
            acts.kv_cache = []
        return frees

    def _kept_output_cache(self, i: int, mb: int, acts: Activations) -> tuple[Alloc, ...]:
        """A kept output's cache holds the K/V an unchecked block saved past the block's backward:
        allocated (as the block's saved tensors are released) at its first backward segment."""
        cfg, seg = self.cfg, self.cfg.segments[i]
        if not (
            cfg.kept_output_bytes
            and cfg.kv_cache_bytes
            and seg.block is not None
            and not self.checkpointed(i)
            and self.first_of_block(i)
        ):
            return ()
        cache = self.label("kv_cache", seg.unit, mb)
        acts.kv_cache.append(cache)
        return (Alloc(label=cache, category=MemoryCategory.ACTIVATIONS, bytes=cfg.kv_cache_bytes[seg.block]),)

    def _backward_order(self, i: int, consumed: str) -> RequestOrder | None:
        """Segment ``i``'s backward order (``SegmentFigures.backward_order``), releasing tensors of
        ``consumed``: where the segment's activations were served in the forward's order (its
        forward, or its block's recompute, not op-level SAC's partial one)."""
        cfg, fig = self.cfg, self.cfg.figures[i]
        if (
            fig.backward_order is None
            or fig.forward_order is None
            or fig.saved_bytes <= 0
            or (self.checkpointed(i) and cfg.checkpoint.selective_op)
        ):
            return None
        return replace(fig.backward_order, consumed=consumed)

    def optimizer_step(self) -> None:
        """The optimizer step over what this rank holds (``sim.schedule.optimizer``), consuming
        the gradients the schedule left in ``grad_labels``."""
        emit_optimizer_step(self, tuple(self.grad_labels))
