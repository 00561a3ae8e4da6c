"""PyTorch's memory trackers without the gradients their module tracking holds.

``FSDPMemTracker`` and ``MemTracker`` follow modules with ``ModTracker``
(``torch/distributed/_tools/mod_tracker.py``), which learns that a module's backward has ended
from ``register_multi_grad_hook(inputs, fn)`` on the module's forward inputs (mode ``"all"``).
That hook (``torch/autograd/graph.py``) keeps each gradient it is given in a buffer
(``buffer[id][idx] = grad``) until the gradients of all those inputs have been computed, and
only then calls ``fn`` with them. ModTracker's ``fn`` ignores them, but while the buffer waits
they stay alive: memory the step without the tracker never holds.

It matters where a module's inputs finish their backward at different times. A T5 decoder block
under FSDP2 takes the hidden states, the position bias and the encoder's output; FSDP2's
``RegisterPostBackwardFunction`` hands every block its own view of the bias, whose gradient is
complete when that block's post-backward runs, but the encoder output's gradient is complete
only after the last decoder block (the first in forward) has run its backward. So every decoder
block's buffer kept its bias gradient (a ``(1, heads, q, k)`` tensor) and its hidden-state
gradient until then: t5-base with full checkpointing at 1 x 1,024 measured 10 x 24 MiB + 12 x
1.5 MiB more than the step holds (VALIDATION.md, "Encoder-decoders: T5"). Without FSDP2 every
block shares one bias tensor, whose gradient completes last, so only the hidden-state gradients
were held.

``module_tracking_holds_no_gradients()`` replaces, inside ModTracker only, the ``"all"`` hook by
one that counts the gradients as PyTorch's does (per graph task, the expected count from
``torch._C._will_engine_execute_node``) but keeps none; ``fn`` gets ``None`` for each input.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


def _counting_multi_grad_hook(
    tensors: Sequence[torch.Tensor], fn: Callable[..., Any], *, mode: str = "all"
) -> Any:
    """``register_multi_grad_hook``'s ``"all"`` mode, counting only; ``"any"`` keeps no gradient
    and goes to PyTorch's own."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc, _MultiHandle, register_multi_grad_hook

    if mode != "all":
        return register_multi_grad_hook(tensors, fn, mode=mode)  # type: ignore[arg-type]
    grad_fns = [_get_grad_fn_or_grad_acc(t) for t in tensors]
    n_inputs = len(tensors)  # the hook must not hold the tensors themselves either
    seen: dict[int, int] = {}  # graph task id -> gradients seen
    expected: dict[int, int] = {}
    lock = threading.Lock()

    def inner_hook(grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in seen:
                seen[task] = 0
                expected[task] = sum(map(torch._C._will_engine_execute_node, grad_fns))
            seen[task] += 1
            done = seen[task] == expected[task]
            if done:
                del seen[task], expected[task]
        if done:
            fn([None] * n_inputs)

    return _MultiHandle(tuple(t.register_hook(inner_hook) for t in tensors))


@contextlib.contextmanager
def module_tracking_holds_no_gradients() -> Iterator[None]:
    """While active, ModTracker's backward hooks keep no gradient alive (module docstring)."""
    from torch.distributed._tools import mod_tracker

    original = mod_tracker.register_multi_grad_hook
    mod_tracker.register_multi_grad_hook = _counting_multi_grad_hook
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original
