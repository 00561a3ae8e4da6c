"""The README's answers about the ranks (in its "Scenarios and their answers" block): Llama-3-70B
scaled out from 64 to 1,024 H100s under FULL_SHARD and HYBRID_SHARD, and one rank of eight
computing slower than the others."""

from bench.answer_kit import SCALEOUT, claim, n, para, pct, peak_cell, report, scenario, t, table, world_busbw
from sim.scenario.sections import Scenario
from sim.workload.options import Strategy

SLOW = "scenarios/slow-rank-7b.toml"


SCALEOUT_ROWS = (
    ("parallel.strategy=FULL_SHARD",),
    ("parallel.world_size=1024",),
    ("parallel.world_size=1024", "parallel.strategy=HYBRID_SHARD"),
    ("parallel.world_size=1024", "parallel.strategy=HYBRID_SHARD", "parallel.shard_group_size=32"),
    ("parallel.world_size=1024", "parallel.strategy=HYBRID_SHARD", "parallel.shard_group_size=64"),
)


def _scaleout_label(s: Scenario) -> str:
    ranks = f"{s.parallel.world_size:,} ranks"
    if s.parallel.strategy is not Strategy.HYBRID_SHARD:
        return f"{s.parallel.strategy.value}, {ranks}"
    g = s.shard_group_size
    node = " (one node)" if g == s.gpus_per_node else ""
    return f"HYBRID_SHARD, shard {g}{node}, {ranks}"


def scale_out() -> str:
    base = scenario(SCALEOUT)
    rows = []
    for sets in SCALEOUT_ROWS:
        r = report(SCALEOUT, *sets)
        rows.append(
            (
                _scaleout_label(scenario(SCALEOUT, *sets)),
                n(r.tokens_per_s_per_gpu),
                t(r.step_time_s, 0),
                t(r.breakdown.exposed_comm_s, 0),
                peak_cell(r, model_state=True),
            )
        )
    head = para(
        f"""**Scale-out, Llama-3-70B on 64 to 1,024 H100s** (`{SCALEOUT}`; {n(base.training.seq_len)}
        tokens per rank, checkpointing, `--set parallel.world_size=... --set
        parallel.strategy=...`):"""
    )
    header = ("configuration", "tokens/s per GPU", "step", "exposed comm", "peak")
    return head + "\n\n" + table(header, rows) + "\n\n" + scale_out_prose()


def scale_out_prose() -> str:
    fs64, fs, node = (report(SCALEOUT, *sets) for sets in SCALEOUT_ROWS[:3])
    flat = fs.tokens_per_s_per_gpu / fs64.tokens_per_s_per_gpu - 1
    at_scale = [(report(SCALEOUT, *sets), scenario(SCALEOUT, *sets)) for sets in SCALEOUT_ROWS[1:]]
    best, best_s = min(((r, s) for r, s in at_scale if r.fits), key=lambda rs: rs[0].step_time_s)
    ring = world_busbw(SCALEOUT, "parallel.world_size=1024")
    claim(abs(flat) < 0.05, "FULL_SHARD keeps its per-GPU throughput nearly flat")
    claim(fs.breakdown.exposed_comm_s < 0.02 * fs.step_time_s, "its collectives hide behind compute")
    claim(not node.fits, "sharding within a node does not fit")
    gain = best.tokens_per_s_per_gpu / fs.tokens_per_s_per_gpu - 1
    claim(abs(gain) < 0.02, "within ... of FULL_SHARD")
    return para(
        f"""FULL_SHARD keeps its per-GPU throughput nearly flat ({pct(flat)}): a step of 70B with
        full checkpointing at {n(scenario(SCALEOUT).training.seq_len)} tokens is long enough that
        its all-gathers and reduce-scatters, rings over all eight NICs of each node (NCCL's model
        gives a 1 GiB all-gather over the 1,024 ranks {ring / 1e9:.0f} GB/s bus bandwidth, its 1,023
        steps included), hide behind compute ({t(fs.breakdown.exposed_comm_s, 0)} exposed).
        Sharding within a node does not fit; the fastest configuration that fits at 1,024 ranks is
        {_scaleout_label(best_s)}, {pct(gain, sign=True)} against FULL_SHARD."""
    )


def slow_rank() -> str:
    s = scenario(SLOW)
    slow, healthy = report(SLOW), report(SLOW, "simulation.slow_rank_factor=1.0")
    sim = s.simulation
    assert sim.slow_rank is not None
    fast = next(f for f in slow.per_rank if f.rank != sim.slow_rank).breakdown
    claim(healthy.breakdown.idle_s < 5e-5, "rises from (exposed only, no idle when healthy)")
    claim(fast.exposed_comm_s > healthy.breakdown.exposed_comm_s, "rises from ... to ...")
    return para(
        f"""**A slow rank** (`{SLOW}`, rank {sim.slow_rank} computes
        {pct(sim.slow_rank_factor - 1, 0)} slower, jitter off): {t(slow.step_time_s)} against
        {t(healthy.step_time_s)} healthy ({pct(slow.step_time_s / healthy.step_time_s - 1, sign=True)});
        on the fast ranks the time spent in collectives waiting for rank {sim.slow_rank} rises from
        {t(healthy.breakdown.exposed_comm_s)} to {t(fast.exposed_comm_s)} exposed plus
        {t(fast.idle_s)} idle."""
    )
