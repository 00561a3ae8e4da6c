"""The FSDP2 and DDP schedules: what is issued, in which order, and how many bytes it moves."""

from dataclasses import replace

import pytest
from simtest import make_profile, make_scenario

from sim.core.events import OpKind, Stream
from sim.costs.collectives import wire_bytes_per_rank
from sim.outputs.report import build_report
from sim.simulate import simulate
from sim.workload.units import ROOT

ONE_LAYER = {"preset": "tiny", "n_layers": 1}


def _names(result, rank=0):
    return [
        (o.kind.value, o.unit) for o in sorted(result.events.ops_of(rank), key=lambda o: (o.start_s, o.op_id))
    ]


def test_exact_event_log_two_units_two_ranks_serial_backend():
    """gloo-like backend: every op runs one after another in FSDP2's host order."""
    s = make_scenario(model=ONE_LAYER)
    r = simulate(s, make_profile(overlap=False))
    layer = "model.layers.0"
    expected = [
        ("all_gather", ROOT),
        ("copy", ROOT),
        ("forward", ROOT),
        ("all_gather", layer),
        ("copy", layer),
        ("forward", layer),
        ("forward", ROOT),
        # root pre-backward prefetches the unit that ran before it in forward
        ("all_gather", layer),
        ("backward", ROOT),
        ("copy", layer),
        ("backward", layer),
        ("copy", layer),
        ("reduce_scatter", layer),
        ("backward", ROOT),
        # final callback: the root (whose input is the token ids) reduces last
        ("copy", ROOT),
        ("reduce_scatter", ROOT),
        ("optimizer", ROOT),
    ]
    assert [len(r.step.units)] == [2]
    for rank in (0, 1):
        ops = sorted(r.events.ops_of(rank), key=lambda o: o.start_s)
        assert [(o.kind.value, o.unit) for o in ops] == expected
        for before, after in zip(ops, ops[1:], strict=False):
            assert after.start_s == pytest.approx(before.end_s, abs=1e-15)
    assert r.events.simulated_ranks == (0,)


def test_gpu_backend_overlaps_next_all_gather_with_compute():
    s = make_scenario(model={"preset": "tiny", "n_layers": 3})
    r = simulate(s, make_profile(overlap=True))
    ops = r.events.ops_of(0)
    forward_ags = [o for o in ops if o.kind is OpKind.ALL_GATHER and o.microbatch == 0][:4]
    assert [o.unit for o in forward_ags] == [ROOT, "model.layers.0", "model.layers.1", "model.layers.2"]
    # the all-gather of layer 1 runs before layer 0's forward has finished
    fwd0 = next(o for o in ops if o.kind is OpKind.FORWARD and o.unit == "model.layers.0")
    assert forward_ags[2].start_s < fwd0.end_s
    # streams are FIFO: no two ops of one stream overlap
    for stream in Stream:
        lane = sorted((o for o in ops if o.stream is stream), key=lambda o: o.start_s)
        assert all(b.start_s >= a.end_s - 1e-15 for a, b in zip(lane, lane[1:], strict=False))


def _unit_bytes(result, dtype_bytes):
    w = result.step.shard_size
    non_root = sum(u.padded_numel(w) for u in result.step.units if not u.is_root) * dtype_bytes
    root = next(u for u in result.step.units if u.is_root).padded_numel(w) * dtype_bytes
    return non_root, root


@pytest.mark.parametrize("strategy, gathers", [("FULL_SHARD", 2), ("SHARD_GRAD_OP", 1)])
def test_all_gather_bytes_per_step(strategy, gathers):
    """FULL_SHARD gathers every non-root unit in forward and again in backward; ZeRO-2 once.
    The root stays unsharded after forward (FSDP2's reshard_after_forward=None)."""
    k = 8
    s = make_scenario(
        model={"preset": "llama2-7b"},
        training={"micro_batch": 1, "seq_len": 512},
        parallel={"world_size": k, "strategy": strategy},
        precision={"param_dtype": "bf16"},
    )
    r = simulate(s)
    non_root, root = _unit_bytes(r, 2)
    ags = [o for o in r.events.ops_of(0) if o.kind is OpKind.ALL_GATHER]
    assert sum(o.bytes for o in ags) == gathers * non_root + root
    assert len(ags) == gathers * 32 + 1
    wire = sum(wire_bytes_per_rank("all_gather", o.bytes, o.group_size) for o in ags)
    assert wire == pytest.approx((gathers * non_root + root) * (k - 1) / k, rel=1e-12)
    rs = [o for o in r.events.ops_of(0) if o.kind is OpKind.REDUCE_SCATTER]
    assert len(rs) == 33
    assert sum(o.bytes for o in rs) == sum(u.padded_numel(k) for u in r.step.units) * 2  # reduce in bf16


