"""Offload: FSDP1's CPUOffload, ZeRO-Offload and ZeRO-Infinity (``sim.costs.offload``, the
offload paths of ``sim.schedule.fsdp1`` / ``zero`` / ``zero3``), and ``calibrate host``."""

import copy
import json
from pathlib import Path

import pytest
from simtest import make_scenario

from sim.core.events import OpKind, Stream
from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.parse import profile_from_dict
from sim.hardware.schema import NodeSpec
from sim.outputs.report import build_report
from sim.schedule.zero_state import flat_padded_numel, zero_state
from sim.simulate import build_step, scenario_profile, simulate
from sim.workload.model import layer_params, preset

H2D, D2H, NVME_R, NVME_W, CPU_ADAM, TORCH_ADAMW = 50e9, 40e9, 6e9, 3e9, 1e-9, 5e-9
TINY_ROOT = 512 * 64 * 2 + 64
BLOCK = sum(p.numel for p in layer_params(preset("tiny"), 0))


def _profile(**node: float):
    data = copy.deepcopy(BUILTIN_PROFILES["h100-sxm"])
    data["node"].update(
        {
            "host_to_device_Bps": H2D,
            "device_to_host_Bps": D2H,
            "nvme_read_Bps": NVME_R,
            "nvme_write_Bps": NVME_W,
            "cpu_adam_s_per_param": CPU_ADAM,
            "cpu_torch_adamw_s_per_param": TORCH_ADAMW,
            **node,
        }
    )
    return profile_from_dict(data, "offload-test")


def _moved(result, stream: Stream) -> list[int]:
    return [o.bytes for o in result.program.ops if o.kind is OpKind.OFFLOAD and o.stream is stream]


def test_fsdp1_cpu_offload_copies_shards_in_and_gradients_out_and_steps_on_the_host() -> None:
    s = make_scenario(parallel={"fsdp_version": 1}, fsdp1={"cpu_offload": True})
    r = simulate(s, _profile())
    shard_root, shard_block = TINY_ROOT // 2, BLOCK // 2
    # every all-gather copies its fp32 shard in first (root once, each block twice); each
    # reduce-scatter's shard goes out to its pinned _cpu_grad
    assert sorted(_moved(r, Stream.H2D)) == sorted([4 * shard_root] + [4 * shard_block] * 4)
    assert sorted(_moved(r, Stream.D2H)) == sorted([4 * shard_root] + [4 * shard_block] * 2)
    step = next(o for o in r.events.ops_of(0) if o.kind is OpKind.OPTIMIZER)
    numel = shard_root + 2 * shard_block
    assert step.stream is Stream.HOST and step.duration_s == pytest.approx(numel * TORCH_ADAMW)
    report = build_report(r)
    assert (report.model_state.params, report.model_state.optimizer) == (0, 0)
    assert report.host_memory_bytes == 16 * numel  # fp32 shard, _cpu_grad, AdamW's two states
    for transfer in (o for o in r.events.ops_of(0) if o.kind is OpKind.OFFLOAD):
        rate = H2D if transfer.stream is Stream.H2D else D2H
        assert transfer.duration_s == pytest.approx(transfer.bytes / rate)


def test_a_missing_host_figure_is_named() -> None:
    s = make_scenario(parallel={"fsdp_version": 1}, fsdp1={"cpu_offload": True})
    with pytest.raises(UserError, match="node.cpu_torch_adamw_s_per_param is missing"):
        simulate(s, profile_from_dict(copy.deepcopy(BUILTIN_PROFILES["h100-sxm"]), "no-host"))


def test_pcie_datasheet_rate_stands_in_for_a_measured_one() -> None:
    assert NodeSpec(pcie_gen=5, pcie_lanes=16).h2d_Bps() == pytest.approx(63.008e9)
    assert NodeSpec(pcie_gen=4, pcie_lanes=16, host_to_device_Bps=25e9).h2d_Bps() == 25e9


