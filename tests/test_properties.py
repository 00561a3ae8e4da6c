"""Engine invariants over random small scenarios (Hypothesis)."""

import json
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simtest import make_profile, make_scenario

from sim.core.events import MemoryCategory, Stream
from sim.outputs.memory_curve import memory_curve
from sim.outputs.report import build_report
from sim.simulate import simulate

scenario_args = st.fixed_dictionaries(
    {
        "strategy": st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]),
        "wrap": st.sampled_from(["model", "block", "linear"]),
        "world_size": st.sampled_from([2, 4]),
        "layers": st.integers(1, 3),
        "ckpt": st.sampled_from(["none", "full"]),
        "forward_prefetch": st.integers(0, 2),
        "backward_prefetch": st.integers(0, 2),
        "grad_accum": st.integers(1, 2),
        "param_dtype": st.sampled_from(["fp32", "bf16"]),
        "jitter": st.sampled_from([0.0, 0.2]),
        "slow_rank": st.sampled_from([None, 1]),
        "overlap": st.booleans(),
        "temp_buffers": st.booleans(),
        "seed": st.integers(0, 3),
    }
)


def _run(a):
    parallel = {
        "world_size": a["world_size"],
        "strategy": a["strategy"],
        "wrap": a["wrap"],
        "forward_prefetch": a["forward_prefetch"],
        "backward_prefetch": a["backward_prefetch"],
    }
    if a["strategy"] == "HYBRID_SHARD":
        parallel["shard_group_size"] = 2
    simulation = {"seed": a["seed"], "compute_jitter": a["jitter"]}
    if a["slow_rank"] is not None:
        simulation |= {"slow_rank": a["slow_rank"], "slow_rank_factor": 1.3}
    s = make_scenario(
        model={"preset": "tiny", "n_layers": a["layers"]},
        training={"micro_batch": 1, "seq_len": 32, "grad_accum": a["grad_accum"]},
        parallel=parallel,
        precision={"param_dtype": a["param_dtype"]},
        checkpointing={"mode": a["ckpt"]},
        simulation=simulation,
        cluster={"gpus_per_node": 2},
    )
    return simulate(s, make_profile(overlap=a["overlap"], temp_buffers=a["temp_buffers"]))


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scenario_args)
def test_memory_never_negative(a):
    r = _run(a)
    for rank in r.events.simulated_ranks:
        curve = memory_curve(r.events, rank)
        for category in MemoryCategory:
            assert curve.by_category[category].min() >= 0


@SETTINGS
@given(scenario_args)
def test_a_stream_never_runs_two_ops_at_once(a):
    r = _run(a)
    serial = not a["overlap"]
    for rank in r.events.simulated_ranks:
        lanes = defaultdict(list)
        for op in r.events.ops_of(rank):
            lanes["all" if serial else op.stream].append(op)
        for ops in lanes.values():
            ops.sort(key=lambda o: (o.start_s, o.end_s))
            for before, after in zip(ops, ops[1:], strict=False):
                assert after.start_s >= before.end_s - 1e-12


@SETTINGS
@given(scenario_args)
def test_collectives_start_after_the_last_rank_arrives_and_end_together(a):
    r = _run(a)
    instances = defaultdict(list)  # every rank runs the same program: one op id is one collective
    for op in r.events.ops:
        if op.kind.is_collective:
            instances[op.op_id].append(op)
    for ops in instances.values():
        ranks = {o.rank for o in ops}
        assert ranks == set(r.events.simulated_ranks)
        # members of one group share start and end; nobody starts before the group's last arrival
        groups = defaultdict(list)
        for o in ops:
            groups[_members(r, o)].append(o)
        for group_ops in groups.values():
            last_arrival = max(o.ready_s for o in group_ops)
            assert all(o.start_s >= last_arrival - 1e-15 for o in group_ops)
            assert len({o.end_s for o in group_ops}) == 1
            assert all(o.end_s >= last_arrival for o in group_ops)


def _members(result, op):
    from sim.core.topology import GroupKind, Topology

    s = result.scenario
    topo = Topology(world_size=s.parallel.world_size, gpus_per_node=2, shard_size=result.step.shard_size)
    kind = GroupKind.SHARD if op.stream in (Stream.ALL_GATHER, Stream.REDUCE_SCATTER) else GroupKind.REPLICATE
    return topo.members(kind, op.rank)


@settings(max_examples=10, deadline=None)
@given(scenario_args)
def test_same_seed_gives_bit_identical_json(a):
    first = json.dumps(build_report(_run(a)).to_json(), sort_keys=True)
    second = json.dumps(build_report(_run(a)).to_json(), sort_keys=True)
    assert first == second


def test_jitter_makes_ranks_differ_and_is_seeded():
    a = {
        "strategy": "FULL_SHARD",
        "wrap": "block",
        "world_size": 4,
        "layers": 2,
        "ckpt": "none",
        "forward_prefetch": 0,
        "backward_prefetch": 1,
        "grad_accum": 1,
        "param_dtype": "fp32",
        "jitter": 0.2,
        "slow_rank": None,
        "overlap": True,
        "temp_buffers": False,
        "seed": 1,
    }
    r1 = build_report(_run(a)).to_json()
    r2 = build_report(_run(a | {"seed": 2})).to_json()
    assert len({p["step_time_s"] for p in r1["per_rank"]}) > 1 or r1["ranks_simulated"] == 4
    assert r1["step_time_s"] != r2["step_time_s"]


def test_slow_rank_delays_everyone_through_collectives():
    base = {
        "strategy": "FULL_SHARD",
        "wrap": "block",
        "world_size": 4,
        "layers": 3,
        "ckpt": "none",
        "forward_prefetch": 0,
        "backward_prefetch": 1,
        "grad_accum": 1,
        "param_dtype": "fp32",
        "jitter": 0.0,
        "slow_rank": None,
        "overlap": True,
        "temp_buffers": False,
        "seed": 0,
    }
    fast = build_report(_run(base)).to_json()
    slow = build_report(_run(base | {"slow_rank": 1})).to_json()
    assert slow["ranks_simulated"] == 4 and fast["ranks_simulated"] == 1
    assert slow["step_time_s"] > fast["step_time_s"]
    # the other ranks wait for rank 1 at every collective: their idle time grows
    idle = [p["breakdown_s"]["idle"] for p in slow["per_rank"]]
    assert min(idle[0], idle[2], idle[3]) > idle[1]
