"""`fsdpsim run` output files: the comparison timeline and per-rank traces."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "scenarios" / "tiny.toml")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sim.cli.main", "run", TINY, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compare_set_stacks_a_second_run_on_the_timeline(tmp_path: Path) -> None:
    html = tmp_path / "cmp.html"
    proc = _run("--timeline", str(html), "--compare-set", "parallel.strategy=SHARD_GRAD_OP")
    assert proc.returncode == 0, proc.stderr
    text = html.read_text()
    assert "parallel.strategy=SHARD_GRAD_OP: step" in text  # the second panel's title
    assert "tiny.toml: step" in text


def test_compare_set_without_a_timeline_is_a_user_mistake(tmp_path: Path) -> None:
    proc = _run("--compare-set", "parallel.strategy=SHARD_GRAD_OP")
    assert proc.returncode == 2
    assert proc.stderr.startswith("fsdpsim: error:") and "--timeline" in proc.stderr


def test_trace_dir_writes_one_trace_per_simulated_rank(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    proc = _run(
        "--trace-dir", str(out), "--set", "simulation.compute_jitter=0.1", "--set", "parallel.world_size=4"
    )
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == [f"rank{r}.trace.json" for r in range(4)]
    for r, name in enumerate(files):
        trace = json.loads((out / name).read_text())
        assert trace["distributedInfo"]["rank"] == r
        assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {r}


def test_output_files_get_the_usual_permissions(tmp_path: Path) -> None:
    import os

    out = tmp_path / "report.json"
    assert _run("--format", "json", "--out", str(out)).returncode == 0
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask
