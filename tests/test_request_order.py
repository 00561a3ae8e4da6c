"""The order in which a segment's forward makes and frees its tensors (issue 11, reserved memory):
the tracer's per-op requests, the eager attention's own, a segment's ``RequestOrder`` and the
caching allocator's replay of it."""

import pytest
from simtest import elementwise_op

from sim.core.events import MemoryCategory, MemoryRecord, RequestOrder, Stream
from sim.costs.request_order import backward_order, request_order
from sim.outputs.allocator import Served, serve_record
from sim.outputs.caching_allocator import CachingAllocator
from sim.workload.attention_kernel import attention_kernel_backward_requests, attention_kernel_requests
from sim.workload.eager_attention import (
    eager_score_backward_requests,
    eager_score_bytes,
    eager_score_requests,
    eager_score_saved_pieces,
)
from sim.workload.layer_op import LayerOp
from sim.workload.shapes import AttentionShape, Workload

MiB = 1 << 20


def test_the_tracer_orders_each_ops_allocations_and_frees() -> None:
    """``(lin(x) * 2).relu() + 1).sum()``: each call's output is made before the input it was the
    last to read is freed; what autograd saves (x for the matmul, relu's output) is kept, and
    released in backward where autograd drops it."""
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hfmodel.trace import HostCalls, Owners, SavedBytes, Tracer
    from hfmodel.trace_figures import finish

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ((self.lin(x) * 2).relu() + 1).sum()

    with FakeTensorMode():
        model = Toy()
        owners = Owners(model)
        tracer = Tracer(owners, list(model.parameters()))
        x = torch.randn(4, 8)
        with tracer, HostCalls(owners, tracer), SavedBytes(tracer).hooks:
            loss = model(x)
            tracer.backward = True
            loss.backward()
        finish(tracer, set())
    lin, root = tracer.ops
    assert [o.owner for o in tracer.ops] == ["lin", ""]
    (given, given_bytes), (y, y_bytes) = lin.forward_requests
    assert (given_bytes, y_bytes) == (-128, 128)  # x saved by the matmul, kept; its output freed later
    ids = [uid for uid, _ in root.forward_requests]
    m, r, a, total = ids[0], ids[2], ids[4], ids[5]
    assert root.forward_requests == [
        (m, 128),  # * 2
        (y, 0),  # the linear's output, read last by the multiply
        (r, -128),  # relu: its output kept for backward
        (m, 0),
        (a, 128),  # + 1
        (total, 4),  # sum: the loss, live past the forward
        (a, 0),
    ]
    assert len({given, y, m, r, a, total}) == 6
    # backward: relu's makes its input's gradient, then autograd releases the output it kept; the
    # multiply's reads that gradient last
    (g1, _), _, (g2, _), _ = root.backward_requests
    assert root.backward_requests == [(g1, 128), (r, 0), (g2, 128), (g1, 0)]
    # the linear's: the weight's gradient (8 x 8 fp32), live past the step, and the input's
    # gradient it no longer needs freed
    assert (g2, 0) in lin.backward_requests
    (weight_grad,) = [uid for uid, n in lin.backward_requests if n == 256]
    assert (weight_grad, 0) not in lin.backward_requests


@pytest.mark.parametrize("a", [2, 4])
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("dropout", [False, True])
def test_eager_score_requests_are_the_table_op_by_op(a: int, softcap: bool, dropout: bool) -> None:
    """Served in order, the eager path's per-score requests keep the table's saved tensors, in
    its order, and peak at its forward peak above them."""
    live: dict[int, int] = {}
    kept: list[int] = []
    peak = 0
    for tensor, nbytes in eager_score_requests(a, softcap=softcap, dropout=dropout):
        if nbytes == 0:
            del live[tensor]
            continue
        assert tensor not in live
        live[tensor] = abs(nbytes)
        kept += [-nbytes] if nbytes < 0 else []
        peak = max(peak, sum(live.values()))
    table = eager_score_bytes(a, softcap=softcap, dropout=dropout)
    assert tuple(kept) == eager_score_saved_pieces(a, softcap=softcap, dropout=dropout)
    assert sum(live.values()) == table.saved  # all that is left is what is kept
    assert peak - table.saved == table.forward_peak


