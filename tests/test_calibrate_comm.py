"""``calibrate comm`` for real: 2 gloo processes on this CPU, their failures, and the profile file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import simtest
from simtest import outside_rank_env

from calibrate.cli import main
from calibrate.groups import plan_group_families
from calibrate.sweep_plan import CPU_DEFAULTS, SweepConfig, iters_for, sizes_for
from sim.cli.parser import parse_size
from sim.errors import UserError
from sim.hardware.registry import load_profile
from sim.hardware.schema import SCHEMA_VERSION

pytestmark = pytest.mark.slow  # real torch.distributed processes

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--max-bytes", "64K", "--iters", "3", "--max-iters", "5", "--warmup", "1"]


def run_calibrate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return simtest.run_calibrate(*args, timeout=timeout)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("comm") / "cpu.json"
    proc = run_calibrate("comm", "--nproc", "2", "--out", str(out), *SMALL)
    assert proc.returncode == 0, proc.stderr
    return out


def test_small_sweep_writes_a_profile_the_simulator_loads(measured: Path) -> None:
    prof = load_profile(str(measured))
    assert prof.calibrated and prof.backend.name == "gloo"
    assert not prof.backend.overlaps_comm_compute and prof.backend.collective_temp_buffers
    assert prof.backend.attention_kernel in ("flash", "math") and prof.backend.collective_launch_s > 0
    assert prof.gpus_per_node == 2
    assert {(c.collective, c.group_size, c.dtype, c.spans_nodes) for c in prof.collectives} == {
        (coll, 2, dtype, False)
        for coll in ("all_gather", "reduce_scatter", "all_reduce")
        for dtype in ("fp32", "bf16")
    }
    assert all(c.sizes_bytes == (1024, 4096, 16384, 65536) for c in prof.collectives)
    assert prof.device.compute_efficiency == 1.0 and set(prof.device.peak_flops) == {"fp32", "bf16"}


def test_points_carry_nccl_tests_columns_and_no_wrong_elements(measured: Path) -> None:
    doc = json.loads(measured.read_text())
    for curve in doc["collectives"]:
        factor = {"all_reduce": 1.0}.get(curve["collective"], 0.5)  # 2 ranks: 2(n-1)/n = 1, (n-1)/n = 1/2
        for p in curve["points"]:
            assert p["wrong"] == 0
            assert p["min_s"] <= p["time_s"] <= p["max_s"]
            assert p["algbw_Bps"] == pytest.approx(p["bytes"] / p["time_s"])
            assert p["busbw_Bps"] == pytest.approx(p["algbw_Bps"] * factor)
        assert curve["fit"]["latency_s"] >= 0 and curve["fit"]["bus_bw_Bps"] > 0
    src = doc["source"]
    assert (src["world_size"], src["nodes"], src["nccl_version"], src["cuda_version"]) == (2, 1, "gloo", None)
    for field in ("torch_version", "cpu_model", "threads", "date", "command", "method", "device_name"):
        assert src[field], field
    assert "--nproc 2" in src["command"]
    assert doc["topology"]["inter_node"] == doc["topology"]["intra_node"]
    assert "not measured" in src["topology"]["inter_node"]


def _assert_failed_cleanly(proc: subprocess.CompletedProcess[str], out: Path, before: str | None) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("calibrate: error:") and "no profile written" in last
    if before is None:
        assert not out.exists()
    else:
        assert out.read_text() == before  # the old profile is untouched
    assert not list(out.parent.glob(".*.tmp"))


def test_a_rank_that_dies_mid_sweep_leaves_no_profile(tmp_path: Path) -> None:
    out = tmp_path / "dead.json"
    proc = run_calibrate("comm", "--nproc", "2", "--out", str(out), *SMALL, "--fault", "1:5:exit")
    _assert_failed_cleanly(proc, out, None)
    assert "rank 1 exited with code 17" in proc.stderr.strip().splitlines()[-1]


def test_a_hung_rank_times_out_and_an_old_profile_survives(tmp_path: Path) -> None:
    out = tmp_path / "hung.json"
    out.write_text('{"old": "profile"}\n')
    args = ("comm", "--nproc", "2", "--out", str(out), *SMALL, "--timeout", "3")
    proc = run_calibrate(*args, "--fault", "1:2:hang", timeout=60)
    _assert_failed_cleanly(proc, out, '{"old": "profile"}\n')
    assert "did not finish within 3 s" in proc.stderr


def test_without_ranks_comm_says_how_to_get_them(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        assert var not in os.environ
    assert main(["comm", "--out", str(tmp_path / "p.json")]) == 2
    assert "pass --nproc N, or run it under torchrun" in capsys.readouterr().err


def test_bad_flags_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["comm", "--out", "p.json", "--dtypes", "fp64"]) == 2
    assert "choose from fp32, bf16, fp16" in capsys.readouterr().err


@pytest.mark.parametrize("edit", ["version", "truncate", "field"])
def test_a_corrupted_or_wrong_version_profile_is_refused(measured: Path, tmp_path: Path, edit: str) -> None:
    doc = json.loads(measured.read_text())
    bad = tmp_path / "bad.json"
    if edit == "version":
        doc["schema_version"] = SCHEMA_VERSION + 1
        bad.write_text(json.dumps(doc))
        match = f"schema_version {SCHEMA_VERSION + 1} is not supported"
    elif edit == "truncate":
        bad.write_text(measured.read_text()[:300])
        match = "not a valid JSON profile"
    else:
        doc["collectives"][0]["points"][1]["time_s"] = -1.0
        bad.write_text(json.dumps(doc))
        match = r"collectives\[0\]\.points\[1\]\.time_s must be > 0"
    with pytest.raises(UserError, match=match):
        load_profile(str(bad))


def test_cpu_default_sweep_is_1k_to_64m_by_4() -> None:
    cfg = SweepConfig(**CPU_DEFAULTS, dtypes=("fp32",), collectives=("all_gather",), timeout_s=1)
    assert sizes_for(cfg, 2, "fp32") == [1 << k for k in range(10, 27, 2)]
    assert sizes_for(cfg, 3, "bf16")[0] == 1020  # a multiple of group size x element size
    assert iters_for(cfg, 1 << 10) == 30 and iters_for(cfg, 64 << 20) == 5


def test_group_families_for_hybrid_shard_layouts() -> None:
    fams = {f.kind: f for f in plan_group_families(16, 8)}
    assert fams["world"].spans_nodes and fams["intra_node"].groups[1] == tuple(range(8, 16))
    assert fams["inter_node"].groups[3] == (3, 11) and fams["inter_node"].spans_nodes
    assert not fams["intra_node"].spans_nodes
    single = plan_group_families(8, 8, shard_size=4)
    assert [(f.kind, f.size) for f in single] == [("world", 8), ("shard", 4), ("replicate", 2)]
    assert [f.kind for f in plan_group_families(2, 2, shard_size=2)] == ["world"]  # same key as world
    with pytest.raises(UserError):
        plan_group_families(8, 8, shard_size=3)


@pytest.mark.parametrize(
    ("text", "value"), [("4096", 4096), ("1K", 1024), ("64M", 64 << 20), ("1GiB", 1 << 30)]
)
def test_sizes_use_binary_units_like_nccl_tests(text: str, value: int) -> None:
    assert parse_size(text) == value


def _torchrun(nproc: int, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = outside_rank_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "calibrate", "comm", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_torchrun_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "torchrun.json"
    proc = _torchrun(2, out, *SMALL, "--dtypes", "fp32", "--collectives", "all_gather")
    assert proc.returncode == 0, proc.stderr
    prof = load_profile(str(out))
    assert [(c.collective, c.group_size, c.dtype) for c in prof.collectives] == [("all_gather", 2, "fp32")]
    assert json.loads(out.read_text())["source"]["command"].startswith("torchrun")


@pytest.mark.gpu
def test_gpu_nccl_sweep(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    out = tmp_path / "gpu.json"
    proc = _torchrun(min(torch.cuda.device_count(), 8), out, "--max-bytes", "64M")
    assert proc.returncode == 0, proc.stderr
    prof = load_profile(str(out))
    assert prof.backend.name == "nccl" and prof.backend.overlaps_comm_compute
    assert all(c.sizes_bytes[-1] >= 32 << 20 for c in prof.collectives)
    doc = json.loads(out.read_text())
    assert all(p["wrong"] == 0 for c in doc["collectives"] for p in c["points"])


def test_the_rendezvous_port_is_free_and_outside_the_ephemeral_range() -> None:
    """Another job's gloo connections take ephemeral ports: a rendezvous port there can be taken
    between choosing it and rank 0's listen (EADDRINUSE, seen with two test workers)."""
    import socket

    from calibrate.launch import _ephemeral_range, free_port

    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))  # free: it binds
