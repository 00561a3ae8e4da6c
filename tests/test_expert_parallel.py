"""Expert parallelism (``parallel.expert_parallel = E``): the experts split over groups of E ranks,
the token all-to-all in forward and backward, the experts' FSDP2 group of world / E ranks, the
all-to-all's cost model and its calibration through torch.distributed (2 gloo processes)."""

import subprocess
import sys
from pathlib import Path

import pytest
from simtest import outside_rank_env

from sim.core.events import OpKind, Stream
from sim.core.topology import GroupKind
from sim.costs.all_to_all import all_to_all_latency_s, all_to_all_time_s
from sim.costs.collectives import collective_cost
from sim.errors import UserError
from sim.hardware.registry import load_profile
from sim.outputs.chrome_trace import TraceNames, trace_document
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.schedule.model_state import model_state
from sim.simulate import job_topology, scenario_network, simulate
from sim.workload.expert_parallel import expert_padded_numel
from sim.workload.params import ParamSpec

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "hf"
TOKENS, TOP_K, HIDDEN, EXPERTS = 2 * 128, 2, 128, 4  # tiny-mixtral at micro-batch 2 x 128


@pytest.fixture(scope="module")
def scenario_path(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("ep")
    (tmp / "config.json").write_text((DATA / "tiny-mixtral.json").read_text())
    path = tmp / "s.toml"
    path.write_text(
        '[model]\nconfig = "config.json"\n[training]\nmicro_batch = 2\nseq_len = 128\n'
        "[parallel]\nworld_size = 4\nexpert_parallel = 2\n"
        '[precision]\nparam_dtype = "bf16"\nreduce_dtype = "fp32"\n'
        "[simulation]\nslow_rank = 1\nslow_rank_factor = 1.5\n"
    )
    return path


def _run(path, *sets):
    return simulate(load_scenario(path, list(sets)))


def _sorted(r, rank=0):
    return sorted(r.events.ops_of(rank), key=lambda o: (o.start_s, o.op_id))


def test_each_moe_layer_exchanges_tokens_four_times_with_exact_bytes(scenario_path) -> None:
    r = _run(scenario_path)
    a2a = [op for op in r.program.ops if op.kind is OpKind.ALL_TO_ALL]
    per_row = TOKENS * TOP_K * HIDDEN * 2  # every (token, chosen expert) row, bf16
    assert {op.bytes for op in a2a} == {per_row}
    assert {op.stream for op in a2a} == {Stream.ALL_TO_ALL} and {op.group for op in a2a} == {GroupKind.EXPERT}
    names = [op.name.rsplit(" ", 1)[0] for op in a2a]
    layers = sorted({op.unit for op in a2a})
    assert layers == ["model.layers.0", "model.layers.1"]
    assert names.count("all_to_all dispatch") == names.count("all_to_all combine") == 2
    assert names.count("all_to_all combine backward") == names.count("all_to_all dispatch backward") == 2
    report = build_report(r).to_json()
    assert report["collectives"]["all_to_all"] == {
        "count": 8,
        "bytes": 8 * per_row,
        "time_s": pytest.approx(report["collectives"]["all_to_all"]["time_s"]),
    }


def test_the_experts_wait_for_the_dispatch_and_the_next_op_for_the_combine(scenario_path) -> None:
    r = _run(scenario_path)
    for rank in range(4):
        ops = _sorted(r, rank)
        for o in [o for o in ops if o.kind is OpKind.ALL_TO_ALL]:
            before = [c for c in ops if c.stream is Stream.COMPUTE and c.end_s <= o.start_s]
            after = next(c for c in ops if c.stream is Stream.COMPUTE and c.start_s >= o.end_s)
            assert before, o.name
            if " backward " not in o.name and "dispatch" in o.name:  # the experts run on what arrived
                assert after.kind is OpKind.FORWARD and ".mlp.experts" in after.name
            if o.name.startswith("all_to_all combine backward"):
                assert after.kind is OpKind.BACKWARD and ".mlp.experts" in after.name
            # nothing on the compute stream overlaps the exchange: the experts need its rows
            assert not [c for c in ops if c.stream is Stream.COMPUTE and o.start_s < c.start_s < o.end_s]


def test_an_all_to_all_never_ends_before_the_last_rank_of_its_group_arrives(scenario_path) -> None:
    r = _run(scenario_path)
    topology = job_topology(r.scenario)
    assert [topology.members(GroupKind.EXPERT, k) for k in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [topology.members(GroupKind.EXPERT_SHARD, k) for k in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    ids = {op.op_id for op in r.program.ops if op.kind is OpKind.ALL_TO_ALL}
    for op_id in ids:
        records = [o for o in r.events.ops if o.op_id == op_id]
        for group in ((0, 1), (2, 3)):
            members = [o for o in records if o.rank in group]
            assert len({o.end_s for o in members}) == 1 and {o.group_size for o in members} == {2}
            assert members[0].end_s >= max(o.ready_s for o in members) + min(o.duration_s for o in members)
    # the slow rank 1 delays its own group's exchanges, not those of ranks 2 and 3
    first = {k: next(o for o in _sorted(r, k) if o.kind is OpKind.ALL_TO_ALL) for k in range(4)}
    assert first[0].end_s == first[1].end_s > first[2].end_s == first[3].end_s


def test_experts_gather_their_local_half_over_the_ranks_holding_them(scenario_path) -> None:
    ep, plain = _run(scenario_path), _run(scenario_path, "parallel.expert_parallel=1")
    # per layer: gate_up (4, 512, 128) and down (4, 128, 256); each rank holds 2 of the 4 experts
    local_expert_elems = (4 * 512 * 128 + 4 * 128 * 256) // 2
    ags = [op for op in ep.program.ops if op.kind is OpKind.ALL_GATHER]
    expert_ags = [op for op in ags if op.name.endswith("#experts")]
    assert {op.bytes for op in expert_ags} == {local_expert_elems * 2}
    assert {op.group for op in expert_ags} == {GroupKind.EXPERT_SHARD}
    assert {op.group for op in ags if op not in expert_ags} == {GroupKind.SHARD}
    dense = {op.unit: op.bytes for op in ags if op not in expert_ags}
    plain_bytes = {op.unit: op.bytes for op in plain.program.ops if op.kind is OpKind.ALL_GATHER}
    for unit, nbytes in dense.items():  # the block's dense part: its all-gather without the experts
        extra = 2 * local_expert_elems * 2 if unit.startswith("model.layers") else 0
        assert nbytes + extra == plain_bytes[unit]
    rs = [op for op in ep.program.ops if op.kind is OpKind.REDUCE_SCATTER and op.name.endswith("#experts")]
    assert {op.bytes for op in rs} == {local_expert_elems * 4}  # fp32 reduce
    # each rank ends up holding 1/world of every expert either way (no padding here)
    assert model_state(ep.step) == model_state(plain.step)
    assert build_report(ep).to_json()["n_params"] == build_report(plain).to_json()["n_params"]


def test_flops_follow_the_experts_a_rank_holds(scenario_path) -> None:
    """Balanced routing: 2 of 4 experts, each with twice the rows, in larger matmuls."""
    ep, plain = _run(scenario_path), _run(scenario_path, "parallel.expert_parallel=1")
    assert sum(op.flops for op in ep.layer_ops) == sum(op.flops for op in plain.layer_ops)
    by_name = {op.name: op for op in plain.layer_ops}
    experts = [op for op in ep.layer_ops if op.kind.value == "experts"]
    assert experts
    for op in experts:
        (m, n, k, count), (m0, n0, k0, count0) = op.grouped_gemms[0], by_name[op.name].grouped_gemms[0]
        assert (m, n, k, count) == (2 * m0, n0, k0, count0 // 2) and m0 == TOKENS * TOP_K // EXPERTS


def test_the_exchange_has_its_own_lane_in_the_trace(scenario_path) -> None:
    r = _run(scenario_path)
    doc = trace_document(r.events, [0], TraceNames())
    a2a = [e for e in doc["traceEvents"] if e.get("name") == "ncclDevKernel_SendRecv"]
    assert len(a2a) == 8 and {e["tid"] for e in a2a} == {44}
    lanes = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert any("all_to_all" in lane for lane in lanes)


def test_shard_one_when_the_world_exceeds_the_experts() -> None:
    """torchtitan ``apply_fsdp``: Shard(1) when efsdp · ep > num_experts (no dim-0 padding)."""
    p = ParamSpec(name="model.layers.0.mlp.experts.down_proj", shape=(2, 6, 5))  # 2 local of 4 experts
    assert expert_padded_numel(p, 4, world_size=4, experts=4) == 4 * 6 * 5  # Shard(0): 2 rows -> 4
    assert expert_padded_numel(p, 4, world_size=8, experts=4) == 2 * 8 * 5  # Shard(1): 6 -> 8


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["parallel.expert_parallel=3"], "must divide parallel.world_size (4) and the experts per layer (4)"),
        (["parallel.expert_parallel=0"], "must be >= 1"),
        (["parallel.fsdp_version=1"], "is modelled under FSDP2 only"),
        (["parallel.strategy=HYBRID_SHARD", "parallel.shard_group_size=2"], "not HYBRID_SHARD"),
        (["parallel.wrap=linear"], 'parallel.wrap = "block"'),
        (["parallel.cpu_offload=true"], "is not modelled with parallel.cpu_offload"),
        (["checkpointing.mode=selective"], "is not modelled with op-level selective checkpointing"),
        (["parallel.reshard_after_forward=2"], "integer parallel.reshard_after_forward"),
    ],
)
def test_what_is_not_modelled_is_refused_in_one_line(scenario_path, sets, message) -> None:
    with pytest.raises(UserError, match="parallel.expert_parallel") as e:
        load_scenario(scenario_path, sets)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_dense_model_is_refused() -> None:
    from simtest import make_scenario

    with pytest.raises(UserError, match="needs a model with experts"):
        make_scenario(parallel={"world_size": 2, "expert_parallel": 2})


def test_nccl_all_to_all_cost_from_the_links(scenario_path) -> None:
    """One node: S·(r−1)/n over NVLink; two nodes: the NIC share bounds it; busbw never beats a link."""
    r = _run(scenario_path, "parallel.world_size=16", "parallel.expert_parallel=4", "cluster.gpus_per_node=8")
    network = scenario_network(r.scenario, r.profile)
    assert network is not None
    size = 64 << 20
    one_node = network.fabric(tuple(range(8)))
    t, lat = all_to_all_time_s(size, one_node)
    assert one_node.nvlink_bw_Bps is not None
    assert t == pytest.approx(lat + size * 7 / 8 / one_node.nvlink_bw_Bps)
    assert lat == all_to_all_latency_s(one_node)
    two_nodes = network.fabric(tuple(range(16)))
    t2, lat2 = all_to_all_time_s(size, two_nodes)
    nic_share = two_nodes.nics_per_node * two_nodes.nic_bw_Bps * two_nodes.network_share / 8
    assert t2 == pytest.approx(lat2 + size * 8 / 16 / nic_share)
    # no link beats its bandwidth: the bytes each one carries over the time
    assert size * 7 / 8 / t <= one_node.nvlink_bw_Bps
    assert size * 7 / 16 / t2 <= one_node.nvlink_bw_Bps and size * 8 / 16 / t2 <= nic_share
    cost = collective_cost(
        "all_to_all", size, job_topology(r.scenario).shape(GroupKind.EXPERT), "bf16", r.profile
    )
    assert cost.time_s > 0


def test_calibrate_comm_measures_the_all_to_all_through_torch_distributed(tmp_path: Path) -> None:
    """Two gloo processes: ``all_to_all_single`` timed and checked element by element; the
    simulator then prices its all-to-alls from the measured curve."""
    out = tmp_path / "a2a.json"
    env = outside_rank_env()
    args = ["--max-bytes", "16K", "--iters", "3", "--max-iters", "3", "--warmup", "1", "--dtypes", "bf16"]
    proc = subprocess.run(
        [sys.executable, "-m", "calibrate", "comm", "--nproc", "2", "--out", str(out), *args]
        + ["--collectives", "all_to_all"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "#wrong 0" in proc.stdout
    prof = load_profile(str(out))
    assert [(c.collective, c.group_size, c.dtype) for c in prof.collectives] == [("all_to_all", 2, "bf16")]
    from sim.core.topology import GroupShape

    cost = collective_cost("all_to_all", 4096, GroupShape(size=2, spans_nodes=False), "bf16", prof)
    assert cost.algorithm == "measured" and cost.time_s > 0


def test_the_tuners_bounds_hold_under_expert_parallelism(scenario_path) -> None:
    from sim.study.tune.bounds import memory_lower_bound_bytes, step_time_lower_bound_s

    for sets in ([], ["parallel.world_size=8", "parallel.expert_parallel=4"]):
        r = _run(scenario_path, *sets)
        report = build_report(r)
        assert memory_lower_bound_bytes(r.step) <= report.peak_memory_bytes
        assert step_time_lower_bound_s(r.step) <= report.step_time_s


def test_a_checkpointed_block_exchanges_its_tokens_again_when_recomputed(scenario_path) -> None:
    """Full checkpointing reruns the block's forward before its backward, all-to-alls included:
    six per MoE layer, the recompute's dispatch before the experts' recompute, its combine after."""
    r = _run(scenario_path, "checkpointing.mode=full")
    a2a = [op for op in r.program.ops if op.kind is OpKind.ALL_TO_ALL]
    assert len(a2a) == 6 * 2 and {op.bytes for op in a2a} == {TOKENS * TOP_K * HIDDEN * 2}
    ops = _sorted(r)
    for layer in ("model.layers.0", "model.layers.1"):
        names = [o.name for o in ops if o.kind is OpKind.ALL_TO_ALL and o.unit == layer]
        assert names == [
            f"all_to_all {what} {layer}"
            for what in (
                "dispatch",
                "combine",
                "dispatch recompute",
                "combine recompute",
                "combine backward",
                "dispatch backward",
            )
        ]
        dispatch = next(o for o in ops if o.name == f"all_to_all dispatch recompute {layer}")
        experts = next(
            o for o in ops if o.kind is OpKind.RECOMPUTE and o.unit == layer and ".mlp.experts" in o.name
        )
        assert experts.start_s >= dispatch.end_s
    assert build_report(r).peak_memory_bytes < build_report(_run(scenario_path)).peak_memory_bytes