@pytest.mark.parametrize("a", [2, 4])
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("dropout", [False, True])
def test_eager_score_backward_requests_are_the_table_op_by_op(a: int, softcap: bool, dropout: bool) -> None:
    """The backward's per-score requests peak at the table's backward peak above what was live as
    it started, and release every tensor the forward kept, once."""
    kept = {t: -n for t, n in eager_score_requests(a, softcap=softcap, dropout=dropout) if n < 0}
    own: dict[int, int] = {}
    released: list[int] = []
    live = peak = 0
    for tensor, nbytes in eager_score_backward_requests(a, softcap=softcap, dropout=dropout):
        if nbytes:
            own[tensor] = nbytes
            live += nbytes
        elif tensor in own:
            live -= own.pop(tensor)
        else:
            released.append(tensor)
            live -= kept[tensor]
        peak = max(peak, live)
    assert peak == eager_score_bytes(a, softcap=softcap, dropout=dropout).backward_peak
    assert sorted(released) == sorted(kept) and not own


@pytest.mark.parametrize("kernel", ["eager", "flash", "math"])
def test_the_kernels_backward_releases_all_its_forward_kept(kernel: str) -> None:
    shape = AttentionShape(batch=2, seq_len=64, heads=8, kv_heads=2, head_dim=16)
    w = Workload(micro_batch=2, seq_len=64, act_bytes=2, attention_kernel=kernel)
    forward, checkpointed = attention_kernel_requests(shape, w, output_saved=True)
    kept = [t for t, n in forward if n < 0]
    backward = attention_kernel_backward_requests(shape, w, output_saved=True)
    made = {t for t, n in backward if n}
    assert sorted(t for t, n in backward if n == 0 and t not in made) == sorted(kept)
    # checkpointed, the forward keeps nothing: all it makes is freed
    assert {t for t, n in checkpointed if n} == {t for t, n in checkpointed if n == 0}
    assert all(n >= 0 for _, n in checkpointed)


def _op(name: str, requests: tuple[tuple[int, int], ...] | None, backward=None) -> LayerOp:  # type: ignore[no-untyped-def]
    return elementwise_op(name, forward_requests=requests, backward_requests=backward)


def test_a_segments_order_joins_its_ops_requests() -> None:
    first = _op("a", ((7, 10), (8, -20), (9, 30), (-1, 5), (-1, 0)))  # -1: the op's own tensor
    second = _op("b", ((7, 0), (-1, 40), (3, 0), (9, 0), (-1, 0), (10, 50)))  # 3: an earlier segment's
    order = request_order([first, second], "forward")
    assert order == RequestOrder(
        events=(10, 20, 30, 5, -3, -0, 40, -2, -4, 50),
        kept=(False, True, False, False, False, False),
    )
    # a checkpointed block keeps what it leaves live in its one buffer
    assert request_order([first, second], "forward", all_kept=True).kept == (True,) * 6
    assert request_order([first, _op("c", None)], "forward") is None  # an analytic op: no order


def test_a_segments_backward_order_runs_its_ops_backwards_in_reverse() -> None:
    """The second op's backward first; a kept tensor's free is its release, by its place among
    the forward's kept tensors; a storage kept by another segment is that one's to free."""
    first = _op("a", ((7, -10), (8, -20)), backward=((20, 6), (7, 0), (20, 0), (21, 4)))
    second = _op("b", ((9, -30), (-8, -40)), backward=((-21, 5), (-8, 0), (9, 0), (3, 0), (22, 7), (-21, 0)))
    order = backward_order([first, second])
    assert order == RequestOrder(
        events=(5, 7, -0, 6, -2, 4),
        kept=(True,) * 4,
        releases=((1, 3), (1, 2), (4, 0)),  # b's kernel tensor, then storage 9; a's storage 7
    )
    assert backward_order([first, _op("c", ((9, -30),))]) is None  # c's backward order not known


