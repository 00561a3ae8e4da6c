"""PyTorch's module tracking (ModTracker, inside FSDPMemTracker) holds a module's input gradients
until all of them are computed; ``validation.tracker_hooks`` keeps the tracking and none of the
gradients, so a tracked step measures the step's own memory (issue 14, T5 with checkpointing)."""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.distributed._tools.mod_tracker import ModTracker  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from validation.tracker_hooks import module_tracking_holds_no_gradients  # noqa: E402

N_BLOCKS, ROWS, WIDTH = 5, 512, 32
FP32_BYTES = 4


class PeakBytes(TorchDispatchMode):
    """Largest sum of live storages created by ops inside the mode (no module hooks of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.live.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self.peak = max(self.peak, self.now())
        return out

    def now(self) -> int:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.lin(h) * memory  # memory: an input every block reads, like T5's encoder output


class Stack(nn.Module):
    """Blocks that all read ``memory``: its gradient is complete only after the first block's
    backward, while each block's hidden-state input gradient is complete at its own (T5's
    decoder blocks and the encoder output)."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = nn.Linear(WIDTH, WIDTH, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))

    def forward(self, x: torch.Tensor, at_first_input_grad: Callable[[], None]) -> torch.Tensor:
        memory = self.memory(x)
        h = x.detach().requires_grad_()  # block 0's input needs a gradient too
        h.register_hook(lambda grad: at_first_input_grad())  # the last block backward reaches
        for block in self.blocks:  # checkpointed: the held gradients are then what makes the peak
            h = checkpoint(block, h, memory, use_reentrant=False)
        return h.sum()


@dataclass
class Measured:
    peak_bytes: int
    at_first_input_grad_bytes: int  # live when block 0's input gradient is complete
    tracker: ModTracker | None


def _measure(tracking: str) -> Measured:
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(ROWS, WIDTH)
    tracker = ModTracker() if tracking != "none" else None
    seen: list[int] = []
    with (
        PeakBytes() as live,
        module_tracking_holds_no_gradients() if tracking == "fixed" else contextlib.nullcontext(),
        tracker if tracker is not None else contextlib.nullcontext(),
    ):
        model(x, lambda: seen.append(live.now())).backward()
    return Measured(peak_bytes=live.peak, at_first_input_grad_bytes=seen[0], tracker=tracker)


def test_pytorchs_module_tracking_holds_the_input_gradients_of_every_block() -> None:
    """The mechanism, as PyTorch 2.13 has it: every block's buffer keeps its hidden-state input
    gradient ((ROWS, WIDTH) fp32) until ``memory``'s gradient is complete."""
    untracked, tracked = _measure("none"), _measure("pytorch")
    held = tracked.at_first_input_grad_bytes - untracked.at_first_input_grad_bytes
    assert held == (N_BLOCKS - 1) * ROWS * WIDTH * FP32_BYTES  # blocks 1.. ; block 0's is in use


def test_the_fixed_tracking_holds_none_and_still_closes_every_module() -> None:
    untracked, fixed = _measure("none"), _measure("fixed")
    assert fixed.at_first_input_grad_bytes == untracked.at_first_input_grad_bytes
    assert fixed.peak_bytes == untracked.peak_bytes
    assert fixed.tracker is not None and fixed.tracker.parents == {"Global"}  # every backward ended


def test_the_fix_is_undone_on_exit() -> None:
    from torch.autograd.graph import register_multi_grad_hook
    from torch.distributed._tools import mod_tracker

    with module_tracking_holds_no_gradients():
        assert mod_tracker.register_multi_grad_hook is not register_multi_grad_hook
    assert mod_tracker.register_multi_grad_hook is register_multi_grad_hook