def test_reduce_dtype_sets_reduce_scatter_bytes():
    s = make_scenario(precision={"param_dtype": "bf16", "reduce_dtype": "fp32"})
    r = simulate(s)
    total = sum(u.padded_numel(2) for u in r.step.units)
    rs = [o for o in r.events.ops_of(0) if o.kind is OpKind.REDUCE_SCATTER]
    assert sum(o.bytes for o in rs) == total * 4


def test_hybrid_shard_all_reduces_shards_across_replicas():
    s = make_scenario(
        parallel={"world_size": 8, "strategy": "HYBRID_SHARD", "shard_group_size": 4},
        cluster={"gpus_per_node": 4},
    )
    r = simulate(s)
    ops = r.events.ops_of(0)
    rs = [o for o in ops if o.kind is OpKind.REDUCE_SCATTER]
    ar = [o for o in ops if o.kind is OpKind.ALL_REDUCE]
    assert {o.group_size for o in rs} == {4} and {o.group_size for o in ar} == {2}
    assert [o.bytes // 4 for o in rs] == [o.bytes for o in ar]  # the all-reduce moves the 1/4 shard
    for a in ar:  # each all-reduce follows its unit's reduce-scatter
        mine = next(o for o in rs if o.unit == a.unit)
        assert a.start_s >= mine.end_s


def test_ddp_all_reduces_every_gradient_once_in_buckets():
    s = make_scenario(parallel={"world_size": 4, "strategy": "NO_SHARD", "ddp_bucket_mb": 0.05})
    r = simulate(s)
    ops = r.events.ops_of(0)
    assert not [o for o in ops if o.kind in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER)]
    ar = [o for o in ops if o.kind is OpKind.ALL_REDUCE]
    assert len(ar) > 1
    assert sum(o.bytes for o in ar) == build_report(r).to_json()["n_params"] * 4
    first_backward_end = min(o.end_s for o in ops if o.kind is OpKind.BACKWARD)
    last_backward_end = max(o.end_s for o in ops if o.kind is OpKind.BACKWARD)
    assert ar[0].start_s >= first_backward_end
    assert ar[0].start_s < last_backward_end  # buckets overlap the rest of backward


def test_backward_prefetch_reduces_exposed_communication_when_comm_is_slow():
    base = {
        "model": {"preset": "llama2-7b", "n_layers": 4},
        "training": {"micro_batch": 1, "seq_len": 4096},
        "parallel": {"world_size": 8},
        "precision": {"param_dtype": "bf16"},
        "cluster": {"nvlink_factor": 0.1},  # NVLink at a tenth of its rate
    }
    slow_links = make_profile()
    with_prefetch = build_report(simulate(make_scenario(**base), slow_links)).to_json()
    # premise: gathering the weights takes longer than computing with them
    assert with_prefetch["collectives"]["all_gather"]["time_s"] > with_prefetch["breakdown_s"]["compute"]
    base["parallel"] = {"world_size": 8, "backward_prefetch": 0}
    without = build_report(simulate(make_scenario(**base), slow_links)).to_json()
    assert without["breakdown_s"]["exposed_comm"] > with_prefetch["breakdown_s"]["exposed_comm"] * 1.2
    assert without["step_time_s"] > with_prefetch["step_time_s"]


def test_no_reshard_after_forward_drops_backward_all_gathers_and_keeps_params():
    base = {"model": {"preset": "tiny", "n_layers": 4}, "parallel": {"world_size": 2}}
    resharded = simulate(make_scenario(**base))
    base["parallel"] = {"world_size": 2, "reshard_after_forward": False}
    kept = simulate(make_scenario(**base))
    count = lambda r: sum(o.kind is OpKind.ALL_GATHER for o in r.events.ops_of(0))  # noqa: E731
    assert count(resharded) == 1 + 2 * 4 and count(kept) == 1 + 4
    layer_bytes = [u.padded_numel(2) * 4 for u in kept.step.units if not u.is_root]
    rise = build_report(kept).peak_memory_bytes - build_report(resharded).peak_memory_bytes
    # at the peak the resharded run holds at most two gathered layers; the other run holds all
    assert sum(layer_bytes) - 2 * max(layer_bytes) <= rise <= sum(layer_bytes)


