"""FSDP2's ``CPUOffloadPolicy`` (``parallel.cpu_offload``, ``sim.schedule.fsdp2_offload``): the
shards' copies to the device before each all-gather, the reduced gradients' copies to the host after
each reduction, the optimizer on the CPU, pinned and pageable host memory, and the CPU machine where
nothing moves."""

import copy

import pytest
from simtest import make_scenario

from sim.core.events import MemoryCategory, OpKind, Stream
from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.parse import profile_from_dict
from sim.outputs.memory_curve import memory_curve
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.simulate import simulate
from sim.workload.model import layer_params, preset

H2D, D2H, PAGEABLE_H2D, PAGEABLE_D2H, ADAMW, SGD = 50e9, 40e9, 10e9, 8e9, 5e-9, 2e-9
TINY_ROOT = 512 * 64 * 2 + 64  # embedding, lm_head, final norm
BLOCK = sum(p.numel for p in layer_params(preset("tiny"), 0))
NUMEL = TINY_ROOT // 2 + 2 * (BLOCK // 2)  # what rank 0 of 2 steps (every tiny dim is even)


def _profile(**node: float):
    data = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    figures = {
        "host_to_device_Bps": H2D,
        "device_to_host_Bps": D2H,
        "pageable_host_to_device_Bps": PAGEABLE_H2D,
        "pageable_device_to_host_Bps": PAGEABLE_D2H,
        "cpu_torch_adamw_s_per_param": ADAMW,
        "cpu_torch_sgd_s_per_param": SGD,
    }
    data["node"].update({**figures, **node})
    return profile_from_dict(data, "fsdp2-offload-test")


def _offload(pin: bool = True, **sections: dict) -> object:
    parallel = {"cpu_offload": True, "cpu_offload_pin_memory": pin, **sections.pop("parallel", {})}
    return make_scenario(parallel=parallel, **sections)


def _ops(r, rank: int = 0):
    return list(r.events.ops_of(rank))


def _copies(r, stream: Stream):
    return [o for o in _ops(r) if o.kind is OpKind.OFFLOAD and o.stream is stream]


