"""Sweep throughput: configurations per second for 10,000 variants of a 32-layer model at 64 ranks.

Target (what-if issue): 10,000 configurations in under 60 s on 2 cores. The grid varies micro-batch,
sequence length, strategy, wrap (model, block), checkpointing and both prefetch depths of
Llama-2-7B (32 layers) on 64 ranks. ``linear`` wrap is left out: its ~7x more units make each
point about ten times as costly and would measure that one value rather than the sweep.

Before the timed run, a sample of points is timed in this process, phase by phase, to show where a
point's time goes besides ``simulate`` itself (parsing, worker round trip, result size).
"""

import os
import pickle
import resource
import time
from typing import Any

from sim.outputs.report import build_report
from sim.scenario.loader import scenario_from_dict
from sim.simulate import simulate
from sim.study.sweep.execute import RESULT_KEYS, Base, apply_point, run_chunk, run_points
from sim.study.sweep.outputs import csv_text, markdown_text
from sim.study.sweep.plan import Axis, expand, make_rows

TARGET_S = 60.0
N_POINTS = 10_000
BASE: Base = {
    "model": {"preset": "llama2-7b"},
    "training": {"micro_batch": 1, "seq_len": 4096},
    "parallel": {"world_size": 64},
    "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
    "cluster": {"profile": "h100-sxm", "gpus_per_node": 8},
}
AXES = (
    Axis(key="parallel.strategy", values=("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")),
    Axis(key="parallel.wrap", values=("model", "block")),
    Axis(key="checkpointing.mode", values=("none", "full")),
    Axis(key="training.micro_batch", values=(1, 2, 4, 8, 16)),
    Axis(key="training.seq_len", values=(1024, 2048, 4096, 8192, 16384)),
    Axis(key="parallel.forward_prefetch", values=(0, 1, 2, 3, 4)),
    Axis(key="parallel.backward_prefetch", values=(0, 1, 2, 3, 4)),
)


def _phases(points: Any, sample: int = 100) -> dict[str, float]:
    """Mean seconds per point of each phase, and bytes per point sent and returned, in this process."""
    picked = points[:: max(1, len(points) // sample)][:sample]
    t_parse = t_sim = t_pick = 0.0
    for point in picked:
        t0 = time.perf_counter()
        scenario = scenario_from_dict(apply_point(BASE, point), "bench")
        t1 = time.perf_counter()
        report = build_report(simulate(scenario)).to_json()
        t2 = time.perf_counter()
        pickle.loads(pickle.dumps({k: report[k] for k in RESULT_KEYS}))
        t_pick += time.perf_counter() - t2
        t_parse, t_sim = t_parse + t1 - t0, t_sim + t2 - t1
    n = len(picked)
    sent = len(pickle.dumps((BASE, "bench", list(picked)))) / n
    returned = len(pickle.dumps(run_chunk(BASE, "bench", picked[:10]))) / 10
    return {
        "parse_s": t_parse / n,
        "simulate_s": t_sim / n,
        "result_pickle_s": t_pick / n,
        "sent_B": sent,
        "returned_B": returned,
    }


def _children_cpu_s() -> float:
    """User + system CPU seconds of the finished worker processes (load on the machine does not count)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    points = expand(AXES, "grid", "bench")
    assert len(points) == N_POINTS, len(points)
    cores = os.cpu_count() or 1
    ph = _phases(points)
    print(
        f"per point, one core: parse {ph['parse_s'] * 1e3:.2f} ms, simulate {ph['simulate_s'] * 1e3:.2f} ms, "
        f"result pickling {ph['result_pickle_s'] * 1e6:.0f} us; sent {ph['sent_B']:.0f} B, "
        f"returned {ph['returned_B']:.0f} B"
    )
    print(f"lower bound on {cores} cores from simulate alone: {N_POINTS * ph['simulate_s'] / cores:.1f} s")
    cpu_before = _children_cpu_s()
    start = time.perf_counter()
    results = run_points(BASE, "bench", points, jobs=cores)
    run_s = time.perf_counter() - start
    cpu_s = _children_cpu_s() - cpu_before
    rows = make_rows_for_bench(points, results)
    wall = time.perf_counter() - start
    errors = sum(bool(r["error"]) for r in rows)
    print(
        f"{N_POINTS:,} configurations (32 layers, 64 ranks) on {cores} cores: {wall:.1f} s "
        f"(running {run_s:.1f} s), {N_POINTS / wall:,.0f} configs/s, {errors} invalid"
    )
    print(f"target {N_POINTS:,} in < {TARGET_S:.0f} s: ratio {wall / TARGET_S:.2f} (< 1 meets it)")
    print(
        f"worker CPU time {cpu_s:.1f} s ({cpu_s / run_s:.2f} of {cores} cores busy): "
        f"{N_POINTS / cpu_s:,.0f} configs per CPU-second, about {cpu_s / cores:.1f} s on {cores} idle cores"
    )


def make_rows_for_bench(points: Any, results: Any) -> list[dict[str, Any]]:
    """Rows and the CSV and markdown text, as ``fsdpsim sweep`` makes them (files not written)."""
    from sim.study.sweep.plan import Plan

    plan = Plan(base=BASE, where="bench", axes=AXES, points=points)
    rows = make_rows(plan, results)
    csv_text(rows, AXES)
    markdown_text(rows, AXES)
    return rows


if __name__ == "__main__":
    main()
