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

``FSDPMemTracker`` holds one more: its wrapper of ``FSDPParamGroup.post_backward``
(``_fsdp_param_group_post_backward``) notes each unsharded gradient in a loop whose variable,
``unsharded_grad``, still names the group's last gradient while the wrapped ``post_backward``
runs. ``post_backward`` drops its own references once the reduce-scatter copy-in has read them,
so that one gradient (the group's last parameter's: a Llama block's norm weight, the root's
``lm_head`` weight) is counted through the reduce-scatter's buffers, where the step holds it no
longer. llama-5m on one rank (micro-batch 1 x 32, fused AdamW) counted 4 MiB (``lm_head``'s
fp32 gradient) at the root's reduce that the step no longer holds, which made that reduce the
peak, 1.3 MB (1.4 %) above the step's own (2026-12-07). At world size > 1 it changes nothing:
there ``foreach_reduce`` itself holds the same gradient until it returns (its loop over the
gradients, run only then, leaves its variable bound), tracked or not
(``tests/test_tracker_hooks.py``), and nothing is allocated between its return and
post-backward's.
``fsdp_tracking_holds_no_gradients()`` installs the same wrapper with that loop in a function of
its own. ``tracking_holds_no_gradients()`` is both; the measurements use it.
"""

import contextlib
import functools
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


def _note_grads(tracker: Any, fsdp_mod: Any, param_attr: str, reftype: Any, *, update_existing: bool) -> None:
    """Tell the tracker of each gradient of ``fsdp_mod``'s parameter group (``param_attr``: which
    of each FSDPParam's parameters), in a frame of its own: the loop's variable dies on return."""
    if group := fsdp_mod._get_fsdp_state()._fsdp_param_group:
        for fsdp_param in group.fsdp_params:
            grad = getattr(fsdp_param, param_attr).grad
            if grad is not None:
                tracker._update_and_maybe_create_winfos(grad, reftype, update_existing=update_existing)


def _post_backward_holding_no_gradient(
    self: Any, fsdp_mod: Any, orig_fsdp_param_group_post_backward: Callable[..., Any]
) -> Callable[..., None]:
    """``FSDPMemTracker._fsdp_param_group_post_backward`` (torch 2.13) with its two gradient loops
    in ``_note_grads``: the same snapshots and categories, no gradient held (module docstring)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState, _FSDPRefType, _FSDPState

    @functools.wraps(orig_fsdp_param_group_post_backward)
    def inner(*args: Any, **kwargs: Any) -> None:
        _note_grads(self, fsdp_mod, "_unsharded_param", _FSDPRefType.UNSHARDED_GRAD, update_existing=True)
        mod_stat = self.memory_tracking[fsdp_mod]
        mod_stat.snapshots.setdefault(_FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
        self._fsdp_state = _FSDPState.POST_BW
        orig_fsdp_param_group_post_backward(*args, **kwargs)
        _note_grads(self, fsdp_mod, "sharded_param", _FSDPRefType.SHARDED_GRAD, update_existing=False)
        mod_stat.snapshots.setdefault(_FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())

    return inner


@contextlib.contextmanager
def fsdp_tracking_holds_no_gradients() -> Iterator[None]:
    """While active, an ``FSDPMemTracker`` entered wraps post-backward holding no gradient."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    original = FSDPMemTracker._fsdp_param_group_post_backward
    FSDPMemTracker._fsdp_param_group_post_backward = _post_backward_holding_no_gradient  # type: ignore[method-assign]
    try:
        yield
    finally:
        FSDPMemTracker._fsdp_param_group_post_backward = original  # type: ignore[method-assign]


@contextlib.contextmanager
def tracking_holds_no_gradients() -> Iterator[None]:
    """Both: the trackers entered inside measure the step's memory, not their own references."""
    with module_tracking_holds_no_gradients(), fsdp_tracking_holds_no_gradients():
        yield
