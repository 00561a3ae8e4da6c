"""Chrome trace and interval arithmetic: the trace is valid Trace Event Format, one stream never runs
two ops at once, and the per-rank breakdown recomputed from the file equals ``rank_breakdown``."""

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.events import EventTable, MemoryCategory, OpKind, OpRecord, Stream
from sim.outputs.chrome_trace import STREAM_IDS, write_chrome_trace, write_chrome_trace_per_rank
from sim.outputs.intervals import (
    Breakdown,
    difference,
    merge,
    rank_breakdown,
    step_time,
    subtract_length,
    union_length,
)
from sim.outputs.report import build_report

try:
    from browser import synthetic_table
except ImportError:  # tests/ is a package
    from tests.browser import synthetic_table

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


# --- intervals ---------------------------------------------------------------------------------


def test_union_and_difference_by_hand():
    assert merge([(0, 1), (0.5, 2), (3, 4), (4, 5), (6, 6)]) == [(0, 2), (3, 5)]
    assert union_length([]) == 0.0
    assert union_length([(0, 1), (0.5, 2), (5, 6)]) == 3.0
    assert difference([(0, 10)], [(1, 2), (3, 4), (9, 12)]) == [(0, 1), (2, 3), (4, 9)]
    assert subtract_length([(0, 10), (11, 13)], [(1, 2), (3, 4), (9, 12)]) == 8.0


intervals = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=12)


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_measures_match_counting_unit_cells(a, b):
    """On integer endpoints, measures equal counts of covered unit cells [k, k+1)."""
    cells_a = {k for s, e in a for k in range(s, e)}
    cells_b = {k for s, e in b for k in range(s, e)}
    assert union_length(a) == len(cells_a)
    assert subtract_length(a, b) == len(cells_a - cells_b)
    assert subtract_length(a, b) == union_length(a + b) - union_length(b)


def _op(op_id, stream, kind, start, end):
    return OpRecord(
        rank=0,
        op_id=op_id,
        stream=stream,
        kind=kind,
        name=f"{kind}{op_id}",
        unit="u",
        microbatch=0,
        ready_s=start,
        start_s=start,
        end_s=end,
    )


def test_rank_breakdown_by_hand():
    ops = [
        _op(0, Stream.ALL_GATHER, OpKind.ALL_GATHER, 0.0, 2.0),  # exposed 0-1
        _op(1, Stream.COMPUTE, OpKind.FORWARD, 1.0, 3.0),
        _op(2, Stream.REDUCE_SCATTER, OpKind.REDUCE_SCATTER, 2.5, 5.0),  # exposed 3-5
        _op(3, Stream.COMPUTE, OpKind.OPTIMIZER, 6.0, 7.0),  # idle 5-6
    ]
    table = EventTable(world_size=4, simulated_ranks=(0,), ops=tuple(ops))
    assert step_time(table) == 7.0
    assert rank_breakdown(table, 3, 7.0) == Breakdown(compute_s=3.0, exposed_comm_s=3.0, idle_s=1.0)
    assert rank_breakdown(table, 3, 7.0).to_json() == {"compute": 3.0, "exposed_comm": 3.0, "idle": 1.0}


