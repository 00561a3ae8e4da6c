"""Memory of one unit call: bytes saved for backward, and the transient peak inside the call.

- Saved activations: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd
  saves; we count each storage once (views of one storage share it) and skip parameter storages
  (they are FSDP's unsharded parameters, accounted for separately).
- Transient peak on a GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
- Transient peak on a CPU: the CPU allocator keeps no statistics, so a ``TorchDispatchMode``
  records every storage an op returns (weakly, ``StorageWeakRef``) and sums those still alive
  after each op; the peak is the largest sum. Scratch buffers a fused kernel allocates and frees
  inside one op (e.g. the CPU flash-attention workspace) are invisible at this level.

``peak_above_start`` is the most a call holds on top of what was allocated when it started; the
compute section's transients derive from it (``sim.hardware.compute_section``).
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
        self.tensors: list[torch.Tensor] = []  # one tensor per counted storage
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._skip and key[1] > 0 and key[0] not in self._seen:
            self._seen[key[0]] = key[1]
            self.tensors.append(t)
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
    """Storages created inside the mode, op by op (CPU or any device).

    Each new storage gets an id; ``events`` lists (id, +bytes) at creation and (id, -bytes) once
    it is found dead, with ``None`` after every op, so the peak can be recomputed leaving some
    storages out (``peak_excluding``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # cdata -> (ref, bytes, id)
        # storages that existed before the mode saw them (inputs); weak, as addresses get reused
        self._older: dict[int, StorageWeakRef] = {}
        self.events: list[tuple[int, int] | None] = []
        self.current = 0
        self.peak = 0

    def sweep(self) -> None:
        for key in [k for k, (ref, _, _) in self._live.items() if ref.expired()]:
            _, n, uid = self._live.pop(key)
            self.current -= n
            self.events.append((uid, -n))
        for key in [k for k, ref in self._older.items() if ref.expired()]:
            del self._older[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # tensors released since the last op (autograd frees a gradient once it is consumed)
        # are gone before this op allocates: sweep first so the peak does not count both
        self.sweep()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self._live:
                    self._older[ref.cdata] = ref  # an in-place op's output is not a new allocation
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self._live and ref.cdata not in self._older:
                    n = t.untyped_storage().nbytes()
                    uid = len(self.events)
                    self._live[ref.cdata] = (ref, n, uid)
                    self.current += n
                    self.events.append((uid, n))
        self.events.append(None)
        self.peak = max(self.peak, self.current)
        return out

    def reset_peak(self) -> None:
        self.sweep()
        self.peak = self.current

    def ids_of(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Ids of the live storages behind ``tensors`` (tensors not created inside are ignored)."""
        ids = set()
        for t in tensors:
            entry = self._live.get(StorageWeakRef(t.untyped_storage()).cdata)
            if entry is not None:
                ids.add(entry[2])
        return ids

    def peak_excluding(self, ids: set[int]) -> int:
        """The peak as if the storages ``ids`` had never been allocated."""
        current = peak = 0
        for event in self.events:
            if event is None:
                peak = max(peak, current)
            elif event[0] not in ids:
                current += event[1]
        return peak


def peak_above_start(
    fn: Callable[[], Any], device: torch.device, leave_out: Callable[[], Iterable[torch.Tensor]] = list
) -> tuple[Any, int]:
    """Run ``fn``; return its result and the most it held on top of what was allocated at its start,
    not counting the tensors ``leave_out()`` returns afterwards (e.g. the parameter gradients a
    backward produces, which the simulator's ledger books separately).

    On a CPU only the call's own new storages are seen, not the ones it releases that existed
    before it, so a backward that frees saved activations as it goes is counted as if it freed
    them at its end (an upper bound, as the simulator's ledger assumes). On a GPU the allocator's
    peak is exact, and the left-out tensors' bytes are subtracted from it.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        left_out = sum(t.untyped_storage().nbytes() for t in leave_out())
        return result, max(0, torch.cuda.max_memory_allocated(device) - start - left_out)
    with AllocationTracker() as tracker:
        result = fn()
        tracker.sweep()
    return result, tracker.peak_excluding(tracker.ids_of(leave_out()))
