"""FSDP2's integer ``reshard_after_forward`` (``_fsdp_init._get_post_forward_mesh_info``,
``FSDPParam.to_sharded_post_forward`` / ``to_unsharded``): after forward each non-root unit keeps
a 1/k slice of its unsharded parameters; backward all-gathers them within groups of k ranks."""

import pytest
from simtest import make_profile, make_scenario

from sim.core.events import MemoryCategory, OpKind
from sim.core.topology import GroupKind
from sim.costs.nccl import runtime_channels
from sim.errors import UserError
from sim.outputs.report import build_report, communicator_channels
from sim.simulate import job_topology, scenario_network, simulate
from sim.workload.units import ROOT

MODEL = {"preset": "tiny", "n_layers": 3}
BF16 = {"param_dtype": "bf16", "reduce_dtype": "fp32"}


def _run(k, world=4, overlap=False, **parallel):
    s = make_scenario(
        model=MODEL,
        parallel={"world_size": world, "reshard_after_forward": k, **parallel},
        precision=BF16,
        simulation={"slow_rank": 1, "slow_rank_factor": 1.5},  # every rank simulated, skewed
    )
    return simulate(s, make_profile(overlap=overlap))


def _sorted(r, rank=0):
    return sorted(r.events.ops_of(rank), key=lambda o: (o.start_s, o.op_id))