def test_checkpointing_recomputes_each_block_and_saves_less():
    plain = simulate(make_scenario(model={"preset": "tiny", "n_layers": 4}))
    ckpt = simulate(make_scenario(model={"preset": "tiny", "n_layers": 4}, checkpointing={"mode": "full"}))
    recomputes = [o for o in ckpt.events.ops_of(0) if o.kind is OpKind.RECOMPUTE]
    assert sorted({o.unit for o in recomputes}) == [f"model.layers.{i}" for i in range(4)]
    ckpt_report, plain_report = build_report(ckpt).to_json(), build_report(plain).to_json()
    assert (
        ckpt_report["memory_at_peak_bytes"]["activations"]
        < plain_report["memory_at_peak_bytes"]["activations"]
    )
    assert ckpt_report["breakdown_s"]["compute"] > plain_report["breakdown_s"]["compute"]


def test_grad_accumulation_runs_every_microbatch_and_one_optimizer_step():
    r = simulate(make_scenario(training={"micro_batch": 1, "seq_len": 32, "grad_accum": 3}))
    ops = r.events.ops_of(0)
    assert {o.microbatch for o in ops if o.kind is OpKind.FORWARD} == {0, 1, 2}
    assert sum(o.kind is OpKind.OPTIMIZER for o in ops) == 1
    assert sum(o.kind is OpKind.REDUCE_SCATTER for o in ops) == 3 * len(r.step.units)
    assert build_report(r).to_json()["tokens_per_step"] == 1 * 32 * 3 * 2


def test_linear_wrap_issues_two_collectives_per_linear():
    r = simulate(make_scenario(model=ONE_LAYER, parallel={"world_size": 2, "wrap": "linear"}))
    names = [u.name for u in r.step.units]
    assert len(names) == 1 + 7 + 1 + 1  # embedding, 7 projections, lm_head, root (norms)
    ags = [o for o in r.events.ops_of(0) if o.kind is OpKind.ALL_GATHER]
    # the embedding unit reshards after forward like any non-root unit and is gathered again in
    # backward; only the root stays gathered
    assert len(ags) == 1 + 2 * 9


def test_ddp_checkpointing_recomputes_each_block_and_keeps_only_block_inputs():
    base = {"model": {"preset": "tiny", "n_layers": 3}, "parallel": {"world_size": 2, "strategy": "NO_SHARD"}}
    plain = simulate(make_scenario(**base))
    ckpt = simulate(make_scenario(**base, checkpointing={"mode": "full"}))
    recomputed = [o.unit for o in ckpt.events.ops_of(0) if o.kind is OpKind.RECOMPUTE]
    assert sorted(set(recomputed)) == [f"model.layers.{i}" for i in range(3)]
    block_inputs = [
        m for m in ckpt.events.memory_of(0) if m.label.startswith("block_input") and m.delta_bytes > 0
    ]
    assert len(block_inputs) == 3 and all(m.delta_bytes == 2 * 64 * 64 * 4 for m in block_inputs)
    ckpt_report, plain_report = build_report(ckpt).to_json(), build_report(plain).to_json()
    assert (
        ckpt_report["memory_at_peak_bytes"]["activations"]
        < plain_report["memory_at_peak_bytes"]["activations"]
    )
    assert ckpt_report["step_time_s"] > plain_report["step_time_s"]


def _max_live(result, prefix):
    live = best = 0
    for m in sorted(result.events.memory_of(0), key=lambda m: (m.time_s, m.delta_bytes)):
        if m.label.startswith(prefix):
            live += 1 if m.delta_bytes > 0 else -1
            best = max(best, live)
    return best


