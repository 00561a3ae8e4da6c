"""PyTorch's memory trackers' categories (``MemTracker``, ``FSDPMemTracker``) in the simulator's.

One difference is not a renaming: a tracker counts every storage made inside ``optimizer.step()``
as optimizer state (``MemTracker._in_opt``), so at an optimizer-step peak foreach AdamW's
temporaries are ``Optstate``. The simulator counts them, as ``validation.step_memory`` does, as
``other``: what exceeds the states alive before the step moves there.
"""

from typing import Any

import torch

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers", "other")

# tracker categories -> the simulator's
TRACKER_CATEGORIES = {
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "Buffer": "params",
    "Parameter": "params",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Gradient": "grads",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "All Gather": "comm_buffers",
    "Reduce Scatter": "comm_buffers",
    "Temp": "other",
    "Quant State": "params",  # QLoRA's, added by validation.fake_memory (the tracker does not see it)
}


def tracker_key_name(key: Any) -> str:
    """A tracker snapshot key as text."""
    return str(getattr(key, "value", key))  # tracker keys are str enums (_FSDPRefType) and "Total"


def optimizer_state_bytes(optimizer: Any) -> int:
    """The bytes of the optimizer's state tensors (each storage once; a DTensor's local shard)."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    storages = {
        st
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
        for st in get_untyped_storages(value)
    }
    return sum(st.nbytes() for st in storages)


def categories(snapshot: dict[Any, int], state_bytes: int) -> dict[str, int]:
    """A tracker snapshot in the simulator's categories; ``state_bytes``: the optimizer states
    alive before the step (``optimizer_state_bytes``), beyond which ``Optstate`` is temporaries."""
    out = dict.fromkeys(CATEGORIES, 0)
    for name, value in snapshot.items():
        if tracker_key_name(name) != "Total":
            out[TRACKER_CATEGORIES.get(tracker_key_name(name), "other")] += int(value)
    temporaries = max(out["optimizer"] - state_bytes, 0)
    out["optimizer"] -= temporaries
    out["other"] += temporaries
    return out