def test_zero_offload_moves_the_partition_out_and_back_and_steps_with_cpu_adam() -> None:
    zero = {"enabled": True, "stage": 2, "offload_optimizer": "cpu", "reduce_bucket_size": 20000}
    s = make_scenario(precision={"param_dtype": "bf16"}, deepspeed=zero)
    r = simulate(s, _profile())
    step, _, _ = build_step(s, scenario_profile(s, _profile()))
    part = flat_padded_numel(step) // 2
    assert sum(_moved(r, Stream.D2H)) == 4 * (156480 // 2)  # each bucket's slice, as fp32
    assert _moved(r, Stream.H2D) == [2 * part]  # the updated partition, in the training dtype
    adam = next(o for o in r.events.ops_of(0) if o.kind is OpKind.OPTIMIZER)
    assert adam.stream is Stream.HOST and adam.duration_s == pytest.approx(part * CPU_ADAM)
    z = zero_state(step)
    assert (z.optimizer, z.grads, z.host_bytes) == (0, 0, 16 * part)


def test_zero_infinity_swaps_states_and_partitions_through_nvme() -> None:
    zero = {
        "enabled": True,
        "stage": 3,
        "offload_optimizer": "nvme",
        "offload_param": "nvme",
        "stage3_param_persistence_threshold": 0,
    }
    s = make_scenario(precision={"param_dtype": "bf16"}, deepspeed=zero)
    r = simulate(s, _profile())
    step, _, _ = build_step(s, scenario_profile(s, _profile()))
    z = zero_state(step)
    states = 12 * z.partition_numel
    reads = [o for o in r.program.ops if o.stream is Stream.NVME and o.name.startswith("nvme read states")]
    writes = [o for o in r.program.ops if o.stream is Stream.NVME and "write" in o.name]
    assert sum(o.bytes for o in reads) == states
    assert sum(o.bytes for o in writes) == states + 2 * z.partition_numel  # states, then the partition
    assert z.params == 0 and z.nvme_bytes == 14 * z.partition_numel
    fetches = sum(o.bytes for o in r.program.ops if o.kind is OpKind.ALL_GATHER)
    assert sum(_moved(r, Stream.H2D)) * 2 == fetches  # each gathered byte came in as a partition
    for o in reads:  # NVMe is shared by the node's ranks (here 2 of 2)
        assert o.duration_s == pytest.approx(o.bytes * 2 / NVME_R)
    report = build_report(r)
    assert report.zero_infinity is not None
    assert report.zero_infinity["model_state_working_memory_bytes"] == 4 * 64 * 4 * 64


def test_calibrate_host_writes_the_node_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real measurements, at small sizes: torch's AdamW, this disk, the host memcpy; on a CPU the
    device is the host. DeepSpeed's CPU Adam is made unavailable here: its JIT build takes a
    minute on a fresh machine, a sixth of the suite's budget; the calibration then says why it
    did not measure it and writes the rest."""
    import sys

    import calibrate.host as host
    from calibrate.cli import main

    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", None)  # the import fails, as an unbuilt op

    monkeypatch.setattr(host, "ADAM_ELEMENTS", 1 << 20)
    monkeypatch.setattr(host, "NVME_BYTES", 32 << 20)
    monkeypatch.setattr(host, "COPY_BYTES", 16 << 20)
    out = tmp_path / "host.json"
    assert (
        main(["host", "--base", "h100-sxm", "--out", str(out), "--nvme-path", str(tmp_path), "--reps", "2"])
        == 0
    )
    node = json.loads(out.read_text())["node"]
    assert (
        node["cpu_torch_adamw_s_per_param"] > 0 and node["nvme_read_Bps"] > 0 and node["nvme_write_Bps"] > 0
    )
    assert "cpu_adam_s_per_param" not in node
    assert "DeepSpeed CPU Adam not measured: ModuleNotFoundError" in capsys.readouterr().out
    assert node["cpu_torch_sgd_s_per_param"] > 0  # torch's SGD with momentum (FSDP2's CPU offload)
    assert node["pcie_gen"] == 5  # the base profile's fields are kept
    profile_from_dict(json.loads(out.read_text()), str(out))


def test_offload_and_zero_buckets_get_their_own_lanes(tmp_path: Path) -> None:
    """The timeline and the trace show the PCIe copies on h2d/d2h lanes and the host optimizer
    on the host lane, beside FSDP1's all-gathers and reduce-scatters."""
    from sim.outputs.chrome_trace import write_chrome_trace
    from sim.outputs.timeline import layout_lanes, shown_ranks

    s = make_scenario(parallel={"fsdp_version": 1}, fsdp1={"cpu_offload": True})
    r = simulate(s, _profile())
    ops = r.events.ops_by_rank
    lanes = layout_lanes(shown_ranks(r.events, ops, None), ops)
    streams = {stream for _, stream in lanes.y}
    assert {Stream.H2D, Stream.D2H, Stream.HOST, Stream.ALL_GATHER, Stream.REDUCE_SCATTER} <= streams
    path = tmp_path / "trace.json"
    write_chrome_trace(r.events, path)
    threads = {
        e["args"]["name"]
        for e in json.loads(path.read_text())["traceEvents"]
        if e.get("name") == "thread_name"
    }
    assert {"stream 32 h2d", "stream 36 d2h"} <= threads


def test_tune_refuses_fsdp1_and_deepspeed(tmp_path: Path) -> None:
    from sim.study.tune.tuner import tune

    root = Path(__file__).resolve().parents[1]
    with pytest.raises(UserError, match="searches FSDP2's space"):
        tune(str(root / "scenarios/seed-t5-fsdp1.toml"))
