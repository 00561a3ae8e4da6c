"""``fsdpsim`` as a user runs it: a subprocess, its exit code, stdout JSON, one-line errors on stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.fileio import write_text_atomic
from sim.scenario.loader import load_scenario
from sim.workload.model import n_params

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").glob("*.toml"))
TINY = ROOT / "scenarios" / "tiny.toml"
DEFAULT = ROOT / "scenarios" / "llama2-7b-8xh100-zero3.toml"

REQUIRED_KEYS = {
    "n_params",
    "world_size",
    "strategy",
    "wrap",
    "n_units",
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "breakdown_s",
    "peak_memory_bytes",
    "memory_at_peak_bytes",
    "model_state_bytes",
    "device_memory_bytes",
    "fits",
    "per_rank",
}
MEMORY_CATEGORIES = {"params", "grads", "optimizer", "activations", "comm_buffers", "other"}


def fsdpsim(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "sim.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


def run_json(*args: str | Path) -> dict:
    proc = fsdpsim("run", *args, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_user_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("fsdpsim: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert proc.stdout == ""
    return lines[0]


def check_report(report: dict, scenario_path: Path) -> None:
    scenario = load_scenario(scenario_path)
    assert report.keys() >= REQUIRED_KEYS
    k = report["world_size"]
    assert k == scenario.parallel.world_size
    assert report["n_params"] == n_params(scenario.model)
    assert report["strategy"] == scenario.parallel.strategy.value
    assert report["wrap"] == scenario.parallel.wrap.value
    if scenario.parallel.wrap.value == "block":
        assert report["n_units"] == scenario.model.n_layers + 1  # one per decoder layer + the root
    step = report["step_time_s"]
    assert step > 0
    breakdown = report["breakdown_s"]
    assert set(breakdown) == {"compute", "exposed_comm", "idle"}
    assert sum(breakdown.values()) == pytest.approx(step, rel=1e-9)
    assert all(v >= 0 for v in breakdown.values())  # idle is never negative
    assert report["tokens_per_s"] == pytest.approx(scenario.tokens_per_step / step, rel=1e-12)
    assert report["tokens_per_s_per_gpu"] == pytest.approx(report["tokens_per_s"] / k, rel=1e-12)
    assert 0 < report["mfu"] <= report["hfu"] < 1  # HFU adds the recomputed forward

    per_rank = report["per_rank"]
    assert [r["rank"] for r in per_rank] == list(range(k))
    for r in per_rank:
        assert {"rank", "step_time_s", "peak_memory_bytes"} <= r.keys()
        assert 0 < r["step_time_s"] <= step * (1 + 1e-12)
    assert max(r["step_time_s"] for r in per_rank) == pytest.approx(step, rel=1e-12)
    peak = report["peak_memory_bytes"]
    assert peak == max(r["peak_memory_bytes"] for r in per_rank)
    assert set(report["memory_at_peak_bytes"]) == MEMORY_CATEGORIES
    assert all(v >= 0 for v in report["memory_at_peak_bytes"].values())
    assert sum(report["memory_at_peak_bytes"].values()) == peak
    assert 0 < report["model_state_bytes"] <= peak
    assert report["fits"] is (peak <= report["device_memory_bytes"])


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_every_scenario_runs(path: Path) -> None:
    check_report(run_json(path), path)


def test_scenarios_exist() -> None:
    assert len(SCENARIOS) >= 4 and DEFAULT in SCENARIOS and TINY in SCENARIOS


def test_table_is_the_default_format() -> None:
    proc = fsdpsim("run", TINY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and not proc.stdout.lstrip().startswith("{")


def test_set_world_size_changes_the_report() -> None:
    base = run_json(DEFAULT)
    scaled = run_json(DEFAULT, "--set", "parallel.world_size=64")
    assert base["world_size"] == 8 and scaled["world_size"] == 64
    assert len(scaled["per_rank"]) == 64
    assert scaled["n_params"] == base["n_params"] == 6_738_415_616
    # ZeRO-3 over 64 ranks shards the persistent model state 8x finer than over 8
    assert scaled["model_state_bytes"] < base["model_state_bytes"]


def test_repeated_set_and_strategy_override() -> None:
    report = run_json(TINY, "--set", "parallel.strategy=NO_SHARD", "--set", "parallel.world_size=4")
    assert (report["strategy"], report["world_size"]) == ("NO_SHARD", 4)


def test_same_scenario_gives_identical_json() -> None:
    first = fsdpsim("run", TINY, "--format", "json")
    second = fsdpsim("run", TINY, "--format", "json")
    assert first.returncode == second.returncode == 0
    assert first.stdout == second.stdout


def test_presets_lists_models_and_profiles() -> None:
    proc = fsdpsim("presets")
    assert proc.returncode == 0, proc.stderr
    assert "llama2-7b" in proc.stdout and "6,738,415,616" in proc.stdout and "h100-sxm" in proc.stdout


@pytest.fixture
def scenario_dir(tmp_path: Path) -> Path:
    (tmp_path / "typo.toml").write_text('[model]\npreset = "tiny"\n[parallel]\nwrold_size = 2\n')
    (tmp_path / "type.toml").write_text('[model]\npreset = "tiny"\n[training]\nseq_len = "64"\n')
    (tmp_path / "hybrid.toml").write_text(
        '[model]\npreset = "tiny"\n[parallel]\nstrategy = "HYBRID_SHARD"\nworld_size = 12\nshard_group_size = 8\n'
    )
    return tmp_path


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("typo.toml",), ("typo.toml", "parallel.wrold_size", "did you mean 'world_size'")),
        (("type.toml",), ("type.toml", "training.seq_len must be an integer", "'64'")),
        (("hybrid.toml",), ("hybrid.toml", "parallel.world_size (12)", "parallel.shard_group_size (8)")),
        (("missing.toml",), ("missing.toml", "scenario file not found")),
        ((TINY, "--set", "parallel.world_size"), ("--set 'parallel.world_size'", "section.key=value")),
        ((TINY, "--set", "paralel.world_size=2"), ("unknown section 'paralel'", "did you mean 'parallel'")),
        ((TINY, "--set", "parallel.world_size=two"), ("parallel.world_size must be an integer", "'two'")),
        (
            (TINY, "--set", "parallel.strategy=ZERO3"),
            ("parallel.strategy", "allowed: NO_SHARD, SHARD_GRAD_OP"),
        ),
        ((TINY, "--set", "cluster.profile=nope/profile.json"), ("cluster.profile", "'nope/profile.json'")),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "not-divisible",
        "missing-file",
        "set-syntax",
        "set-section",
        "set-type",
        "set-enum",
        "bad-profile-path",
    ],
)
def test_user_mistakes_exit_2_with_one_line(
    scenario_dir: Path, args: tuple, fragments: tuple[str, ...]
) -> None:
    assert_user_error(fsdpsim("run", *args, "--format", "json", cwd=scenario_dir), *fragments)


def test_corrupt_profile_file(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text("{not json")
    proc = fsdpsim("run", TINY, "--set", f"cluster.profile={profile}")
    assert_user_error(proc, str(profile), "not a valid JSON profile")


def test_profile_path_that_is_a_directory(tmp_path: Path) -> None:
    proc = fsdpsim("run", TINY, "--set", f"cluster.profile={tmp_path}")
    assert_user_error(proc, "cluster.profile", str(tmp_path))


def test_out_writes_atomically(tmp_path: Path) -> None:
    out_dir = tmp_path / "results"
    out = out_dir / "tiny.json"
    proc = fsdpsim("run", TINY, "--format", "json", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == proc.stdout
    check_report(json.loads(out.read_text()), TINY)
    assert [p.name for p in out_dir.iterdir()] == ["tiny.json"]  # no temporary file left


def test_out_replaces_an_existing_file(tmp_path: Path) -> None:
    out = tmp_path / "report.txt"
    out.write_text("old")
    proc = fsdpsim("run", TINY, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["report.txt"]


def test_failed_run_leaves_no_output(scenario_dir: Path) -> None:
    out = scenario_dir / "out" / "report.json"
    before = sorted(p.name for p in scenario_dir.iterdir())
    assert_user_error(fsdpsim("run", "typo.toml", "--format", "json", "--out", out, cwd=scenario_dir))
    assert not out.exists()
    assert sorted(p.name for p in scenario_dir.iterdir()) == before


def test_out_that_is_a_directory(tmp_path: Path) -> None:
    assert_user_error(fsdpsim("run", TINY, "--out", tmp_path), str(tmp_path), "is a directory")


def test_atomic_write_interrupted_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "r.json"
    target.write_text("old")

    def fail(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("run", TINY, "--bogus"), ("unrecognized arguments: --bogus",)),
        (("comm", "broadcast", "--size", "1M"), ("invalid choice: 'broadcast'", "all_gather")),
        (("comm", "all_gather", "--size", "1X"), ("not a size: '1X'",)),
        (("comm", "all_gather", "--size", "1M", "--cluster", "nope"), ("comm --cluster", "dgx-h100")),
        (("comm", "all_gather", "--size", "1M", "--gpus-per-node", "16"), ("--gpus-per-node 16", "8 GPUs")),
        (("cluster", "show"), ("needs a cluster name",)),
    ],
    ids=["run-flag", "comm-collective", "comm-size", "comm-cluster", "comm-gpus", "cluster-name"],
)
def test_flag_mistakes_of_every_verb_exit_2_with_one_line(args: tuple, fragments: tuple[str, ...]) -> None:
    assert_user_error(fsdpsim(*args), *fragments)


def test_comm_prints_the_nccl_tests_figures_as_json() -> None:
    proc = fsdpsim(
        "comm", "all_reduce", "--size", "1G", "--nodes", "4", "--cluster", "dgx-a100", "--format", "json"
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {"time_s", "algbw_Bps", "busbw_Bps", "algorithm", "protocol", "channels"} <= set(data)
    assert data["algbw_Bps"] == pytest.approx((1 << 30) / data["time_s"])
    assert data["busbw_Bps"] == pytest.approx(
        data["algbw_Bps"] * 2 * 31 / 32
    )  # nccl-tests' all-reduce factor
    assert (data["n_ranks"], data["algorithm"], data["protocol"]) == (32, "ring", "Simple")


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the refusal is for machines without a GPU"
)
@pytest.mark.parametrize("memory_only", [True, False])
def test_validating_fsdp1_cpu_offload_without_a_gpu_is_one_line(memory_only: bool) -> None:
    """FSDP1's CPUOffload pins host memory, which needs an accelerator: refused before anything runs,
    not a traceback from the real run's ranks."""
    args = ("--memory-only",) if memory_only else ("--nproc", "2")
    proc = fsdpsim(
        "validate", TINY, *args, "--set", "parallel.fsdp_version=1", "--set", "fsdp1.cpu_offload=true"
    )
    assert_user_error(proc, "fsdp1.cpu_offload = true cannot run on this machine", "CUDA")
