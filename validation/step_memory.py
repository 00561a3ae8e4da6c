"""Peak memory of one real FSDP1 or DeepSpeed step, storage by storage.

PyTorch's ``MemTracker`` cannot follow FSDP1 everywhere: with ``use_orig_params=True`` it hooks
parameters that FSDP1 has replaced by non-leaf views, and it refuses a module that runs forward
twice (gradient accumulation). So this tracker works below modules, as ``MemTracker`` itself
does: a ``TorchDispatchMode`` records every storage an op creates (weakly, freed when it dies),
and ``UntypedStorage.resize_`` is patched to follow the storages FSDP1 allocates and frees in
place (the padded unsharded flat parameters and the low-precision shards, ``_alloc_storage`` /
``_free_storage``). What lives when the step starts (parameters, buffers, optimizer states) is
counted once, by storage.

Categories at the peak: what lived at the start by what it is; the unsharded flat parameters as
``params`` and the low-precision shards as ``comm_buffers``; storages created in forward as
``activations`` and in backward or the optimizer step as ``other`` (gradients included: at the
storage level a sharded gradient is not told apart from a temporary). With a ``torch.optim``
optimizer the step is told by its hooks, so an ``autograd.Function``'s forward (run without grad,
e.g. QLoRA's 4-bit matmul) still makes activations; without one (DeepSpeed's engine), by
``torch.is_grad_enabled()``.
"""

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from validation.tracker_categories import CATEGORIES


class AllocationLog:
    """The storages a tracked step allocates and frees, in order, with the stream the CUDA caching
    allocator would serve each from (FSDP1: the unsharded flat parameters on its unshard stream,
    what ``_reduce_grad`` makes on its post-backward stream, the rest on the compute stream):
    ``events`` holds ("alloc", key, bytes, stream) and ("free", key, 0, ""); those before
    ``step_start`` are what lived when the tracked step began."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, str]] = []
        self.step_start = 0
        self.stream = "compute"  # set by whoever wraps FSDP1's reduction

    def alloc(self, key: int, nbytes: int, *, resized: bool = False) -> None:
        self.events.append(("alloc", key, nbytes, "all_gather" if resized else self.stream))

    def free(self, key: int) -> None:
        self.events.append(("free", key, 0, ""))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class StepMemory(TorchDispatchMode):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        resized: dict[str, list[torch.Tensor]],
        log: "AllocationLog | None" = None,
    ):
        super().__init__()
        self._log = log
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}  # cdata -> (ref, bytes, category)
        self._resized = {
            StorageWeakRef(t.untyped_storage()).cdata: cat for cat, ts in resized.items() for t in ts
        }
        self._start(model, optimizer, resized)
        self._stepping: bool | None = None  # None: the optimizer step is not observable
        self._hooks: list[Any] = []  # removed on exit: one optimizer outlives many trackers
        if isinstance(optimizer, torch.optim.Optimizer):
            self._stepping = False
            self._hooks = [
                optimizer.register_step_pre_hook(lambda *_: self._set_stepping(True)),
                optimizer.register_step_post_hook(lambda *_: self._set_stepping(False)),
            ]
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._orig_resize: Any = None

    def _set_stepping(self, value: bool) -> None:
        self._stepping = value

    def _category(self) -> str:
        """What a storage made now is: backward and optimizer-step work is ``other``."""
        if _in_backward():
            return "other"
        outside_forward = self._stepping if self._stepping is not None else not torch.is_grad_enabled()
        return "other" if outside_forward else "activations"

    def _add(self, storage: torch.UntypedStorage, category: str) -> None:
        ref = StorageWeakRef(storage)
        if ref.cdata not in self._live:
            self._live[ref.cdata] = (ref, storage.nbytes(), category)
            if self._log is not None:
                self._log.alloc(ref.cdata, storage.nbytes())

    def _start(self, model: torch.nn.Module, optimizer: Any, resized: dict[str, list[torch.Tensor]]) -> None:
        for category, tensors in resized.items():
            for t in tensors:
                self._add(t.untyped_storage(), category)
        for p in model.parameters():
            self._add(p.untyped_storage(), "params")
            if p.grad is not None:
                self._add(p.grad.untyped_storage(), "grads")
        for b in model.buffers():
            self._add(b.untyped_storage(), "params")
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._add(value.untyped_storage(), "optimizer")

    def _update(self) -> None:
        for key in [k for k, (ref, _, _) in self._live.items() if ref.expired()]:
            del self._live[key]
            if self._log is not None:
                self._log.free(key)
        total = sum(n for _, n, _ in self._live.values())
        if total > self.peak:
            self.peak = total
            self.at_peak = dict.fromkeys(CATEGORIES, 0)
            for _, n, category in self._live.values():
                self.at_peak[category] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._update()
        out = func(*args, **(kwargs or {}))
        category = self._category()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), category)
        self._update()
        return out

    def _resize(self, storage: torch.UntypedStorage, size: int) -> None:
        self._orig_resize(storage, size)
        ref = StorageWeakRef(storage)
        if ref.cdata in self._live:
            old = self._live[ref.cdata]
            self._live[ref.cdata] = (old[0], storage.nbytes(), old[2])
            if self._log is not None and storage.nbytes() != old[1]:  # FSDP1's in-place alloc or free
                if old[1]:
                    self._log.free(ref.cdata)
                if storage.nbytes():
                    self._log.alloc(ref.cdata, storage.nbytes(), resized=True)
        self._update()

    def __enter__(self) -> "StepMemory":
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> None:
            tracker._resize(storage, size)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        if self._log is not None:
            self._log.step_start = len(self._log.events)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)


def fsdp1_resized_storages(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """The tensors whose storages FSDP1 resizes in place, by category."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out: dict[str, list[torch.Tensor]] = {"params": [], "comm_buffers": []}
    for state in FSDP.fsdp_modules(model):
        handle = state._handle
        if handle is None:
            continue
        for name, category in (("_full_param_padded", "params"), ("_mp_shard", "comm_buffers")):
            tensor = getattr(handle.flat_param, name, None)
            if isinstance(tensor, torch.Tensor):
                out[category].append(tensor)
    return out


