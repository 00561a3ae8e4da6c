"""Memory of one unit call: bytes saved for backward, and the transient peak inside the call.

- Saved activations: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd
  saves; we count each storage once (views of one storage share it) and skip parameter storages
  (they are FSDP's unsharded parameters, accounted for separately).
- Transient peak on a GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
- Transient peak on a CPU: the CPU allocator keeps no statistics, so a ``TorchDispatchMode``
  records every storage an op returns (weakly, ``StorageWeakRef``) and sums those still alive
  after each op; the peak is the largest sum. Scratch buffers a fused kernel allocates and frees
  inside one op (e.g. the CPU flash-attention workspace) are invisible at this level.

A call's *transient* is ``peak - allocated when the call returns``: the bytes it needs on top of
what it leaves behind (outputs, saved activations, gradients).
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (st.data_ptr(), st.nbytes())


class SavedTensorBytes:
    """Context manager: bytes of distinct non-parameter storages autograd saves inside it."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self._skip = {k for p in params if (k := _storage_key(p)) is not None}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._skip and key[1] > 0:
            self._seen[key[0]] = key[1]
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class AllocationTracker(TorchDispatchMode):
    """Live bytes of storages created inside the mode, after every op (CPU or any device)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def sweep(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self._live:
                    n = t.untyped_storage().nbytes()
                    self._live[ref.cdata] = (ref, n)
                    self.current += n
        self.peak = max(self.peak, self.current)
        self.sweep()
        return out

    def reset_peak(self) -> None:
        self.sweep()
        self.peak = self.current


def transient_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """Run ``fn``; return its result and its transient bytes (peak minus bytes left allocated)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    with AllocationTracker() as tracker:
        result = fn()
        tracker.sweep()
        end = tracker.current
    return result, max(0, tracker.peak - end)
