"""The figures of a finished trace (``hfmodel.trace.Tracer``), from the storages' recorded lives:
each op's saved bytes and transients with their pieces, its order of requests forward and backward,
and a block op's figures were its block checkpointed (``finish``; the figures are those the
``hfmodel.trace`` docstring lists). Pure bookkeeping over the tracer's records: no aten call runs.
"""

from collections.abc import Callable, Mapping

from hfmodel.trace import OpRecord, Tracer


def peak_sets_per_op(
    lives: list[tuple[int, int, int]], windows: dict[int, list[int]], steps: int
) -> dict[int, tuple[int, tuple[int, ...]]]:
    """For each op, the most alive at any of its steps and the storages that make it up (their
    sizes in creation order), given each storage's (created, end, bytes): alive at the steps
    ``created <= step < end`` (steps past the last count as the last + 1)."""
    last = steps + 1
    delta = [0] * (steps + 2)
    for created, end, nbytes in lives:
        delta[min(created, last)] += nbytes
        delta[min(end, last)] -= nbytes
    alive, running = [0] * (steps + 2), 0
    for i, d in enumerate(delta):
        running += d
        alive[i] = running
    ordered = sorted(lives, key=lambda life: life[0])
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    for op, window in windows.items():
        if not window:
            out[op] = (0, ())
            continue
        at = max(window, key=lambda s: alive[s])
        pieces = tuple(n for c, e, n in ordered if n > 0 and min(c, last) <= at < min(e, last))
        out[op] = (alive[at], pieces)
    return out


def _backward_lives(tracer: Tracer, param_grad_keys: set[int]) -> list[tuple[int, int, int]]:
    """(bytes, created, end step) of what the backward created and counts as transient:
    parameter gradients (alive to the end) and a shared parameter's partial gradients excepted."""
    shared_grads = tracer.shared_parameter_grads()
    return [
        (nbytes, created, tracer.step + 1 if died is None else died)
        for uid, nbytes, created, died, _, in_backward, _ in tracer.storages
        if in_backward and uid not in shared_grads and (died is not None or not param_grad_keys)
    ]


def backward_live_bytes(tracer: Tracer, param_grad_keys: set[int], step: int) -> int:
    """What the backward has created and holds at ``step`` (as ``finish`` counts transients)."""
    return sum(n for n, created, end in _backward_lives(tracer, param_grad_keys) if created <= step < end)


def _held_until(creator: str, user: OpRecord | None, last_use: int, module_end: dict[str, int]) -> int:
    """The last step a checkpointed forward holds a storage the creator module made and ``user``
    read last: that use, or the end of the call (a child of the two modules' common ancestor)
    inside which it was read."""
    if user is None:
        return last_use
    made = creator.removeprefix("attention:").split(".")
    used = user.owner.removeprefix("attention:").split(".")
    common = 0
    while common < min(len(made), len(used)) and made[common] == used[common]:
        common += 1
    if common == len(used):  # read by the common ancestor itself
        return last_use
    return max(last_use, module_end.get(".".join(used[: common + 1]), last_use))


def finish(
    tracer: Tracer,
    param_grad_keys: set[int],
    block_of: Callable[[OpRecord], int | None] | None = None,
    kernel_inputs: Mapping[int, frozenset[int]] | None = None,
) -> None:
    """Saved bytes and transients of every op, from the storages' recorded lives, and its order of
    requests (``kernel_inputs``: per probe op, the storages it was handed, which the kernel
    keeps); with ``block_of`` (the block an op runs in) also each block op's
    ``checkpointed_forward_bytes`` and requests."""
    tracer._sweep()
    steps = tracer.step
    forward_lives = []
    for uid, nbytes, created, died, op, in_backward, _ in tracer.storages:
        if in_backward:
            continue
        if uid in tracer.saved:
            tracer.ops[op].saved_bytes += nbytes
            tracer.ops[op].saved_by.append((nbytes, frozenset(tracer.savers.get(uid, ()))))
            if nbytes > 0:
                tracer.ops[op].saved_pieces.append(nbytes)
        else:
            forward_lives.append((created, steps + 1 if died is None else died, nbytes))
    backward_lives = [(c, end, n) for n, c, end in _backward_lives(tracer, param_grad_keys)]
    fwd = peak_sets_per_op(forward_lives, {o.index: o.aten_ops for o in tracer.ops}, steps)
    bwd = peak_sets_per_op(backward_lives, {o.index: o.backward_ops for o in tracer.ops}, steps)
    for o in tracer.ops:
        o.forward_transient_bytes, o.forward_transient_pieces = fwd[o.index]
        o.backward_transient_bytes, o.backward_transient_pieces = bwd[o.index]
    inputs = kernel_inputs or {}
    kept = tracer.saved.union(*inputs.values())
    ends = {uid: died for uid, _, _, died, _, in_backward, _ in tracer.storages if not in_backward}
    for o, requests in zip(tracer.ops, _requests(tracer, kept, ends), strict=True):
        o.forward_requests = requests
    for o, requests in zip(tracer.ops, _backward_requests(tracer, kept), strict=True):
        # the kernel's inputs nothing else saves, released as its backward ends
        o.backward_requests = requests + [
            (uid, 0) for uid in sorted(inputs.get(o.index, ())) if uid not in tracer.saved
        ]
    if block_of is not None:
        blocks = [block_of(o) for o in tracer.ops]
        _checkpointed_forward(tracer, blocks)
        _recompute_transients(tracer, blocks)


