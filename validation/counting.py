"""Count the collectives a real step issues, at the dispatcher (what FSDP2 calls) or in DDP's hook."""

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d dispatcher ops -> (collective, index of the argument whose size is nccl-tests' size)
C10D_OPS = {
    "c10d._allgather_base_": ("all_gather", 0),  # output tensor
    "c10d.allgather_": ("all_gather", 0),  # list of output tensors (FSDP1 on a CPU: dist.all_gather)
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),  # input tensor
    "c10d.allreduce_": ("all_reduce", 0),  # list of tensors
}


def _nbytes(arg: Any) -> int:
    if isinstance(arg, list | tuple):
        return sum(_nbytes(a) for a in arg)
    return arg.numel() * arg.element_size() if isinstance(arg, torch.Tensor) else 0


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives issued on this thread: {collective: {"count", "bytes"}}. A DTensor
    redistributes inside its own dispatch, which a dispatch mode does not see (clip_grad_norm_'s
    partial norm over FSDP2's gradients), so the functional all-reduce it calls is counted where
    Python calls it (``torch.distributed._functional_collectives.all_reduce``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
        self._funcol_all_reduce: Any = None

    def __enter__(self) -> "CollectiveCounter":
        import torch.distributed._functional_collectives as funcol

        original = self._funcol_all_reduce = funcol.all_reduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.counts["all_reduce"]["count"] += 1
            self.counts["all_reduce"]["bytes"] += _nbytes(tensor)
            return original(tensor, *args, **kwargs)

        setattr(funcol, "all_reduce", counted)  # noqa: B010 (a typed module attribute, swapped)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed._functional_collectives as funcol

        super().__exit__(*exc)
        funcol.all_reduce = self._funcol_all_reduce

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}.{func._opname}"
        if name in C10D_OPS:
            collective, index = C10D_OPS[name]
            self.counts[collective]["count"] += 1
            self.counts[collective]["bytes"] += _nbytes(args[index])
        return func(*args, **(kwargs or {}))


def counting_allreduce_hook(counts: dict[str, dict[str, int]], buffers: dict[int, torch.Tensor]):
    """A DDP comm hook that counts each bucket's all-reduce, then runs DDP's default one. It also
    keeps each bucket's flat buffer by index in ``buffers`` (the reducer allocates them in C++, where
    no tracker sees them): the last backward's buckets, bucket 0 being reduced first."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        if bucket.index() == 0:  # a new backward: forget buckets DDP's rebuild may have dropped
            buffers.clear()
        buffers[bucket.index()] = bucket.buffer()
        entry = counts.setdefault("all_reduce", {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += _nbytes(bucket.buffer())
        return allreduce_hook(state, bucket)

    return hook
