"""The vectorised engine (``sim.core.vector_engine``) against the SimPy engine, the reference:
the same event table op for op and allocation for allocation, the same report, on small jobs
whose ranks differ (jitter, a slow rank, a slow NIC), with compute slowed during collectives
and collectives sharing links; and what it does not take."""

import math

import pytest

from sim.core import vector_engine
from sim.core.engine import run_program
from sim.outputs.allocator import peak_active_bytes
from sim.outputs.memory_curve import memory_curve
from sim.outputs.report import build_report
from sim.scenario.loader import scenario_from_dict
from sim.simulate import (
    SimResult,
    _group_cost,
    _variability,
    build_program,
    build_step,
    scenario_network,
    scenario_profile,
)

CPU = "profiles/cpu-2x-gloo.json"


def _scenario(**sections: dict[str, object]):  # type: ignore[no-untyped-def]
    tables: dict[str, dict[str, object]] = {
        "model": {"preset": "llama2-7b", "n_layers": 3},
        "training": {"micro_batch": 1, "seq_len": 1024},
        "parallel": {"world_size": 8, "strategy": "FULL_SHARD"},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        "simulation": {"compute_jitter": 0.05, "seed": 3},
    }
    for name, values in sections.items():
        tables.setdefault(name, {}).update(values)
    return scenario_from_dict(tables, "vector-test")


def _both(scenario):  # type: ignore[no-untyped-def]
    profile = scenario_profile(scenario)
    network = scenario_network(scenario, profile)
    step, topology, ops = build_step(scenario, profile, network)
    program = build_program(step)
    variability = _variability(scenario, profile, network)
    kwargs = {
        "serial": not profile.backend.overlaps_comm_compute,
        "interference": profile.compute_slowdown_during_collective,
        "group_links": None
        if network is None
        else lambda kind, rank: network.links(topology.members(kind, rank)),
        "group_cost": None
        if network is None or network.links_identical
        else _group_cost(scenario, profile, network, topology),
    }
    tables = [run_program(program, topology, variability, vectorised=v, **kwargs) for v in (False, True)]
    return [
        SimResult(scenario=scenario, profile=profile, step=step, layer_ops=ops, program=program, events=t)
        for t in tables
    ]


CASES = {
    "FULL_SHARD, jitter": {},
    "FULL_SHARD, a slow rank, accumulation, prefetch": {
        "simulation": {"compute_jitter": 0.0, "slow_rank": 5, "slow_rank_factor": 1.3},
        "training": {"grad_accum": 2},
        "parallel": {"forward_prefetch": 1, "backward_prefetch": 2},
    },
    "SHARD_GRAD_OP, checkpointing": {
        "parallel": {"strategy": "SHARD_GRAD_OP"},
        "checkpointing": {"mode": "full"},
    },
    "DDP": {"parallel": {"strategy": "NO_SHARD"}},
    "FSDP1, FULL_SHARD": {"parallel": {"fsdp_version": 1}},
    "DeepSpeed ZeRO-3": {"deepspeed": {"enabled": True, "stage": 3}},
    "DeepSpeed ZeRO-2": {"deepspeed": {"enabled": True, "stage": 2}},
    "two nodes, a slow NIC": {
        "parallel": {"world_size": 16},
        "simulation": {"compute_jitter": 0.02, "slow_nic_node": 1, "slow_nic": 2, "slow_nic_factor": 0.3},
    },
    "gloo (serial), calibrated": {
        "cluster": {"profile": CPU},
        "model": {"preset": "tiny", "n_layers": 2},
        "training": {"micro_batch": 2, "seq_len": 64},
        "precision": {"param_dtype": "fp32", "reduce_dtype": "fp32"},
        "parallel": {"world_size": 2},
    },
}


def _by_instant(records):  # type: ignore[no-untyped-def]
    """Memory entries grouped by their time (rounded to 1e-12 s), each group sorted; an
    allocation with the stream whose pool serves it."""
    groups: dict[float, list[tuple[str, str, int, str]]] = {}
    for m in records:
        stream = m.stream.value if m.delta_bytes > 0 else ""
        groups.setdefault(round(m.time_s, 12), []).append((m.label, str(m.category), m.delta_bytes, stream))
    return {t: sorted(g) for t, g in groups.items()}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


@pytest.mark.parametrize("sections", CASES.values(), ids=CASES.keys())
def test_the_vectorised_engine_gives_the_simpy_engines_table(sections) -> None:  # type: ignore[no-untyped-def]
    reference, vectorised = _both(_scenario(**sections))
    ref, vec = reference.events, vectorised.events
    assert ref.simulated_ranks == tuple(range(ref.world_size))  # the reference simulated everyone
    assert set(vec.simulated_ranks) <= set(ref.simulated_ranks) and 0 in vec.simulated_ranks
    for rank in vec.simulated_ranks:
        a, b = (
            sorted(ref.ops_of(rank), key=lambda o: o.op_id),
            sorted(vec.ops_of(rank), key=lambda o: o.op_id),
        )
        assert [(o.op_id, o.kind, o.bytes, o.group_size) for o in a] == [
            (o.op_id, o.kind, o.bytes, o.group_size) for o in b
        ]
        for x, y in zip(a, b, strict=True):
            assert (
                _close(x.ready_s, y.ready_s) and _close(x.start_s, y.start_s) and _close(x.end_s, y.end_s)
            ), (x, y)
        # the same allocations at the same times; entries at one instant may come in another order
        # (SimPy's among processes woken together), which the peak must not notice
        assert _by_instant(ref.memory_of(rank)) == _by_instant(vec.memory_of(rank))
        assert memory_curve(ref, rank).peak_bytes() == memory_curve(vec, rank).peak_bytes()
        # and the caching allocator sees each at the same time (the host's; None on gloo)
        host_times = [
            sorted(
                (m.label, m.delta_bytes, None if m.host_s is None else round(m.host_s, 12))
                for m in t.memory_of(rank)
            )
            for t in (ref, vec)
        ]
        assert host_times[0] == host_times[1]
        assert peak_active_bytes(ref, rank) == peak_active_bytes(vec, rank)


@pytest.mark.parametrize("sections", CASES.values(), ids=CASES.keys())
def test_every_ranks_figures_agree_with_the_reports(sections) -> None:  # type: ignore[no-untyped-def]
    reference, vectorised = (build_report(r) for r in _both(_scenario(**sections)))
    assert _close(reference.step_time_s, vectorised.step_time_s)
    assert reference.peak_memory_bytes == vectorised.peak_memory_bytes
    for a, b in zip(reference.per_rank, vectorised.per_rank, strict=True):
        assert a.rank == b.rank and a.peak_memory_bytes == b.peak_memory_bytes
        assert _close(a.step_time_s, b.step_time_s)
        for x, y in zip(a.breakdown.to_json().values(), b.breakdown.to_json().values(), strict=True):
            assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)


def test_groups_that_differ_between_ranks_stay_with_simpy() -> None:
    hsdp = _scenario(parallel={"world_size": 16, "strategy": "HYBRID_SHARD", "shard_group_size": 8})
    profile = scenario_profile(hsdp)
    step, topology, _ = build_step(hsdp, profile)
    assert not vector_engine.supports(build_program(step), topology)