def _recompute_transients(tracer: Tracer, blocks: list[int | None]) -> None:
    """Each block op's ``recompute_transient_bytes`` (``blocks``: each op's block): its forward
    transient (as ``finish`` counts it: what the forward does not save, alive at the op as it
    lived) of what its block's ops created alone."""
    unsaved: dict[int, list[tuple[int, int, int]]] = {}
    for uid, nbytes, created, died, op, in_backward, _ in tracer.storages:
        if not in_backward and blocks[op] is not None and uid not in tracer.saved:
            unsaved.setdefault(blocks[op], []).append(
                (created, tracer.step + 1 if died is None else died, nbytes)
            )
    for block, block_lives in unsaved.items():
        windows = {o.index: o.aten_ops for o in tracer.ops if blocks[o.index] == block}
        for index, figure in peak_sets_per_op(block_lives, windows, tracer.step).items():
            o = tracer.ops[index]
            o.recompute_transient_bytes, o.recompute_transient_pieces = figure


def _backward_requests(tracer: Tracer, kept: set[int]) -> list[list[tuple[int, int]]]:
    """Each op's backward requests (see the module docstring): every storage its backward makes,
    freed after the step it dies (never: a parameter's gradient), and the kept forward storages
    dropped at its steps."""
    op_of = {step: o.index for o in tracer.ops for step in o.backward_ops}
    events: list[tuple[int, int, int, int]] = []  # (step, 0 made / 1 freed, uid, bytes)
    for uid, nbytes, created, died, _, in_backward, _ in tracer.storages:
        if nbytes <= 0:
            continue
        if in_backward:
            events.append((created, 0, uid, nbytes))
        if died is not None and (in_backward or uid in kept):
            events.append((died, 1, uid, 0))
    out: list[list[tuple[int, int]]] = [[] for _ in tracer.ops]
    for step, _, uid, nbytes in sorted(events):
        if step in op_of:
            out[op_of[step]].append((uid, nbytes))
    return out


def _requests(
    tracer: Tracer, kept: set[int] | frozenset[int], ends: dict[int, int | None]
) -> list[list[tuple[int, int]]]:
    """Each op's forward requests (see the module docstring): every forward storage made at its
    step (``bytes`` < 0 where in ``kept``), and freed after the step ``ends`` gives it (None, a
    backward step, or kept: not in the forward)."""
    op_of = {step: o.index for o in tracer.ops for step in o.aten_ops}
    events: list[tuple[int, int, int, int]] = []  # (step, 0 made / 1 freed, uid, bytes)
    for uid, nbytes, created, _, _, in_backward, _ in tracer.storages:
        if in_backward or nbytes <= 0:
            continue
        events.append((created, 0, uid, -nbytes if uid in kept else nbytes))
        end = ends.get(uid)
        if uid not in kept and end is not None and end in op_of:
            events.append((end, 1, uid, 0))
    out: list[list[tuple[int, int]]] = [[] for _ in tracer.ops]
    for step, _, uid, nbytes in sorted(events):
        if step in op_of:
            out[op_of[step]].append((uid, nbytes))
    return out


def _checkpointed_forward(tracer: Tracer, blocks: list[int | None]) -> None:
    """Each block op's ``checkpointed_forward_bytes`` (``blocks``: each op's block): what its
    block's ops created and a checkpointed forward still holds at the op (non-reentrant
    checkpointing saves nothing, so a saved storage dies after its last forward use; the block's
    input, made by the block before, is the checkpoint's and not counted here)."""
    step_op = {step: o for o in tracer.ops for step in o.aten_ops}
    module_end: dict[str, int] = {}  # module path -> the last forward step of it or a submodule
    for o in tracer.ops:
        path = o.owner.removeprefix("attention:")
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            prefix = ".".join(parts[:i])
            module_end[prefix] = max(module_end.get(prefix, 0), max(o.aten_ops, default=0))
    lives: dict[int, list[tuple[int, int, int]]] = {}
    ends: dict[int, int | None] = {}  # the last step each storage of a block is held
    for uid, nbytes, created, died, op, in_backward, last_use in tracer.storages:
        block = blocks[op]
        if in_backward or block is None:
            continue
        # a save dies after its last forward use, or, used inside a submodule, when that
        # submodule returns (the caller's variable that passed it is rebound then); anything
        # else as it did, through its last step
        if uid in tracer.saved:
            last = _held_until(tracer.ops[op].owner, step_op.get(last_use), last_use, module_end)
        else:
            last = tracer.step + 1 if died is None else died
        lives.setdefault(block, []).append((created, last + 1, nbytes))
        ends[uid] = last
    for block, block_lives in lives.items():
        windows = {o.index: o.aten_ops for o in tracer.ops if blocks[o.index] == block}
        for index, figure in peak_sets_per_op(block_lives, windows, tracer.step).items():
            o = tracer.ops[index]
            o.checkpointed_forward_bytes, o.checkpointed_forward_pieces = figure
    for o, requests in zip(tracer.ops, _requests(tracer, set(), ends), strict=True):
        if blocks[o.index] is not None:
            o.checkpointed_forward_requests = requests
