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


# FSDPMemTracker's post-backward wrapper: a child process (the fake process group is global
# state), real tensors, rank 0 of WORLD (argv). Prints, per reduce, the parameters whose unsharded
# gradient is still alive once the reduce-scatter copy-in has read them (at the output's
# ``_div_if_needed``): untracked, under FSDPMemTracker as PyTorch has it, and with the fix.
_FSDP_CHILD = r"""
import contextlib, json, sys
import torch, torch.distributed as dist
from torch import nn
import torch.distributed.fsdp._fully_shard._fsdp_collectives as C
import torch.distributed.fsdp._fully_shard._fsdp_param_group as G
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing._internal.distributed.fake_pg import FakeStore
from validation.tracker_hooks import fsdp_tracking_holds_no_gradients

pending, alive = [], []
reduce, div = C.foreach_reduce, C._div_if_needed
def probe_reduce(fsdp_params, grads, *args, **kwargs):
    pending[:] = [(p._param_fqn, StorageWeakRef(g.untyped_storage())) for p, g in zip(fsdp_params, grads)]
    return reduce(fsdp_params, grads, *args, **kwargs)
def probe_div(tensor, factor):
    if pending:
        alive.append([name for name, ref in pending if not ref.expired()])
        pending.clear()
    return div(tensor, factor)
C.foreach_reduce = G.foreach_reduce = probe_reduce
C._div_if_needed = probe_div

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(sys.argv[1]))
torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(3)))
fully_shard(model[0]); fully_shard(model[1]); fully_shard(model)
optim = torch.optim.AdamW(model.parameters())
out = {}
for name in ("untracked", "pytorch", "fixed"):
    alive.clear()
    fix = fsdp_tracking_holds_no_gradients() if name == "fixed" else contextlib.nullcontext()
    with fix, (FSDPMemTracker(model, optim) if name != "untracked" else contextlib.nullcontext()):
        model(torch.randn(8, 16)).sum().backward()
        optim.step(); optim.zero_grad()
    out[name] = sorted(alive)
print(json.dumps(out))
"""


def _held_after_copy_in(world: int) -> dict[str, list[list[str]]]:
    import json
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-c", _FSDP_CHILD, str(world)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_fsdp_mem_trackers_post_backward_holds_each_groups_last_gradient_and_the_fix_none() -> None:
    """One rank: the step drops every unsharded gradient at the copy-in; PyTorch 2.13's tracker
    keeps each group's last one alive through its reduce (model[0], model[1], the root's
    ``2.weight``), the fixed one none; the fix is undone on exit."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from validation.tracker_hooks import fsdp_tracking_holds_no_gradients

    out = _held_after_copy_in(1)
    assert out["untracked"] == [[], [], []]
    assert out["pytorch"] == [["0.weight"], ["1.weight"], ["2.weight"]]
    assert out["fixed"] == out["untracked"]
    original = FSDPMemTracker._fsdp_param_group_post_backward
    with fsdp_tracking_holds_no_gradients():
        assert FSDPMemTracker._fsdp_param_group_post_backward is not original
    assert FSDPMemTracker._fsdp_param_group_post_backward is original


def test_at_two_ranks_foreach_reduce_itself_holds_each_groups_last_gradient() -> None:
    """World size 2: torch 2.13's ``foreach_reduce`` holds the group's last gradient itself (its
    loop over the gradients, run only when ``world_size > 1``, leaves ``unsharded_grad`` bound until
    it returns), tracked or not; the simulator frees it with the reduce-scatter
    (``sim.schedule.fsdp2_reduce``, ``tests/test_held_gradient.py``)."""
    out = _held_after_copy_in(2)
    assert out["untracked"] == out["pytorch"] == out["fixed"] == [["0.weight"], ["1.weight"], ["2.weight"]]