def test_every_all_gather_copies_its_fp32_shard_in_and_every_reduction_copies_its_gradient_out() -> None:
    r = simulate(_offload(precision={"param_dtype": "bf16"}), _profile())
    root, block = 4 * (TINY_ROOT // 2), 4 * (BLOCK // 2)
    # the root is gathered once (it stays unsharded), each block in forward and again in backward
    assert sorted(o.bytes for o in _copies(r, Stream.H2D)) == sorted([root] + [block] * 4)
    # the reduced shard is cast back to fp32 on the device, then copied to the host
    assert sorted(o.bytes for o in _copies(r, Stream.D2H)) == sorted([root] + [block] * 2)
    for o in _copies(r, Stream.H2D) + _copies(r, Stream.D2H):
        assert o.duration_s == pytest.approx(o.bytes / (H2D if o.stream is Stream.H2D else D2H))
    report = build_report(r)
    assert report.host_memory_bytes == 16 * NUMEL  # fp32 shard, gradient and AdamW's two states
    assert (report.model_state.params, report.model_state.grads, report.model_state.optimizer) == (0, 0, 0)
    assert report.offload_bytes == {"h2d": root + 4 * block, "d2h": root + 2 * block}


def test_the_device_holds_no_sharded_state_and_the_shard_copies_it_allocates_are_exact() -> None:
    r = simulate(_offload(precision={"param_dtype": "bf16"}), _profile())
    records = r.events.memory_of(0)
    allocated = {m.label.split(":")[0] for m in records if m.delta_bytes > 0}
    assert not {"param", "optim", "sharded_grads", "optimizer_temp"} & allocated
    curve = memory_curve(r.events, 0)
    for category in MemoryCategory:
        assert curve.by_category[category].min() >= 0
    end = curve.at(len(curve.times_s) - 1)
    assert end[MemoryCategory.GRADS] == end[MemoryCategory.OPTIMIZER] == 0
    # bf16 all-gathers: every fp32 shard is cast on the device; the largest one before its cast
    largest = max(p.numel for p in layer_params(preset("tiny"), 0)) // 2
    by_label = {m.label: m.delta_bytes for m in records if m.delta_bytes > 0}
    block = next(k for k in by_label if k.startswith("all_gather_input:model.layers.0"))
    staging = next(k for k in by_label if k.startswith("h2d_staging:model.layers.0"))
    assert (by_label[block], by_label[staging]) == (2 * (BLOCK // 2), 4 * largest)
    fp32 = simulate(_offload(), _profile())
    kept = {
        m.label: m.delta_bytes
        for m in fp32.events.memory_of(0)
        if m.label.startswith("offloaded_shard") and m.delta_bytes > 0
    }
    assert sorted(set(kept.values())) == [4 * (BLOCK // 2), 4 * (TINY_ROOT // 2)]  # no cast: the shard itself


def test_copies_in_precede_their_all_gather_and_copies_out_follow_their_reduction() -> None:
    r = simulate(_offload(precision={"param_dtype": "bf16"}), _profile())
    ops = _ops(r)
    gathers = [o for o in ops if o.kind is OpKind.ALL_GATHER]
    scatters = [o for o in ops if o.kind is OpKind.REDUCE_SCATTER]
    h2d, d2h = _copies(r, Stream.H2D), _copies(r, Stream.D2H)
    assert [o.unit for o in h2d] == [o.unit for o in gathers] and len(d2h) == len(scatters)
    for copy_in, gather in zip(h2d, gathers, strict=True):
        assert copy_in.end_s <= gather.start_s
    for rs, copy_out in zip(scatters, d2h, strict=True):
        assert copy_out.unit == rs.unit and rs.end_s <= copy_out.start_s
    for copy_out, next_rs in zip(d2h, scatters[1:], strict=False):  # one post-reduce stream
        assert copy_out.end_s <= next_rs.start_s
    step = next(o for o in ops if o.kind is OpKind.OPTIMIZER)
    assert step.stream is Stream.HOST and step.start_s >= max(o.end_s for o in d2h)
    assert step.duration_s == pytest.approx(NUMEL * ADAMW)
    assert build_report(r).step_time_s == pytest.approx(step.end_s)


def test_pageable_memory_copies_at_the_pageable_rates_and_blocks_the_host() -> None:
    r = simulate(_offload(pin=False, precision={"param_dtype": "bf16"}), _profile())
    for o in _copies(r, Stream.H2D) + _copies(r, Stream.D2H):
        rate = PAGEABLE_H2D if o.stream is Stream.H2D else PAGEABLE_D2H
        assert o.duration_s == pytest.approx(o.bytes / rate)
    # with a slow link: the pinned copy runs beside the next backward segment; the pageable copy
    # blocks the host in the post-backward hook, so that segment starts only after it
    slow = 1e6
    for pin in (True, False):
        s = _offload(pin=pin, precision={"param_dtype": "bf16"})
        run = simulate(s, _profile(device_to_host_Bps=slow, pageable_device_to_host_Bps=slow))
        first = _copies(run, Stream.D2H)[0]
        after = next(o for o in _ops(run) if o.kind is OpKind.BACKWARD and o.start_s >= first.start_s)
        assert (after.start_s >= first.end_s) is (not pin)
    pinned = simulate(_offload(precision={"param_dtype": "bf16"}), _profile())
    assert build_report(r).step_time_s > build_report(pinned).step_time_s


def test_hsdp_copies_the_gradient_out_after_the_all_reduce() -> None:
    s = _offload(parallel={"world_size": 4, "strategy": "HYBRID_SHARD", "shard_group_size": 2})
    r = simulate(s, _profile())
    ops = _ops(r)
    reduces = [o for o in ops if o.kind is OpKind.ALL_REDUCE]
    d2h = _copies(r, Stream.D2H)
    assert len(reduces) == len(d2h) == 3
    for ar, copy_out in zip(reduces, d2h, strict=True):
        assert ar.unit == copy_out.unit and ar.end_s <= copy_out.start_s


def test_sgd_steps_at_the_cpu_sgd_rate() -> None:
    r = simulate(_offload(optimizer={"name": "sgd"}), _profile())
    step = next(o for o in _ops(r) if o.kind is OpKind.OPTIMIZER)
    assert step.duration_s == pytest.approx(NUMEL * SGD)
    assert build_report(r).host_memory_bytes == 12 * NUMEL  # shard, gradient, momentum


def test_on_a_cpu_machine_nothing_moves() -> None:
    """The device is the host: ``Tensor.to`` returns the tensor itself, the step is FSDP2's own."""
    cpu = {"profile": "profiles/cpu-2x-gloo.json"}
    on, off = simulate(_offload(cluster=cpu)), simulate(make_scenario(cluster=cpu))
    assert not [o for o in _ops(on) if o.kind is OpKind.OFFLOAD]
    assert build_report(on).step_time_s == build_report(off).step_time_s
    assert build_report(on).peak_memory_bytes == build_report(off).peak_memory_bytes
    assert build_report(on).host_memory_bytes == 0


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"parallel": {"fsdp_version": 1}}, "FSDP1 offloads with fsdp1.cpu_offload"),
        ({"parallel": {"strategy": "NO_SHARD"}}, "needs a sharded strategy"),
        ({"parallel": {"world_size": 1}}, "one-rank shard group"),
        ({"training": {"grad_accum": 2}}, "sync_every_microbatch = false"),
        ({"precision": {"param_dtype": "fp16", "grad_scaler": True}}, "grad_scaler is not modelled"),
    ],
)
def test_what_is_not_modelled_is_refused_in_one_line(sections: dict, message: str) -> None:
    with pytest.raises(UserError, match=message) as e:
        _offload(**sections)
    assert "\n" not in str(e.value) and "parallel.cpu_offload" in str(e.value)


def test_accumulation_without_sync_reduces_and_copies_out_once() -> None:
    r = simulate(_offload(training={"grad_accum": 2, "sync_every_microbatch": False}), _profile())
    assert len(_copies(r, Stream.D2H)) == 3 and {o.microbatch for o in _copies(r, Stream.D2H)} == {1}


def test_a_missing_pageable_rate_is_named() -> None:
    data = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    data["node"]["cpu_torch_adamw_s_per_param"] = ADAMW
    with pytest.raises(UserError, match="node.pageable_host_to_device_Bps is missing"):
        simulate(_offload(pin=False), profile_from_dict(data, "no-pageable"))


def test_real_fsdp2_with_cpu_offload_policy_on_this_cpu_keeps_its_peak_as_predicted() -> None:
    """Real FSDP2 with ``CPUOffloadPolicy`` (unpinned: there is no accelerator) for one rank of 4 under
    the fake process group: on the CPU nothing moves, so its peak is FSDP2's without offload, as the
    simulator predicts where the device is the host."""
    from pathlib import Path

    from validation.build import _offload_policy
    from validation.fake_memory_child import measure_fake_memory_subprocess
    from validation.memory_only import compare_memory

    tiny = str(Path(__file__).resolve().parents[1] / "scenarios" / "tiny.toml")
    sets = ["parallel.world_size=4", "precision.param_dtype=bf16"]
    s = make_scenario(parallel={"cpu_offload": True})
    assert type(_offload_policy(s)).__name__ == "CPUOffloadPolicy" and not _offload_policy(s).pin_memory
    on = measure_fake_memory_subprocess(tiny, [*sets, "parallel.cpu_offload=true"], 180.0)
    off = measure_fake_memory_subprocess(tiny, sets, 180.0)
    assert on["total"] == off["total"]
    peak = compare_memory(load_scenario(tiny, [*sets, "parallel.cpu_offload=true"]), on).rows[0]
    assert abs(peak.predicted - peak.measured) <= 0.01 * peak.measured


def test_the_copies_and_the_cpu_step_get_the_offload_lanes(tmp_path) -> None:
    """The same lanes as FSDP1's CPUOffload and DeepSpeed's offload: h2d, d2h and the host."""
    import json

    from sim.outputs.chrome_trace import write_chrome_trace
    from sim.outputs.timeline import layout_lanes, shown_ranks

    r = simulate(_offload(), _profile())
    ops = r.events.ops_by_rank
    streams = {stream for _, stream in layout_lanes(shown_ranks(r.events, ops, None), ops).y}
    assert {Stream.H2D, Stream.D2H, Stream.HOST, Stream.ALL_GATHER, Stream.REDUCE_SCATTER} <= streams
    path = tmp_path / "trace.json"
    write_chrome_trace(r.events, path)
    events = json.loads(path.read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"stream 32 h2d", "stream 36 d2h"} <= threads


def test_the_vectorised_engine_gives_the_simpy_table_with_offload() -> None:
    def run(engine: str):
        s = _offload(parallel={"world_size": 8}, simulation={"compute_jitter": 0.05, "engine": engine})
        return simulate(s, _profile())

    simpy, vector = run("simpy"), run("vector")
    for rank in vector.events.simulated_ranks:
        a = sorted((o.op_id, o.name, o.start_s, o.end_s) for o in simpy.events.ops_of(rank))
        b = sorted((o.op_id, o.name, o.start_s, o.end_s) for o in vector.events.ops_of(rank))
        assert [x[:2] for x in a] == [x[:2] for x in b]
        assert [t for x in a for t in x[2:]] == pytest.approx([t for x in b for t in x[2:]])


def test_llama2_7b_on_8_ranks_keeps_16_bytes_a_parameter_on_the_host_and_none_on_the_device() -> None:
    from sim.schedule.model_state import host_bytes, model_state
    from sim.simulate import build_step, scenario_profile

    s = make_scenario(
        model={"preset": "llama2-7b"},
        parallel={"world_size": 8, "cpu_offload": True},
        precision={"param_dtype": "bf16"},
    )
    step, _, _ = build_step(s, scenario_profile(s, _profile()))
    # every parameter's dim 0 of Llama-2-7B (32000, 4096, 11008) divides by 8: no padding
    assert host_bytes(step) == 16 * 6_738_415_616 // 8  # fp32 shard, gradient, exp_avg, exp_avg_sq
    assert model_state(step).total == 0