def _alloc(label: str, nbytes: int, order: RequestOrder | None = None) -> MemoryRecord:
    return MemoryRecord(
        rank=0, time_s=0.0, category=MemoryCategory.ACTIVATIONS, delta_bytes=nbytes, label=label, order=order
    )


def _free(label: str, nbytes: int) -> MemoryRecord:
    return MemoryRecord(
        rank=0, time_s=0.0, category=MemoryCategory.ACTIVATIONS, delta_bytes=-nbytes, label=label
    )


def test_the_allocator_serves_an_order_and_places_its_partner() -> None:
    """A 30 MiB temporary freed before a 24 MiB one is asked for: the second takes its hole (one
    segment of 30 MiB, not two). The kept 20 MiB is the saved buffer's, the 24 MiB still live
    the transient's, whose own record is not served again and whose free releases it."""
    order = RequestOrder(events=(30 * MiB, 20 * MiB, -0, 24 * MiB), kept=(False, True, False), partner="temp")
    allocator, served = CachingAllocator(1 << 40), Served()
    serve_record(allocator, _alloc("saved", 20 * MiB, order), served)
    serve_record(allocator, _alloc("temp", 30 * MiB), served)  # the figure's bytes: not served again
    assert allocator.reserved == 50 * MiB
    assert [b.size for b in served["saved"]] == [20 * MiB]
    assert [b.size for b in served["temp"]] == [24 * MiB]
    serve_record(allocator, _free("temp", 30 * MiB), served)
    serve_record(allocator, _free("saved", 20 * MiB), served)
    assert served == {} and allocator.reserved == 50 * MiB
    # the same tensors as pieces, the transient's all at once: a third segment
    pieces, served = CachingAllocator(1 << 40), Served()
    for rec in (
        MemoryRecord(
            rank=0, time_s=0.0, category=MemoryCategory.ACTIVATIONS, delta_bytes=20 * MiB, label="s"
        ),
        MemoryRecord(
            rank=0,
            time_s=0.0,
            category=MemoryCategory.OTHER,
            delta_bytes=54 * MiB,
            label="t",
            pieces=(30 * MiB, 24 * MiB),
            stream=Stream.COMPUTE,
        ),
    ):
        serve_record(pieces, rec, served)
    assert pieces.reserved == 74 * MiB


def test_an_order_without_partner_keeps_all_it_leaves_live() -> None:
    order = RequestOrder(events=(4 * MiB, 2 * MiB, -0), kept=(False, False))
    allocator, served = CachingAllocator(1 << 40), Served()
    serve_record(allocator, _alloc("temp", 4 * MiB, order), served)
    assert [b.size for b in served["temp"]] == [2 * MiB]


def test_a_backward_order_releases_the_tensors_it_consumes() -> None:
    """A 2 GiB gradient asked for after the backward released a 2 GiB kept tensor takes its
    place; the activations' later free gives back only what is left."""
    GiB = 1 << 30
    allocator, served = CachingAllocator(1 << 40), Served()
    forward = RequestOrder(events=(GiB, 2 * GiB), kept=(True, True))
    serve_record(allocator, _alloc("acts", 3 * GiB, forward), served)
    backward = RequestOrder(events=(2 * GiB,), kept=(True,), consumed="acts", releases=((0, 1),))
    serve_record(allocator, _alloc("bwd", 2 * GiB, backward), served)
    assert allocator.reserved == 3 * GiB  # the gradient in the released tensor's segment
    assert served["acts"][1] is None
    serve_record(allocator, _free("acts", 3 * GiB), served)
    serve_record(allocator, _free("bwd", 2 * GiB), served)
    assert served == {}
    twice = RequestOrder(events=(), kept=(), consumed="again", releases=((0, 0), (0, 0)))
    serve_record(allocator, _alloc("again", GiB, RequestOrder(events=(GiB,), kept=(True,))), served)
    with pytest.raises(AssertionError, match="released twice"):
        serve_record(allocator, _alloc("bwd2", 1, twice), served)
