"""One forward and backward of a model under ``FakeTensorMode``, cut into ops and measured.

An *op* is a run of consecutive aten calls owned by one module (the innermost module whose
forward is running), or by the attention probe (``hfmodel.probe``). For each op:
- ``flops``: forward FLOPs by ``torch.utils.flop_counter``'s formulas (plus grouped matmuls);
- ``gemms``: the (M, N, K, count) of every matmul it runs;
- ``memory_bytes``: what eager PyTorch moves outside matmuls: every non-view aten call reads its
  tensor inputs and writes its outputs;
- ``saved_bytes``: storages autograd saves (``saved_tensors_hooks``), each once, parameters
  excepted, counted at the op that created them; ``saved_by`` the ops that save each (its
  ``(bytes, saver indices)``), from which ``hfmodel.ops`` finds what a later block or an op
  outside the blocks keeps of a block's storages;
- ``forward_transient_bytes``: the most that is alive during the op of what the forward created
  and autograd does not keep (e.g. the logits, consumed by the loss);
- ``backward_transient_bytes``: the most alive during the op's backward (the autograd node being
  run, ``torch._C._current_autograd_node``) of what the backward created, parameter gradients
  excepted, and so are the partial gradients of a parameter several ops use (a tied embedding
  and head): autograd holds them until the last use's gradient arrives and sums them into the
  parameter's, which the schedule counts from the first of them on;
- ``host_ops``: Python-level torch calls of its forward (``TorchFunctionMode``), the eager
  dispatches a GPU host pays;
- ``forward_launches``, ``backward_launches``: its aten calls that run a kernel on the device,
  forward and backward (views, fresh ``empty`` tensors and ``_unsafe_view`` run none): the
  entries a GPU host puts in the stream's launch queue;
- ``checkpointed_forward_bytes`` (block ops): the most alive during the op of what its block's
  ops created, were the block checkpointed: a storage autograd saves then lives only to its last
  use in the forward, the others as they did (each through the step of its last use).
- ``recompute_transient_bytes`` (block ops): ``forward_transient_bytes`` counting only what its
  block's ops created: as the block's recompute holds it, when the tensors made before the block
  that the traced forward still held (a stack's attention biases and masks, which a checkpoint
  region keeps among its inputs) are the schedule's own buffers.
Each byte figure has its tensors beside it (``*_pieces``, storage sizes in the order they were
created: the saved storages; for a peak, those alive at its step), which the caching allocator's
replay serves one by one as the program does.

And each op's own order of allocations and frees (``forward_requests``): its storages as its aten
calls make them and drop them, as ``[storage, bytes]`` pairs: ``bytes`` > 0 a storage the forward
frees itself, < 0 one kept for backward (autograd saves it, or the attention kernel will: the
probe's q, k and v), 0 the free of ``storage`` (made by this op or an earlier one). A call's
outputs are made before what it was the last to use is dropped. ``checkpointed_forward_requests``
(block ops): the same where the block is checkpointed, a saved storage dropped where
``checkpointed_forward_bytes`` drops it. The caching allocator's replay serves a segment's forward
in this order (``sim.costs.request_order``). ``backward_requests``: the same for the
op's backward (the storages it makes, parameter gradients among them, which live past it, and
their frees), with the release of each kept forward storage where the backward drops it (the
attention probe's q, k and v as its backward ends: the kernel reads them to its end).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm", "grouped_mm_fallback")
# Python-level calls that dispatch no kernel (attribute reads and shape queries)
# aten calls that move no data although their schema does not say they alias
ZERO_COPY = (
    "prim.",
    "aten.empty",
    "aten.new_empty",  # an allocation moves no data (the attention probe's outputs and gradients)
    "aten._unsafe_view",
    "aten.detach",
    "aten.lift_fresh",
    "aten.alias",
    "aten._reshape_alias",
)
NOT_DISPATCHED = {"__get__", "size", "dim", "numel", "stride", "is_floating_point", "__len__", "__format__"}


@dataclass
class OpRecord:
    owner: str  # module path; "attention:<path>" for the probe
    module_type: str
    index: int
    flops: float = 0.0
    memory_bytes: float = 0.0
    saved_bytes: int = 0
    saved_by: list[tuple[int, frozenset[int]]] = field(default_factory=list)  # (bytes, saver ops)
    saved_after_block_bytes: int = 0  # of saved_bytes, what ops after its block save (hfmodel.ops)
    next_block_input_bytes: int = 0  # of saved_bytes, the next block's input its first op saves
    forward_transient_bytes: int = 0
    backward_transient_bytes: int = 0
    host_ops: int = 0
    forward_launches: int = 0
    backward_launches: int = 0
    checkpointed_forward_bytes: int = 0
    recompute_transient_bytes: int = 0
    # the storages that make up each figure (see the module docstring)
    saved_pieces: list[int] = field(default_factory=list)
    forward_transient_pieces: tuple[int, ...] = ()
    backward_transient_pieces: tuple[int, ...] = ()
    checkpointed_forward_pieces: tuple[int, ...] = ()
    recompute_transient_pieces: tuple[int, ...] = ()
    # the order of its forward's allocations and frees (see the module docstring)
    forward_requests: list[tuple[int, int]] = field(default_factory=list)
    checkpointed_forward_requests: list[tuple[int, int]] = field(default_factory=list)
    backward_requests: list[tuple[int, int]] = field(default_factory=list)
    gemms: list[tuple[int, int, int, int]] = field(default_factory=list)
    aten_ops: list[int] = field(default_factory=list)  # global forward op indices
    backward_ops: list[int] = field(default_factory=list)
    # what its backward runs: the matmuls autograd issues (none for a frozen weight's gradient,
    # none at all when its input needs no gradient either), their FLOPs, and elementwise bytes
    backward_flops: float = 0.0
    backward_memory_bytes: float = 0.0
    backward_gemms: list[tuple[int, int, int, int]] = field(default_factory=list)


# aten calls that make or relabel a tensor without running a kernel (beside ``OpOverload.is_view``)
NO_KERNEL = frozenset(
    {
        "aten.empty.memory_format",
        "aten.empty_strided.default",
        "aten.empty_like.default",
        "aten.new_empty.default",
        "aten.new_empty_strided.default",
        "aten._unsafe_view.default",
        "aten.lift_fresh.default",
    }
)


def launches_kernel(func: Any) -> bool:
    """Whether an aten call runs a kernel on the device (``prim`` calls such as ``prim.device``,
    which autograd's engine asks of fake tensors, only read metadata)."""
    name = str(func)
    return not getattr(func, "is_view", False) and name not in NO_KERNEL and not name.startswith("prim.")


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _nbytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _moved_bytes(args: Any, kwargs: Any, out: Any) -> int:
    """What an elementwise call moves: it reads its tensor inputs and writes its outputs."""
    return sum(_nbytes(t) for t in _tensors((args, kwargs))) + sum(_nbytes(t) for t in _tensors(out))


def _work(
    name: str, func: Any, args: Any, kwargs: Any, out: Any
) -> tuple[float, tuple[int, int, int, int] | None, float]:
    """(FLOPs, matmul shape, elementwise bytes moved) of one aten call, forward or backward alike."""
    if name.startswith(MATMULS) or "grouped_mm" in name:
        return matmul_flops(name, func, args, kwargs, out), gemm_shape(name, args), 0.0
    if not func.is_view and not name.startswith(ZERO_COPY):
        return 0.0, None, float(_moved_bytes(args, kwargs, out))
    return 0.0, None, 0.0


def gemm_shape(name: str, args: tuple[Any, ...]) -> tuple[int, int, int, int] | None:
    """(M, N, K, count) of a matmul call; a grouped matmul as its experts' mean shape (tokens
    against stacked 3-D weights, or, for the weights' gradient in backward, 2-D by 2-D with the
    groups cut along K by ``offs``)."""
    mats = _tensors(args)
    if "grouped_mm" in name:
        x, w = mats[0], mats[1]
        if w.dim() == 3:
            experts = w.shape[0]
            return (max(1, x.shape[0] // experts), w.shape[-1], x.shape[-1], experts)
        groups = mats[2].numel() if len(mats) > 2 else 1
        return (x.shape[0], w.shape[-1], max(1, x.shape[-1] // groups), groups)
    a, b = (mats[1], mats[2]) if name.startswith(("aten.addmm", "aten.baddbmm")) else (mats[0], mats[1])
    count = a.shape[0] if a.dim() == 3 else 1
    return (a.shape[-2], b.shape[-1], a.shape[-1], count)


def matmul_flops(name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    if "grouped_mm" in name:
        x, w = _tensors(args)[:2]
        return 2.0 * x.shape[0] * x.shape[-1] * w.shape[-1]
    formula = flop_registry.get(func.overloadpacket)
    return float(formula(*args, **kwargs, out_val=out)) if formula else 0.0


class Owners:
    """Which module runs now: a stack kept by forward pre/post hooks on every module."""

    def __init__(self, model: nn.Module):
        self.stack: list[tuple[str, str]] = [("", type(model).__name__)]
        self.handles = []
        for path, module in model.named_modules():
            if path:
                self.handles.append(module.register_forward_pre_hook(self._push(path)))
                self.handles.append(module.register_forward_hook(self._pop))

    def _push(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            # a subclass of nn.Embedding (Gemma 3's scaled word embedding) is an embedding to the
            # op kinds (``hfmodel.ops``): it takes the token ids
            kind = "Embedding" if isinstance(module, nn.Embedding) else type(module).__name__
            self.stack.append((path, kind))

        return hook

    def _pop(self, module: nn.Module, args: Any, out: Any) -> None:
        self.stack.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Tracer(TorchDispatchMode):
    """Cuts the aten calls into ops and records storages' lives (see the module docstring)."""

    def __init__(self, owners: Owners, params: list[nn.Parameter]):
        super().__init__()
        self.owners = owners
        self.ops: list[OpRecord] = []
        self.backward = False
        self.step = 0  # aten calls so far (forward and backward)
        self.param_keys = {_key(p) for p in params}
        # storage key -> [uid, bytes, created, died, op index, backward?, last forward use]
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.storages: list[list[Any]] = []
        self.node_op: dict[Any, int] = {}  # autograd node -> op index
        self.saved: set[int] = set()  # uids autograd keeps
        self.savers: dict[int, set[int]] = {}  # uid -> the forward ops whose autograd nodes keep it
        self.probe_owner: str | None = None
        self._last_op = 0
        # AccumulateGrad node of a parameter -> the nodes whose gradient flows into it; and the
        # storages those gradients were, with the AccumulateGrad they went to
        self.param_users: dict[Any, int] = {}
        self.param_grads: list[tuple[int, Any]] = []

    def watch_parameter_grads(self, root: Any) -> None:
        """Before backward: find every autograd node that hands a gradient to a parameter (an edge
        to its ``AccumulateGrad``) in the graph under ``root``, and note those gradients' storages."""
        seen, stack = set(), [root]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            edges = [(i, nxt) for i, (nxt, _) in enumerate(node.next_functions) if hasattr(nxt, "variable")]
            for _, acc in edges:
                self.param_users[acc] = self.param_users.get(acc, 0) + 1
            if edges:
                node.register_hook(self._grads_hook(edges))
            stack += [nxt for nxt, _ in node.next_functions]

    def _grads_hook(self, edges: list[tuple[int, Any]]) -> Callable[..., None]:
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            for i, acc in edges:
                uid = None if grad_inputs[i] is None else self.uid_of(grad_inputs[i])
                if uid is not None:
                    self.param_grads.append((uid, acc))

        return hook

    def shared_parameter_grads(self) -> set[int]:
        """Storages that were partial gradients of a parameter several ops use."""
        return {uid for uid, acc in self.param_grads if self.param_users.get(acc, 0) > 1}

    # -- which op an aten call belongs to ----------------------------------------------------

    def _current_forward_op(self) -> OpRecord:
        path, kind = self.owners.stack[-1]
        owner = self.probe_owner or path
        if self.probe_owner:
            kind = "AttentionProbe"
        if not self.ops or self.ops[-1].owner != owner:
            self.ops.append(OpRecord(owner=owner, module_type=kind, index=len(self.ops)))
        return self.ops[-1]

    def _current_backward_op(self) -> int:
        node = torch._C._current_autograd_node()
        index = self.node_op.get(node) if node is not None else None
        if index is not None:
            self._last_op = index
        return self._last_op

    # -- storages ------------------------------------------------------------------------------

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            _, uid = self.live.pop(key)
            self.storages[uid][3] = self.step

    def _record_outputs(self, out: Any, inputs: set[int], op: int) -> None:
        for t in _tensors(out):
            key = _key(t)
            if key in self.live or key in inputs or key in self.param_keys:
                continue
            uid = len(self.storages)
            self.live[key] = (StorageWeakRef(t.untyped_storage()), uid)
            self.storages.append(
                [uid, t.untyped_storage().nbytes(), self.step, None, op, self.backward, self.step]
            )

    def uid_of(self, t: torch.Tensor) -> int | None:
        entry = self.live.get(_key(t))
        return None if entry is None else entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._sweep()
        name = str(func)
        out = func(*args, **kwargs)
        self.step += 1
        inputs = {_key(t) for t in _tensors((args, kwargs))}
        if self.backward:
            index = self._current_backward_op()
            record = self.ops[index]
            record.backward_ops.append(self.step)
            record.backward_launches += launches_kernel(func)
            flops, shape, moved = _work(name, func, args, kwargs, out)
            record.backward_flops += flops
            record.backward_memory_bytes += moved
            if shape is not None:
                record.backward_gemms.append(shape)
            self._record_outputs(out, inputs, index)
            return out
        op = self._current_forward_op()
        op.aten_ops.append(self.step)
        op.forward_launches += launches_kernel(func)
        for key in inputs:  # the forward's last use of each storage it reads
            entry = self.live.get(key)
            if entry is not None:
                self.storages[entry[1]][6] = self.step
        flops, shape, moved = _work(name, func, args, kwargs, out)
        op.flops += flops
        op.memory_bytes += moved
        if shape is not None:
            op.gemms.append(shape)
        self._record_outputs(out, inputs, op.index)
        return out


class HostCalls(TorchFunctionMode):
    """Counts the Python-level torch calls of each owner in forward, and maps the autograd nodes
    they create to the op that ran them (autograd sits above the dispatch mode, so only here do
    outputs carry their ``grad_fn``)."""

    def __init__(self, owners: Owners, tracer: Tracer):
        super().__init__()
        self.owners, self.tracer = owners, tracer
        self.pending = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        ops = self.tracer.ops
        if self.tracer.backward or not ops:
            return result
        if getattr(func, "__name__", "") not in NOT_DISPATCHED:
            ops[-1].host_ops += 1
        for t in _tensors(result):
            if t.grad_fn is not None and t.grad_fn not in self.tracer.node_op:
                self.tracer.node_op[t.grad_fn] = ops[-1].index
        return result


class SavedBytes:
    """``saved_tensors_hooks`` that note each storage autograd keeps (parameters excepted)."""

    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        tracer = self.tracer
        key = _key(t)
        if key in tracer.param_keys:
            return t
        uid = tracer.uid_of(t)
        if uid is None:  # created outside the traced forward (the token ids): count where saved
            tracer._record_outputs(t, set(), tracer.ops[-1].index if tracer.ops else 0)
            uid = tracer.uid_of(t)
        if uid is not None:
            tracer.saved.add(uid)
            tracer.savers.setdefault(uid, set()).add(tracer.ops[-1].index if tracer.ops else 0)
        return t