# --- chrome trace ------------------------------------------------------------------------------


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def x_events(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def breakdown_from_trace(doc: dict, pid: int, step_us: float) -> dict[str, float]:
    """The report's definitions, recomputed from the file alone (seconds)."""
    compute, collective = [], []
    for e in x_events(doc):
        if e["pid"] != pid:
            continue
        span = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        if e["tid"] == STREAM_IDS[Stream.COMPUTE]:
            compute.append(span)
        if "Collective name" in e["args"]:
            collective.append(span)
    c, x = union_length(compute), subtract_length(collective, compute)
    return {"compute": c, "exposed_comm": x, "idle": max(0.0, step_us / 1e6 - c - x)}


def check_trace(doc: dict, table: EventTable) -> None:
    """Structure, no overlap on a (pid, tid), names for every lane, breakdown equal to the report's."""
    events = x_events(doc)
    assert events and all("dur" in e and e["dur"] >= 0 for e in events)
    lanes = defaultdict(list)
    for e in events:
        lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end - 1e-6  # 1 ps of float slack in microseconds
    names = {
        (e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert set(lanes) <= names
    pids = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {p for p, _ in lanes} <= pids
    step = step_time(table)
    for pid in {p for p, _ in lanes}:
        got = breakdown_from_trace(doc, pid, step * 1e6)
        want = rank_breakdown(table, pid, step).to_json()
        for key in want:
            assert math.isclose(got[key], want[key], rel_tol=1e-9, abs_tol=1e-15), (pid, key, got, want)


def test_small_trace_is_valid_and_matches_breakdown(tmp_path):
    table = synthetic_table(4, 6)
    path = tmp_path / "step.json"
    write_chrome_trace(table, path)
    doc = load(path)
    check_trace(doc, table)
    assert doc["distributedInfo"] == {"backend": "nccl", "rank": 0, "world_size": 4}
    assert len(x_events(doc)) == len(table.ops)
    names = {e["name"] for e in x_events(doc)}
    assert "ncclDevKernel_AllGather_RING_LL" in names
    assert "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL" in names
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"stream 7 compute", "stream 20 all_gather", "stream 24 reduce_scatter"}
    ag = next(e for e in x_events(doc) if e["pid"] == 0 and e["args"]["kind"] == "all_gather")
    assert (
        ag["args"]["Group size"] == 4
        and ag["args"]["bytes"] > 0
        and "wait for slowest rank (us)" in ag["args"]
    )
    assert any(
        e["args"]["wait for slowest rank (us)"] > 0 for e in x_events(doc) if "Collective name" in e["args"]
    )


def test_memory_counters_follow_the_records(tmp_path):
    table = synthetic_table(2, 5)
    path = tmp_path / "step.json"
    write_chrome_trace(table, path)
    counters = [e for e in load(path)["traceEvents"] if e["ph"] == "C" and e["pid"] == 1]
    assert counters == sorted(counters, key=lambda e: e["ts"])
    assert all(v >= 0 for e in counters for v in e["args"].values())
    final = {c: sum(m.delta_bytes for m in table.memory_of(1) if m.category == c) for c in MemoryCategory}
    assert counters[-1]["args"] == {str(c): v for c, v in final.items()}
    assert len(counters) == len(table.memory_of(1))  # one counter event per memory-curve entry


def test_unsimulated_ranks_borrow_the_simulated_rank(tmp_path):
    table = synthetic_table(64, 3, simulate_all=False)
    path = tmp_path / "step.json"
    write_chrome_trace(table, path, ranks=[5, 63])
    doc = load(path)
    check_trace(doc, table)
    assert {e["pid"] for e in x_events(doc)} == {5, 63}
    assert doc["distributedInfo"]["rank"] == 5
    with pytest.raises(ValueError, match="outside the job"):
        write_chrome_trace(table, path, ranks=[64])


def test_one_file_per_rank_for_hta(tmp_path):
    table = synthetic_table(3, 4)
    paths = write_chrome_trace_per_rank(table, tmp_path / "traces")
    assert [p.name for p in paths] == ["rank0.trace.json", "rank1.trace.json", "rank2.trace.json"]
    for rank, p in enumerate(paths):
        doc = load(p)
        assert doc["distributedInfo"]["rank"] == rank and doc["distributedInfo"]["world_size"] == 3
        assert {e["pid"] for e in doc["traceEvents"]} == {rank}
        check_trace(doc, table)
    assert not list((tmp_path / "traces").glob("*.tmp"))


def test_large_trace_size_and_event_count(tmp_path):
    """64 distinct ranks × 80 layers: every op is one X event at a bounded size per event."""
    table = synthetic_table(64, 80)
    path = tmp_path / "big.json"
    write_chrome_trace(table, path)
    doc = load(path)
    assert len(x_events(doc)) == len(table.ops) == 64 * (80 * 3 + 80 * 4 + 1)
    assert len([e for e in doc["traceEvents"] if e["ph"] == "C"]) <= len(table.memory)
    assert path.stat().st_size < 450 * len(doc["traceEvents"])
    check_trace(doc, table)


def test_real_scenario_trace_matches_report(tmp_path):
    from sim.scenario.loader import load_scenario
    from sim.simulate import simulate

    result = simulate(load_scenario(SCENARIOS / "tiny.toml"))
    path = tmp_path / "tiny.json"
    write_chrome_trace(result.events, path)
    doc = load(path)
    check_trace(doc, result.events)
    got = breakdown_from_trace(doc, 0, max(e["ts"] + e["dur"] for e in x_events(doc)))
    for key, value in build_report(result).to_json()["breakdown_s"].items():
        assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-12), (key, got, value)
