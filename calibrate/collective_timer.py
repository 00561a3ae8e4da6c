"""Host-clock timing of the blocking collectives FSDP2 and DDP issue, by wrapping the
``torch.distributed`` functions they call. On gloo a collective blocks the host, so the wrapped
call's time is the collective's, including any wait for a late rank; on a GPU it is only the
launch. Used by the real run's timeline (``validation``) and by the FSDP2 overhead calibration,
which subtracts the collectives from a wrapped model's time.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# torch.distributed function -> (collective, position and keyword of the tensor whose size is
# nccl-tests' size: the all-gather output, the reduce-scatter input, the all-reduce buffer).
# FSDP2 in torch 2.13 calls the *_single names; older releases the *_tensor ones.
TIMED = {
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),  # FSDP1 on a CPU gathers into a list of chunks
}


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, list | tuple):
        return sum(_nbytes(t) for t in tensor)
    return int(tensor.numel() * tensor.element_size())


@contextmanager
def timed_collectives(records: list[tuple[str, float, float, int]]) -> Iterator[None]:
    """Append (collective, start, end, bytes) for every blocking collective called inside."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in TIMED if hasattr(dist, name)}

    def wrap(name: str) -> Any:
        collective, index, keyword = TIMED[name]

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = originals[name](*args, **kwargs)
            tensor = args[index] if len(args) > index else kwargs[keyword]
            records.append((collective, start, time.perf_counter(), _nbytes(tensor)))
            return result

        return timed

    try:
        for name in originals:
            setattr(dist, name, wrap(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextmanager
def timed_waits(records: list[tuple[str, float, float, int]]) -> Iterator[None]:
    """Append ("wait", start, end, 0) for every ``Work.wait()`` inside: where a system issues its
    collectives with ``async_op=True`` (DeepSpeed), the host blocks in the wait, not the call."""
    import torch.distributed as dist

    original = dist.Work.wait

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(self, *args, **kwargs)
        records.append(("wait", start, time.perf_counter(), 0))
        return result

    dist.Work.wait = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        dist.Work.wait = original  # type: ignore[method-assign]