@pytest.mark.parametrize("prefetch, limit", [(0, 2), (1, 2), (2, 3)])
def test_all_gathers_in_flight_are_limited_by_the_copy_out_chain(prefetch, limit):
    """FSDP2's implicit rate limit as the caching allocator counts it: a forward all-gather output
    lives until the next unit's copy-out (``wait_for_unshard`` drops ``all_gather_state``), and the
    host allocates the next unit's output after that, in host order. With compute far slower than
    communication the outputs of the running unit and of the next one are allocated at once,
    however many layers there are; explicit forward prefetch of 2 lets one more run ahead."""
    s = make_scenario(
        model={"preset": "llama2-7b", "n_layers": 8},
        training={"micro_batch": 4, "seq_len": 4096},
        parallel={"world_size": 8, "forward_prefetch": prefetch},
        precision={"param_dtype": "bf16"},
    )
    r = simulate(replace(s, cluster=replace(s.cluster, nvlink_factor=14.0)), make_profile())  # ~5 TB/s
    report = build_report(r).to_json()
    assert report["collectives"]["all_gather"]["time_s"] < 0.1 * report["breakdown_s"]["compute"]
    assert _max_live(r, "all_gather_output") == limit


@pytest.mark.parametrize(
    ("parallel", "all_reduces"),
    [
        ({"world_size": 1, "strategy": "FULL_SHARD"}, 0),
        ({"world_size": 2, "strategy": "HYBRID_SHARD", "shard_group_size": 1}, 2),
    ],
)
def test_a_one_rank_shard_group_copies_instead_of_gathering_and_scattering(parallel, all_reduces):
    """FSDP2 skips both collectives when the shard group has one rank (world_size == 1 paths of
    _fsdp_param_group.wait_for_unshard and foreach_reduce): each unshard is one copy, each
    reduction a copy-in and a copy into the output."""
    s = make_scenario(model=ONE_LAYER, parallel=parallel, cluster={"gpus_per_node": 1})
    r = simulate(s, make_profile(overlap=False))
    ops = sorted(r.events.ops_of(0), key=lambda o: (o.start_s, o.op_id))
    kinds = [o.kind for o in ops]
    assert OpKind.ALL_GATHER not in kinds and OpKind.REDUCE_SCATTER not in kinds
    assert len([o for o in ops if o.kind is OpKind.ALL_REDUCE]) == all_reduces
    unshards = [o for o in ops if o.name.startswith("unshard copy")]
    assert [o.unit for o in unshards] == [ROOT, "model.layers.0", "model.layers.0"]  # forward x2, backward x1
    reduces = [o for o in ops if o.name.startswith("reduce copy")]
    assert sorted(o.unit for o in reduces) == sorted([ROOT, "model.layers.0"])
    for red in reduces:  # each reduction copies after its unit's copy-in
        copy_in = next(o for o in ops if o.name == f"reduce_scatter copy-in {red.unit}")
        assert red.start_s >= copy_in.end_s
    # nothing is staged for a collective that does not run: only the reduce-scatter inputs
    # (and, for HSDP, nothing else) are communication buffers
    labels = {m.label.split(":")[0] for m in r.events.memory_of(0) if m.category.value == "comm_buffers"}
    assert labels == {"reduce_scatter_input"}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD", "NO_SHARD"])
def test_accumulation_without_sync_reduces_once_per_step(strategy):
    """``training.sync_every_microbatch = false``: one reduction per unit (DDP: per bucket) per
    optimizer step, on the last micro-batch, instead of one per micro-batch; FSDP2 keeps each
    unit's unsharded gradients (in reduce_dtype) until then, so the step holds more memory."""
    parallel = {"world_size": 4, "strategy": strategy}
    if strategy == "HYBRID_SHARD":
        parallel["shard_group_size"] = 2
    kwargs = dict(
        model={"preset": "tiny"},
        training={"grad_accum": 3},
        parallel=parallel,
        precision={"param_dtype": "bf16", "reduce_dtype": "fp32"},
    )
    synced = simulate(make_scenario(**kwargs), make_profile())
    kwargs["training"] = {"grad_accum": 3, "sync_every_microbatch": False}
    unsynced = simulate(make_scenario(**kwargs), make_profile())

    def reductions(r):
        kinds = (OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE)
        return [o for o in r.events.ops if o.rank == 0 and o.kind in kinds]

    assert len(reductions(unsynced)) * 3 == len(reductions(synced))
    assert {o.microbatch for o in reductions(unsynced)} == {2}
    if strategy != "NO_SHARD":
        peak = [build_report(r).peak_memory_bytes for r in (synced, unsynced)]
        assert peak[1] > peak[0]
