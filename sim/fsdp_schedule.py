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

from typing import Any

from sim.events import MemoryCategory as Mem
from sim.events import OpKind, Stream
from sim.program import Alloc, Program
from sim.step_config import OPTIMIZER_STATES, StepConfig
from sim.topology import GroupKind
from sim.units import ROOT, input_needs_grad


class FsdpScheduleBuilder:
    def __init__(self, cfg: StepConfig):
        self.cfg = cfg
        self.p = Program()
        self.w = cfg.shard_size
        self.units = {u.name: u for u in cfg.units}
        self.padded = {u.name: u.padded_numel(self.w) for u in cfg.units}
        segs = cfg.segments
        self.first_seg = {u: min(i for i, s in enumerate(segs) if s.unit == u) for u in self.units}
        self.last_seg = {u: max(i for i, s in enumerate(segs) if s.unit == u) for u in self.units}
        self.forward_units = [
            s.unit for i, s in enumerate(segs) if s.unit != ROOT and self.first_seg[s.unit] == i
        ]
        self.needs_grad = {u.name: input_needs_grad(u, list(segs)) for u in cfg.units}
        self.last_collective: dict[GroupKind, int] = {}
        self.compute_waits: list[int] = []
        self.grad_labels: list[str] = []
        self.reductions: list[int] = []
        self.counter = 0

    # -- helpers -------------------------------------------------------------------------

    def _label(self, what: str, unit: str, mb: int) -> str:
        self.counter += 1
        return f"{what}:{unit}:mb{mb}:{self.counter}"

    def _compute(self, kind: OpKind, name: str, unit: str, mb: int, duration_s: float, **kw: Any) -> int:
        deps = tuple(kw.pop("deps", ())) + tuple(self.compute_waits)
        self.compute_waits = []
        return self.p.emit(Stream.COMPUTE, kind, name, unit, mb, duration_s, deps=deps, **kw)

    def _collective(
        self,
        kind: OpKind,
        stream: Stream,
        unit: str,
        mb: int,
        nbytes: int,
        group: GroupKind,
        dtype: str,
        **kw: Any,
    ) -> int:
        deps = list(kw.pop("deps", ()))
        if group in self.last_collective:
            deps.append(self.last_collective[group])
        allocs, frees = list(kw.pop("allocs", ())), list(kw.pop("frees", ()))
        if self.cfg.collective_temp_buffers:  # gloo stages the whole input/output in a temporary
            temp = self._label(f"{kind.value}_temp", unit, mb)
            allocs.append(Alloc(temp, Mem.COMM_BUFFERS, nbytes))
            frees.append(temp)
        duration = self.cfg.collective_s(kind.value, nbytes, group, dtype) + kw.pop("extra_s", 0.0)
        op = self.p.emit(
            stream, kind, f"{kind.value} {unit}", unit, mb, duration,
            deps=tuple(deps), allocs=tuple(allocs), frees=tuple(frees), group=group, bytes=nbytes, **kw,
        )  # fmt: skip
        self.last_collective[group] = op
        return op

    def _padded(self, unit: str) -> int:
        return self.padded[unit]

    # -- the step ------------------------------------------------------------------------

    def build(self) -> Program:
        cfg = self.cfg
        self.p.initial.append(Alloc("buffers", Mem.PARAMS, cfg.buffer_bytes))
        for name in self.units:
            shard = self._padded(name) // self.w
            self.p.initial.append(Alloc(f"param:{name}", Mem.PARAMS, shard * cfg.master_bytes))
            states = OPTIMIZER_STATES[cfg.optimizer]
            if states:
                self.p.initial.append(
                    Alloc(f"optim:{name}", Mem.OPTIMIZER, states * shard * cfg.master_bytes)
                )
        for mb in range(cfg.grad_accum):
            self._reset_microbatch()
            self._forward(mb)
            self._backward(mb)
        self._optimizer_step()
        return self.p

    def _reset_microbatch(self) -> None:
        self.unsharded: dict[str, str] = {}  # unit -> label of its unsharded parameters
        # unit -> (all-gather op, output label); (None, None) where no all-gather runs (one rank)
        self.pending: dict[str, tuple[int | None, str | None]] = {}
        self.ag_wait: int | None = None  # copy-out the all-gather streams wait for
        self.deferred: tuple[str, int] | None = None  # previous forward all-gather output, its copy-out
        self.rs_states: list[tuple[int, str]] = []
        self.unsharded_grads: dict[str, list[str]] = {u: [] for u in self.units}
        self.post_forward_order: list[str] = []
        self.pre_backward_done: set[str] = set()
        self.post_backward_done: set[str] = set()
        self.saved: dict[int, str] = {}  # segment index -> label of its saved activations
        self.block_inputs: dict[int, str] = {}

    def _unshard(self, unit: str, mb: int) -> None:
        if unit in self.unsharded or unit in self.pending:
            return
        if self.w == 1:  # no all-gather: the copy happens in wait_for_unshard
            self.pending[unit] = (None, None)
            return
        cfg, padded = self.cfg, self._padded(unit)
        out = self._label("all_gather_output", unit, mb)
        allocs = [Alloc(out, Mem.COMM_BUFFERS, padded * cfg.param_bytes)]
        frees = []
        if cfg.param_bytes != cfg.master_bytes:  # copy-in casts the shard to param_dtype first
            cast = self._label("all_gather_input", unit, mb)
            allocs.append(Alloc(cast, Mem.COMM_BUFFERS, padded // self.w * cfg.param_bytes))
            frees.append(cast)
        deps = (self.ag_wait,) if self.ag_wait is not None else ()
        # the copy-in (the shard into the send buffer, cast to param_dtype) runs just before the
        # collective on the all-gather streams: it is part of this op's time
        copy_in_s = cfg.costs.copy_s(padded // self.w * max(cfg.param_bytes, cfg.master_bytes))
        op = self._collective(
            OpKind.ALL_GATHER, Stream.ALL_GATHER, unit, mb, padded * cfg.param_bytes, GroupKind.SHARD,
            cfg.param_dtype, deps=deps, allocs=tuple(allocs), frees=tuple(frees), extra_s=copy_in_s,
        )  # fmt: skip
        self.pending[unit] = (op, out)

    def _wait_for_unshard(self, unit: str, mb: int, *, forward: bool) -> None:
        if unit not in self.pending:
            return
        ag_op, out = self.pending.pop(unit)
        frees: list[str] = []
        if forward and self.deferred is not None:
            frees.append(self.deferred[0])
            self.ag_wait = self.deferred[1]
            self.deferred = None
        if not forward and out is not None:
            frees.append(out)
        nbytes = self._padded(unit) * self.cfg.param_bytes
        params = self._label("unsharded_params", unit, mb)
        # FSDP2's per-unit host work in forward rides on the pre-forward copy-out
        host_s = self.cfg.costs.fsdp_forward_overhead_s if forward else 0.0
        name = f"all_gather copy-out {unit}" if ag_op is not None else f"unshard copy {unit}"
        copy_out = self._compute(
            OpKind.COPY, name, unit, mb, self.cfg.costs.copy_s(nbytes) + host_s,
            deps=(ag_op,) if ag_op is not None else (), allocs=(Alloc(params, Mem.PARAMS, nbytes),),
            frees=tuple(frees),
        )  # fmt: skip
        if out is not None:
            if forward:
                self.deferred = (out, copy_out)
            else:
                self.ag_wait = copy_out
        self.unsharded[unit] = params

    def _reshard(self, unit: str, at_op: int) -> None:
        if unit in self.unsharded:
            self.p.add_frees(at_op, self.unsharded.pop(unit))

    def _pre_forward(self, unit: str, mb: int) -> None:
        self._unshard(unit, mb)
        self._wait_for_unshard(unit, mb, forward=True)
        start = self.forward_units.index(unit) + 1 if unit != ROOT else 0
        for nxt in self.forward_units[start : start + self.cfg.forward_prefetch]:
            self._unshard(nxt, mb)

    def _forward(self, mb: int) -> None:
        cfg, costs, segs = self.cfg, self.cfg.costs, self.cfg.segments
        self._pre_forward(ROOT, mb)
        op = -1
        for i, seg in enumerate(segs):
            if seg.unit != ROOT and i == self.first_seg[seg.unit]:
                self._pre_forward(seg.unit, mb)
            allocs, frees = [], []
            checkpointed = cfg.checkpointing and seg.block is not None
            if checkpointed and seg.block not in self.block_inputs:
                label = self._label("block_input", seg.unit, mb)
                self.block_inputs[seg.block] = label  # type: ignore[index]
                allocs.append(Alloc(label, Mem.ACTIVATIONS, cfg.block_input_bytes))
            saved = self._label("activations", seg.unit, mb)
            allocs.append(Alloc(saved, Mem.ACTIVATIONS, costs.saved_bytes(seg)))
            if checkpointed:  # intermediates live only while the block runs
                frees.append(saved)
            else:
                self.saved[i] = saved
            transient = self._label("forward_temp", seg.unit, mb)
            allocs.append(Alloc(transient, Mem.OTHER, costs.forward_transient_bytes(seg)))
            frees.append(transient)
            op = self._compute(
                OpKind.FORWARD,
                seg.name,
                seg.unit,
                mb,
                costs.forward_s(seg),
                allocs=tuple(allocs),
                frees=tuple(frees),
            )
            if seg.unit != ROOT and i == self.last_seg[seg.unit]:
                if cfg.reshard_after_forward:
                    self._reshard(seg.unit, op)
                self.post_forward_order.append(seg.unit)
        self._release_deferred(op)
        self.post_forward_order.append(ROOT)

    def _release_deferred(self, at_op: int) -> None:
        """The root's post-forward (and the end of backward) frees the last deferred all-gather output."""
        if self.deferred is not None:
            self.p.add_frees(at_op, self.deferred[0])
            self.ag_wait = self.deferred[1]
            self.deferred = None

    def _pre_backward(self, unit: str, mb: int) -> None:
        if unit in self.pre_backward_done:
            return
        self.pre_backward_done.add(unit)
        self._unshard(unit, mb)
        self._wait_for_unshard(unit, mb, forward=False)
        order = self.post_forward_order
        index = len(order) - 1 - order[::-1].index(unit)
        for target in order[max(0, index - self.cfg.backward_prefetch) : index][::-1]:
            self._unshard(target, mb)

    def _recompute(self, block: int, mb: int) -> None:
        costs = self.cfg.costs
        for i, seg in enumerate(self.cfg.segments):
            if seg.block != block:
                continue
            if seg.unit != ROOT and seg.unit not in self.pre_backward_done:
                self._unshard(seg.unit, mb)  # forward hooks run again; post-forward skips the reshard
                self._wait_for_unshard(seg.unit, mb, forward=True)
            saved = self._label("recomputed_activations", seg.unit, mb)
            transient = self._label("recompute_temp", seg.unit, mb)
            self.saved[i] = saved
            self._compute(
                OpKind.RECOMPUTE, seg.name, seg.unit, mb, costs.recompute_s(seg),
                allocs=(Alloc(saved, Mem.ACTIVATIONS, costs.saved_bytes(seg)),
                        Alloc(transient, Mem.OTHER, costs.forward_transient_bytes(seg))),
                frees=(transient,),
            )  # fmt: skip

    def _backward(self, mb: int) -> None:
        cfg, costs, segs = self.cfg, self.cfg.costs, self.cfg.segments
        self._pre_backward(ROOT, mb)
        recomputed: set[int] = set()
        op = -1
        for i in reversed(range(len(segs))):
            seg = segs[i]
            if cfg.checkpointing and seg.block is not None and seg.block not in recomputed:
                self._pre_backward(seg.unit, mb)
                self._recompute(seg.block, mb)
                recomputed.add(seg.block)
            self._pre_backward(seg.unit, mb)
            grads = self._label("unsharded_grads", seg.unit, mb)
            self.unsharded_grads[seg.unit].append(grads)
            transient = self._label("backward_temp", seg.unit, mb)
            frees = [transient, self.saved.pop(i)]
            if seg.block is not None and seg.block in self.block_inputs and self._first_of_block(i):
                frees.append(self.block_inputs.pop(seg.block))
            grad_bytes = sum(p.numel for p in seg.params) * cfg.param_bytes
            op = self._compute(
                OpKind.BACKWARD, seg.name, seg.unit, mb, costs.backward_s(seg),
                allocs=(Alloc(transient, Mem.OTHER, costs.backward_transient_bytes(seg)),),
                frees=tuple(frees), end_allocs=(Alloc(grads, Mem.GRADS, grad_bytes),),
            )  # fmt: skip
            if i == self.first_seg[seg.unit] and self.needs_grad[seg.unit]:
                self._post_backward(seg.unit, mb)
        self._final_callback(mb, op)

    def _first_of_block(self, i: int) -> bool:
        segs = self.cfg.segments
        return i == 0 or segs[i - 1].block != segs[i].block

    def _post_backward(self, unit: str, mb: int) -> None:
        if unit in self.post_backward_done:
            return
        self.post_backward_done.add(unit)
        cfg, padded = self.cfg, self._padded(unit)
        frees = list(self.unsharded_grads.pop(unit))
        if unit in self.unsharded:
            frees.append(self.unsharded.pop(unit))
        deps, released = [], []
        # one reduce-scatter input in flight (set_reduce_scatter_max_input_buffers): the compute
        # stream waits for the previous reduce-scatter and drops its input before allocating this one
        while self.rs_states:
            rs_op, old_input = self.rs_states.pop(0)
            deps.append(rs_op)
            released.append(old_input)
        rs_input = self._label("reduce_scatter_input", unit, mb)
        copy_in_s = cfg.costs.copy_s(padded * max(cfg.param_bytes, cfg.reduce_bytes))
        # FSDP2's per-unit host work in backward (pre-backward unshard, post-backward reduce)
        copy_in_s += cfg.costs.fsdp_backward_overhead_s
        shard = padded // self.w
        allocs, output_frees = [], []
        if mb == 0:
            grads = self._label("sharded_grads", unit, mb)
            self.grad_labels.append(grads)
            allocs.append(Alloc(grads, Mem.GRADS, shard * cfg.master_bytes))
        if mb > 0 or cfg.reduce_bytes != cfg.master_bytes:  # a separate output, cast or accumulated
            out = self._label("reduce_scatter_output", unit, mb)
            allocs.append(Alloc(out, Mem.COMM_BUFFERS, shard * cfg.reduce_bytes))
            output_frees.append(out)
        copy_in = self._compute(
            OpKind.COPY, f"reduce_scatter copy-in {unit}", unit, mb, copy_in_s,
            deps=tuple(deps), start_frees=tuple(released),
            allocs=(Alloc(rs_input, Mem.COMM_BUFFERS, padded * cfg.reduce_bytes),), frees=tuple(frees),
        )  # fmt: skip
        if self.w == 1:  # no reduce-scatter: the input is copied into the output
            rs = self._compute(
                OpKind.COPY, f"reduce copy {unit}", unit, mb, cfg.costs.copy_s(padded * cfg.reduce_bytes),
                deps=(copy_in,), allocs=tuple(allocs), frees=() if cfg.hybrid else tuple(output_frees),
            )  # fmt: skip
        else:
            rs = self._collective(
                OpKind.REDUCE_SCATTER, Stream.REDUCE_SCATTER, unit, mb, padded * cfg.reduce_bytes, GroupKind.SHARD,
                cfg.reduce_dtype, deps=(copy_in,), allocs=tuple(allocs),
                frees=() if cfg.hybrid else tuple(output_frees),
            )  # fmt: skip
        last = rs
        if cfg.hybrid:
            last = self._collective(
                OpKind.ALL_REDUCE, Stream.ALL_REDUCE, unit, mb, shard * cfg.reduce_bytes, GroupKind.REPLICATE,
                cfg.reduce_dtype, deps=(rs,), frees=tuple(output_frees),
            )  # fmt: skip
        self.rs_states.append((rs, rs_input))
        self.reductions.append(last)

    def _final_callback(self, mb: int, last_op: int) -> None:
        for unit in [ROOT] + [u for u in self.units if u != ROOT]:
            self._post_backward(unit, mb)
        for rs_op, rs_input in self.rs_states:
            self.p.add_frees(rs_op, rs_input)
        self.rs_states = []
        self._release_deferred(last_op)
        self.compute_waits = list(self.reductions)

    def _optimizer_step(self) -> None:
        cfg = self.cfg
        shard_numel = sum(u.padded_numel(self.w) // self.w for u in cfg.units)
        temp = "optimizer_temp"
        # foreach AdamW holds one fp32 temporary per parameter (the sqrt of exp_avg_sq).
        temp_bytes = shard_numel * cfg.master_bytes if cfg.optimizer == "adamw" else 0
        self._compute(
            OpKind.OPTIMIZER, "optimizer step", ROOT, cfg.grad_accum - 1, cfg.costs.optimizer_s(shard_numel),
            allocs=(Alloc(temp, Mem.OTHER, temp_bytes),),
            frees=(temp, *self.grad_labels),  # zero_grad(set_to_none=True) after the step
        )  # fmt: skip


def build_fsdp_program(cfg: StepConfig) -> Program:
    return FsdpScheduleBuilder(cfg).build()
