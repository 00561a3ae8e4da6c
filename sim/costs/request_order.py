"""The order in which a segment asks the caching allocator for its tensors: its ops' forward
requests one after another (``request_order``) and its backward, the ops' backwards in reverse
with the forward's kept tensors released where autograd drops them (``backward_order``).

Each op carries its requests (``LayerOp.forward_requests``, ``checkpointed_forward_requests``,
``backward_requests``: the tracer's per-op allocations and frees of a described model,
``hfmodel/trace.py``, and the attention kernel's, ``sim.workload.attention_kernel``); these
functions join them into one ``RequestOrder`` per buffer, which ``sim.outputs.allocator`` serves.
"""

from collections.abc import Sequence

from sim.core.events import RequestOrder
from sim.workload.layer_op import LayerOp


def request_order(ops: Sequence[LayerOp], figure: str, *, all_kept: bool = False) -> RequestOrder | None:
    """The ops' ``<figure>_requests`` one after another, as the caching allocator is asked for
    them: each tensor made a request, its free (where it was made in these ops; a storage of an
    earlier segment is freed with that segment's buffers) the free of that request. A kept tensor
    (bytes < 0) is the saved buffer's, any other still live at the end the transient's (its
    consumer is a later segment's op); ``all_kept``: all are the buffer's (a checkpointed block
    saves nothing, and its segment's one buffer holds everything it leaves live). None where an
    op's order is not known. A model's storages are numbered alike in every block (the traced
    representative's), a kernel's own tensors (negative numbers) per op."""
    joined = _joined_order(ops, figure, all_kept=all_kept)
    return None if joined is None else joined[0]


def _tensor_key(position: int, tensor: int) -> object:
    """A tensor of a segment's requests: a model's storage by its number, a kernel's own (< 0)
    with its op's position."""
    return (position, tensor) if tensor < 0 else tensor


def _joined_order(
    ops: Sequence[LayerOp], figure: str, *, all_kept: bool = False
) -> tuple[RequestOrder, dict[object, int]] | None:
    """``request_order``, and where each kept tensor is among those the buffer keeps (in order)."""
    requests = [getattr(op, f"{figure}_requests") for op in ops]
    if not ops or any(r is None for r in requests):
        return None
    index: dict[object, int] = {}  # tensor -> its request's number
    kept_at: dict[object, int] = {}
    events: list[int] = []
    kept: list[bool] = []
    for position, op_requests in enumerate(requests):
        for tensor, nbytes in op_requests:
            key = _tensor_key(position, tensor)
            if nbytes:
                index[key] = len(kept)
                events.append(abs(nbytes))
                if nbytes < 0:  # its place among those the buffer keeps (none is freed here)
                    kept_at[key] = len(kept_at)
                kept.append(all_kept or nbytes < 0)
            elif key in index:
                events.append(-index.pop(key))
    return RequestOrder(events=tuple(events), kept=tuple(kept)), kept_at


def backward_order(ops: Sequence[LayerOp]) -> RequestOrder | None:
    """The segment's backward as the caching allocator is asked for it: its ops' backwards in
    reverse order, each its ``backward_requests`` (what it makes, freed where it dies, live to the
    segment's end otherwise: the input's gradient for the segment before, the parameters'), with
    the tensors the forward kept released where the backward drops them (their positions in the
    forward's order, ``_joined_order``; a kept storage of another segment goes with that one's
    buffer). None where an op's orders are not known."""
    joined = _joined_order(ops, "forward")
    if joined is None or any(op.backward_requests is None for op in ops):
        return None
    kept_at = joined[1]
    events: list[int] = []
    index: dict[object, int] = {}
    releases: list[tuple[int, int]] = []
    made = 0
    for position in reversed(range(len(ops))):
        for tensor, nbytes in ops[position].backward_requests or ():
            key = _tensor_key(position, tensor)
            if nbytes:
                index[key], made = made, made + 1
                events.append(nbytes)
            elif key in index:
                events.append(-index.pop(key))
            elif key in kept_at:
                releases.append((len(events), kept_at.pop(key)))
    return RequestOrder(events=tuple(events), kept=(True,) * made, releases=tuple(releases))
