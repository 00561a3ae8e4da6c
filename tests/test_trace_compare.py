"""``python -m validation.trace_compare``: a GPU's saved trace against the simulated step's
requests, size by size (the diagnostic for a GPU trace the allocator model replays right while the
simulated step's reserved is off). No GPU needed: the traces here are written by hand."""

from sim.core.events import MemoryCategory, MemoryRecord, RequestOrder
from sim.outputs.caching_allocator import MIB
from validation.allocator_trace import save_trace
from validation.trace_compare import main, simulated_requests, size_table

GIB = 1 << 30


def _rec(label: str, delta: int, **kw) -> MemoryRecord:
    return MemoryRecord(
        rank=0, time_s=0.0, category=MemoryCategory.ACTIVATIONS, delta_bytes=delta, label=label, **kw
    )


def test_the_simulated_requests_are_the_ones_the_replay_serves() -> None:
    """An ordered buffer asks for its order's requests, its partner's tensors among them (the
    partner is not asked for again); a buffer of pieces asks for each; frees ask for nothing."""
    order = RequestOrder(events=(3 * MIB, 5 * MIB, 0, 7 * MIB), kept=(True, False, True), partner="saved")
    records = [
        _rec("temp", 8 * MIB, order=order),
        _rec("saved", 12 * MIB),  # placed by temp's order
        _rec("grads", 9 * MIB, pieces=(4 * MIB, 5 * MIB)),
        _rec("temp", -8 * MIB),
        _rec("whole", 2 * MIB),
    ]
    assert simulated_requests(records) == [3 * MIB, 5 * MIB, 7 * MIB, 4 * MIB, 5 * MIB, 2 * MIB]


def test_sizes_either_side_asks_for_are_counted_largest_first() -> None:
    rows = size_table([2 * GIB, 2 * GIB, 1 * GIB, 10], [2 * GIB, 100 * MIB, 1], 64 * MIB)
    assert rows == [(2 * GIB, 2, 1), (1 * GIB, 1, 0), (100 * MIB, 0, 1)]


def test_a_trace_is_compared_with_the_lora_rows_simulated_step(tmp_path, capsys) -> None:
    """The LoRA row's fp32 scores are 4 x 32 x 2048² x 4 B = 2 GiB: the simulated step asks for
    blocks of that size, and the hand-written trace's three appear beside them."""
    entries = [{"action": "alloc", "addr": i * 4 * GIB, "size": 2 * GIB, "stream": 7} for i in range(3)]
    path = tmp_path / "trace.json.gz"
    save_trace(path, entries, capacity_bytes=80 * GIB, device="NVIDIA H100 80GB HBM3")
    assert main([str(path), "--min-mib", "1024"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2,048.00 |"))
    gpu, simulated = (int(cell.replace(",", "")) for cell in row.split("|")[2:4])
    assert gpu == 3 and simulated > 0


def test_a_file_that_is_no_trace_is_one_clear_error(tmp_path, capsys) -> None:
    path = tmp_path / "x.json.gz"
    path.write_bytes(b"not gzip")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trace_compare: error:") and len(err.strip().splitlines()) == 1
