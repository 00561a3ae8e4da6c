"""The network's what-ifs: a degraded NIC, seeded per-NIC jitter, NICs or NVLink slower by a
factor, an oversubscribed spine. Those that make links differ simulate every rank and give each
group its own collective times; the others keep one rank standing for all."""

import pytest
from simtest import make_scenario

from sim.core.events import OpKind
from sim.errors import UserError
from sim.outputs.report import build_report
from sim.simulate import simulate


def _kw() -> dict[str, dict[str, object]]:
    """Llama-2-7B's first 4 layers, HSDP: shard within each of 4 nodes, replicate across them."""
    return {
        "model": {"preset": "llama2-7b", "n_layers": 4},
        "training": {"micro_batch": 1, "seq_len": 2048},
        "parallel": {"world_size": 32, "strategy": "HYBRID_SHARD", "shard_group_size": 8},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
    }


def _scenario(**simulation: object):  # type: ignore[no-untyped-def]
    return make_scenario(**_kw(), simulation=dict(simulation))


def _replicate_time_s(result, rank: int) -> float:  # type: ignore[no-untyped-def]
    return sum(o.duration_s for o in result.events.ops_of(rank) if o.kind is OpKind.ALL_REDUCE)


def test_a_slow_nic_slows_only_the_groups_that_send_through_it() -> None:
    healthy = simulate(_scenario())
    slow = simulate(_scenario(slow_nic_node=2, slow_nic=3, slow_nic_factor=0.25))
    assert healthy.events.simulated_ranks == (0,)
    assert slow.events.simulated_ranks == tuple(range(32))
    # HSDP: rank 3's replicate group (GPU 3 of every node) crosses NIC 3 of node 2; rank 2's does not
    assert _replicate_time_s(slow, 3) > 2 * _replicate_time_s(slow, 2)
    assert _replicate_time_s(slow, 2) == pytest.approx(_replicate_time_s(healthy, 0), rel=1e-9)
    assert build_report(slow).step_time_s > build_report(healthy).step_time_s


def test_nic_jitter_is_seeded() -> None:
    a, b = (build_report(simulate(_scenario(nic_jitter=0.2, seed=s))).step_time_s for s in (1, 1))
    c = build_report(simulate(_scenario(nic_jitter=0.2, seed=2))).step_time_s
    assert a == b != c


def test_symmetric_what_ifs_keep_one_rank_for_all() -> None:
    base = build_report(simulate(_scenario()))
    slower = simulate(make_scenario(**_kw(), cluster={"nic_factor": 0.5}))
    assert slower.events.simulated_ranks == (0,)
    assert _replicate_time_s(slower, 0) > 1.5 * _replicate_time_s(simulate(_scenario()), 0)
    assert build_report(slower).step_time_s >= base.step_time_s


def test_a_nic_outside_the_job_is_one_line_naming_the_keys() -> None:
    with pytest.raises(UserError, match="simulation.slow_nic_node = 9"):
        simulate(_scenario(slow_nic_node=9, slow_nic_factor=0.5))
    with pytest.raises(UserError, match="slow_nic_factor must be > 0"):
        _scenario(slow_nic_node=1, slow_nic_factor=0.0)
