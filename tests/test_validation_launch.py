"""``validation.launch.run_ranks``: the ranks of a real run, forked from preloaded servers (or,
where NVIDIA's driver is loaded, fresh interpreters), run at once with torchrun's environment; a
rank that fails stops the others and is named in one line; a run past its limit is stopped; the
servers serve the next run."""

import os
import time
from pathlib import Path

import pytest

import validation.launch
from sim.errors import UserError
from validation.launch import run_ranks

JOB = """import os, sys, time
from pathlib import Path
rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
mode = sys.argv[1]
Path(sys.argv[2], f"rank{rank}").write_text(f"{world} {os.environ['MASTER_PORT']} {os.getpid()}")
while mode in ("fail", "orphan") and rank == "1" and not Path(sys.argv[2], "rank0").exists():
    time.sleep(0.01)  # rank 0 has started
if mode == "orphan" and rank == "1":  # its fork server killed from outside
    os.kill(os.getppid(), 9)
if mode == "fail" and rank == "1":
    print("rank one gives up", file=sys.stderr)
    sys.exit(3)
if mode != "ok":
    time.sleep(120)
"""


@pytest.fixture(params=["forked", "fresh"])
def job(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    driver = tmp_path / "nvidia-version"  # where it exists, the ranks start as fresh interpreters
    if request.param == "fresh":
        driver.write_text("NVRM version: (stands for a loaded driver)")
    monkeypatch.setattr(validation.launch, "NVIDIA_DRIVER", driver)
    (tmp_path / "rank_job.py").write_text(JOB)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
    out = tmp_path / "out"
    out.mkdir()
    return out


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """No such process, or one that has ended and waits to be reaped (an orphan's parent is init),
    within ``wait_s`` (a SIGKILL sent to a process nobody waits for lands a moment later)."""
    deadline = time.monotonic() + wait_s
    while True:
        stat = Path(f"/proc/{pid}/stat")
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _ranks(out: Path) -> list[list[str]]:
    return [(out / f"rank{r}").read_text().split() for r in range(2)]


def test_ranks_run_at_once_with_one_rendezvous_and_run_again(job: Path) -> None:
    run_ranks("rank_job", ["ok", str(job)], 2, timeout_s=120)
    first = _ranks(job)
    assert [r[0] for r in first] == ["2", "2"] and first[0][1] == first[1][1]  # one MASTER_PORT
    assert first[0][2] != first[1][2]  # a process each
    run_ranks("rank_job", ["ok", str(job)], 2, timeout_s=120)  # forked: the same servers fork again
    assert {r[2] for r in _ranks(job)}.isdisjoint({r[2] for r in first})


def test_a_failing_rank_stops_the_others_and_is_named_in_one_line(job: Path) -> None:
    started = time.monotonic()
    with pytest.raises(UserError, match=r"^real run failed: rank 1 exited with code 3: rank one gives up$"):
        run_ranks("rank_job", ["fail", str(job)], 2, timeout_s=120)
    assert time.monotonic() - started < 60  # rank 0 (asleep for 120 s) was stopped, not waited for
    assert _gone(int(_ranks(job)[0][2]))


def test_a_run_past_its_limit_is_stopped(job: Path) -> None:
    with pytest.raises(UserError, match=r"^real run did not finish within 3 s; stopped all ranks$"):
        run_ranks("rank_job", ["hang", str(job)], 2, timeout_s=3)
    assert all(_gone(int(pid)) for _, _, pid in _ranks(job))
    run_ranks("rank_job", ["ok", str(job)], 2, timeout_s=120)  # the servers reaped them and serve on


def test_a_rank_whose_server_is_killed_ends_the_run_in_one_line(job: Path) -> None:
    if not validation.launch.NVIDIA_DRIVER.exists():  # forked ranks only: a fresh one has no server
        with pytest.raises(
            UserError, match=r"^real run failed: a rank's fork server ended .*; stopped all ranks$"
        ):
            run_ranks("rank_job", ["orphan", str(job)], 2, timeout_s=60)
        assert all(_gone(int(pid)) for _, _, pid in _ranks(job))  # both ranks stopped
    run_ranks("rank_job", ["ok", str(job)], 2, timeout_s=120)  # a fresh server replaces the dead one
