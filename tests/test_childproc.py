"""``sim.childproc``: ``python -m MODULE`` children forked from one preloaded server behave as
fresh ``subprocess`` children would: their arguments, environment and directory, their output
captured, their exit code, a time limit that kills them, and state that never leaks between
them or back into the server."""

import os
import sys
import time
from pathlib import Path

import pytest

from sim import childproc

PROBE = """
import json, os, sys
import torch  # already imported by the server
state = getattr(torch, "_fsdpsim_probe", 0)
torch._fsdpsim_probe = state + 1  # what a child leaves behind must not reach the next one
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("PROBE_VAR"),
                  "state": state, "main": __name__, "server": os.getppid()}))
print("to stderr", file=sys.stderr)
code = int(os.environ.get("PROBE_EXIT", "0"))
if os.environ.get("PROBE_KILL_SERVER"):
    import signal
    os.kill(os.getppid(), signal.SIGKILL)  # the server, mid-request
if os.environ.get("PROBE_SLEEP"):
    import time
    time.sleep(float(os.environ["PROBE_SLEEP"]))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("probe")
    (folder / "childprobe.py").write_text(PROBE)
    return folder


def _run(probe: Path, cwd: Path, timeout_s: float = 120, **env: str) -> childproc.ChildResult:
    environ = dict(os.environ, PYTHONPATH=str(probe), **env)
    return childproc.run_module("childprobe", ["a", "b c"], env=environ, cwd=cwd, timeout_s=timeout_s)


def test_a_child_gets_its_arguments_environment_and_directory(probe: Path, tmp_path: Path) -> None:
    import json

    first = _run(probe, tmp_path, PROBE_VAR="one")
    second = _run(probe, probe, PROBE_VAR="two", PROBE_EXIT="3")
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert (first.returncode, second.returncode) == (0, 3)
    assert a.pop("server") == b["server"]  # one server forked both
    assert a == {"argv": ["a", "b c"], "cwd": str(tmp_path), "var": "one", "state": 0, "main": "__main__"}
    assert (b["cwd"], b["var"], b["state"]) == (str(probe), "two", 0)  # nothing left by the first
    assert first.stderr == "to stderr\n"
    assert "PROBE_VAR" not in os.environ and os.getcwd() != str(tmp_path)  # the caller is untouched


def test_a_child_past_its_limit_is_killed_and_the_next_one_runs(probe: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(childproc.ChildTimeout, match="ran past 2 s"):
        _run(probe, tmp_path, timeout_s=2, PROBE_SLEEP="60")
    assert time.monotonic() - start < 30
    assert _run(probe, tmp_path).returncode == 0


def test_the_callers_main_module_is_not_run_again(tmp_path: Path) -> None:
    """A user's script without a ``__main__`` guard is not re-executed in the child (as
    ``multiprocessing``'s forkserver would)."""
    import subprocess

    marker = tmp_path / "ran"
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        f"open({str(marker)!r}, 'a').write('x')\n"
        "from sim import childproc\n"
        "r = childproc.run_module('json.tool', ['--help'], env=dict(os.environ), cwd='.', timeout_s=120)\n"
        "print(r.returncode)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(childproc.__file__).parents[1]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0" and marker.read_text() == "x"


def test_callers_in_threads_each_get_a_server_and_run_at_once(probe: Path, tmp_path: Path) -> None:
    import json
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:  # the first holds its server 3 s: the second starts one
        results = list(pool.map(lambda _: _run(probe, tmp_path, PROBE_SLEEP="3"), range(2)))
    assert [r.returncode for r in results] == [0, 0]
    servers = {json.loads(r.stdout)["server"] for r in results}
    assert len(servers) == 2 and os.getpid() not in servers


def test_a_server_killed_from_outside_is_replaced(probe: Path, tmp_path: Path) -> None:
    _run(probe, tmp_path)
    for server in list(childproc._idle):
        server.proc.kill()
        server.proc.wait()
    assert _run(probe, tmp_path).returncode == 0


def test_a_server_that_dies_mid_request_twice_is_a_failed_child_not_an_exception(
    probe: Path, tmp_path: Path
) -> None:
    result = _run(probe, tmp_path, PROBE_KILL_SERVER="1")  # kills the first server, then its replacement
    assert result.returncode == 1
    assert result.stderr.startswith("python -m hfmodel.forkserver ended:") and result.stderr.count("\n") == 1
    assert _run(probe, tmp_path).returncode == 0  # a fresh server serves the next one


def test_a_module_the_caller_names_is_imported_by_the_server_once_for_every_later_child(
    probe: Path, tmp_path: Path
) -> None:
    """``preload``: the server imports the module before forking, so the child (and every later
    child of that server) finds it imported; a module nobody named is not."""
    import json

    (tmp_path / "sawit.py").write_text('import json, sys\nprint(json.dumps("tabnanny" in sys.modules))\n')
    environ = dict(os.environ, PYTHONPATH=str(tmp_path))

    def seen(preload: tuple[str, ...] = ()) -> bool:
        result = childproc.run_module("sawit", [], env=environ, cwd=tmp_path, timeout_s=120, preload=preload)
        assert result.returncode == 0, result.stderr
        answer: bool = json.loads(result.stdout)
        return answer

    assert not seen()
    assert seen(("tabnanny",))
    assert seen()  # the same server, which keeps it
    assert seen(("no_such_module_anywhere",))  # a name that does not import is skipped


def test_a_fine_tuned_description_leaves_peft_imported_for_the_next_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full model's description does not import PEFT into the server (every process's first
    description would pay it); a LoRA one does, so that the next fine-tuned description of a
    sweep forks with PEFT already imported."""
    import json

    pytest.importorskip("peft")
    from sim.scenario.hf_model import describe_config

    monkeypatch.setattr(childproc, "_idle", [])  # a server of this test's own
    monkeypatch.setenv("FSDPSIM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "sawpeft.py").write_text('import json, sys\nprint(json.dumps("peft" in sys.modules))\n')
    environ = dict(os.environ, PYTHONPATH=str(tmp_path))

    def peft_imported() -> bool:
        result = childproc.run_module("sawpeft", [], env=environ, cwd=tmp_path, timeout_s=120)
        assert result.returncode == 0, result.stderr
        answer: bool = json.loads(result.stdout)
        return answer

    config = Path(__file__).resolve().parent / "data" / "hf" / "tiny-llama.json"
    lora = {"method": "lora", "rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
    for finetune in (None, lora):
        d = describe_config(
            config, name="tiny-llama", micro_batch=1, seq_len=16, dtype="bf16", where="t", finetune=finetune
        )
        assert (d.finetune is not None) == (finetune is not None)
        assert peft_imported() == (finetune is not None)