def measure_fsdp1_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Any, log: "AllocationLog | None" = None
) -> dict[str, Any]:
    """Run ``step()`` under the tracker; the peak and its categories, as the worker reports them;
    with ``log``, every storage allocated and freed, in order."""
    with StepMemory(model, optimizer, fsdp1_resized_storages(model), log) as tracker:
        step()
    out: dict[str, Any] = {"total": tracker.peak, **tracker.at_peak}
    out["raw"] = dict(tracker.at_peak)
    return out


def live_tensors() -> list[torch.Tensor]:
    """Every tensor Python can reach (``gc``): what a step starts with, wherever it is held."""
    import gc

    return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.device.type != "meta"]


def measure_step_from_live_tensors(model: torch.nn.Module, step: Any) -> dict[str, Any]:
    """The peak of ``step()`` over every tensor alive at its start (DeepSpeed keeps its partitions,
    buckets and optimizer states in its own objects): parameters and buffers as ``params``, the
    rest that lived before as ``other``, what the step creates by phase."""
    owned = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers()]}
    before = live_tensors()
    resized = {
        "params": [t for t in before if StorageWeakRef(t.untyped_storage()).cdata in owned],
        "other": [t for t in before if StorageWeakRef(t.untyped_storage()).cdata not in owned],
    }
    del before
    with StepMemory(torch.nn.Module(), _NoOptimizer(), resized) as tracker:
        step()
    out: dict[str, Any] = {"total": tracker.peak, **tracker.at_peak}
    out["raw"] = dict(tracker.at_peak)
    return out


class _NoOptimizer:
    state: dict[Any, Any] = {}