def test_the_post_forward_slice_is_one_kth_of_the_unsharded_parameters_in_param_dtype():
    r = _run(2)
    units = [u for u in r.step.units if not u.is_root]
    records = [m for m in r.events.memory_of(0) if m.label.startswith("post_forward_params")]
    allocs = [m for m in records if m.delta_bytes > 0]
    # one slice per non-root unit, padded_numel(4) bf16 elements over k = 2
    assert sorted(m.delta_bytes for m in allocs) == sorted(u.padded_numel(4) * 2 // 2 for u in units)
    assert {m.category for m in allocs} == {MemoryCategory.PARAMS}
    ops = _sorted(r)
    for u in units:
        reshard = [o for o in ops if o.name == f"reshard to 2 ranks {u.name}"]
        assert len(reshard) == 1 and reshard[0].kind is OpKind.COPY
        last_forward = max(o.end_s for o in ops if o.kind is OpKind.FORWARD and o.unit == u.name)
        assert reshard[0].start_s >= last_forward
        # the slice lives from the reshard until the backward copy-out (to_unsharded)
        copy_outs = [o for o in ops if o.name == f"all_gather copy-out {u.name}"]
        slice_frees = [
            m
            for m in r.events.memory_of(0)
            if m.delta_bytes < 0 and m.label.startswith(f"post_forward_params:{u.name}:")
        ]
        assert len(copy_outs) == 2 and len(slice_frees) == 1
        assert slice_frees[0].time_s == pytest.approx(copy_outs[1].end_s)


def test_backward_all_gathers_run_within_groups_of_k_ranks_from_the_slice():
    r = _run(2)
    ags = [op for op in r.program.ops if op.kind is OpKind.ALL_GATHER]
    non_root = [u for u in r.step.units if not u.is_root]
    forward = [op for op in ags if op.group is GroupKind.SHARD]
    backward = [op for op in ags if op.group is GroupKind.POST_FORWARD]
    assert sorted(op.unit for op in forward) == sorted([ROOT] + [u.name for u in non_root])
    assert sorted(op.unit for op in backward) == sorted(u.name for u in non_root)
    sizes = {u.name: u.padded_numel(4) * 2 for u in r.step.units}
    for op in backward:  # the whole unsharded unit comes back, 1/k of it from each rank
        assert op.bytes == sizes[op.unit]
    topology = job_topology(r.scenario)
    assert [topology.members(GroupKind.POST_FORWARD, rank) for rank in range(4)] == [
        (0, 1),
        (0, 1),
        (2, 3),
        (2, 3),
    ]
    backward_ids = {op.op_id for op in backward}
    for op_id in backward_ids:  # a collective never ends before the last rank of its group arrives
        records = [o for o in r.events.ops if o.op_id == op_id]
        assert sorted(o.rank for o in records) == [0, 1, 2, 3]
        assert {o.group_size for o in records} == {2}
        for group in ((0, 1), (2, 3)):
            members = [o for o in records if o.rank in group]
            assert len({o.end_s for o in members}) == 1
            assert members[0].end_s >= max(o.ready_s for o in members) + min(o.duration_s for o in members)
    # the copy-in of a backward all-gather reads the slice (already param_dtype): no cast buffer
    cast = [m for m in r.events.memory_of(0) if m.label.startswith("all_gather_input") and m.delta_bytes > 0]
    assert len(cast) == 1 + len(non_root)  # forward only (root and every unit)


def test_a_group_of_k_does_not_wait_for_a_slow_rank_outside_it():
    """Rank 1 is slow: the backward all-gather of ranks 2 and 3 (their own group) does not wait
    for it, while ranks 0 and 1 end theirs together."""
    r = _run(2)
    first_bw = {}
    for o in r.events.ops:
        if o.kind is OpKind.ALL_GATHER and o.group_size == 2:
            first_bw.setdefault(o.rank, o)
    assert first_bw[0].end_s == first_bw[1].end_s
    assert first_bw[2].end_s == first_bw[3].end_s
    assert first_bw[2].end_s < first_bw[1].end_s


@pytest.mark.parametrize(("k", "same_as"), [(1, False), (4, True)])
def test_k_of_one_is_false_and_k_of_the_shard_group_is_true(k, same_as):
    """``_get_post_forward_mesh_info``: 1 means False (with a warning), the shard size True."""
    a, b = _run(k), _run(same_as)
    key = lambda r: [(o.rank, o.kind, o.name, o.start_s, o.end_s) for o in r.events.ops]  # noqa: E731
    assert key(a) == key(b)
    assert build_report(a).peak_memory_bytes == build_report(b).peak_memory_bytes


def test_hsdp_reshards_to_consecutive_blocks_of_k_inside_the_shard_group():
    r = _run(2, world=8, strategy="HYBRID_SHARD", shard_group_size=4)
    topology = job_topology(r.scenario)
    assert topology.members(GroupKind.POST_FORWARD, 5) == (4, 5)
    assert topology.members(GroupKind.SHARD, 5) == (4, 5, 6, 7)
    assert any(op.group is GroupKind.POST_FORWARD for op in r.program.ops)


def test_every_unit_gets_its_own_post_forward_communicator():
    """``fully_shard`` builds a post-forward ``DeviceMesh`` per call: one more communicator of k
    ranks per non-root unit (NCCL initialises it at its first collective: the replicate dimension
    of that mesh never runs one)."""
    on, off = _run(2, overlap=True), _run(True, overlap=True)
    network = scenario_network(on.scenario, on.profile)
    assert network is not None
    pair = runtime_channels(network.fabric((0, 1)))
    units = sum(1 for u in on.step.units if not u.is_root)
    assert communicator_channels(on, 0) == communicator_channels(off, 0) + units * pair


def test_holding_slices_raises_the_peak_by_at_most_the_slices():
    on, off = _run(2), _run(True)
    slices = sum(u.padded_numel(4) * 2 // 2 for u in on.step.units if not u.is_root)
    rise = build_report(on).peak_memory_bytes - build_report(off).peak_memory_bytes
    assert 0 < rise <= slices


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (
            {"fsdp_version": 1, "reshard_after_forward": 2},
            "parallel.reshard_after_forward = 2: an integer is FSDP2's",
        ),
        (
            {"strategy": "NO_SHARD", "reshard_after_forward": 2},
            "parallel.reshard_after_forward = 2: an integer is FSDP2's",
        ),
        (
            {"reshard_after_forward": 3},
            "must be true, false or an integer that divides the shard group size (4)",
        ),
    ],
)
def test_integers_fsdp2_cannot_take_are_refused(parallel, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_scenario(model=MODEL, parallel={"world_size": 4, **parallel})


@pytest.mark.parametrize("k", [2, 4])
def test_peak_memory_agrees_with_real_fsdp2_under_the_fake_process_group(k):
    """``fully_shard(..., reshard_after_forward=k)`` for one rank of 8 (tiny, bf16 with fp32
    reduce): the post-forward meshes are FSDP2's own, built outside the fake mode."""
    from validation.memory_only import validate_memory_only

    tiny = "scenarios/tiny.toml"
    sets = [
        "parallel.world_size=8",
        f"parallel.reshard_after_forward={k}",
        *(f"precision.{d}" for d in BF16_SETS),
    ]
    comparison, measured = validate_memory_only(tiny, sets, timeout_s=300)
    peak = next(r for r in comparison.rows if r.metric == "peak memory")
    assert measured["world_size"] == 8
    assert abs(peak.predicted / peak.measured - 1) < 0.005  # the slices alone are 4.5 % of it (k = 2)


BF16_SETS = ("param_dtype=bf16", "reduce_dtype=fp32")
