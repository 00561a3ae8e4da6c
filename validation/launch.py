"""Start N ranks of ``python -m validation.worker`` on this machine (gloo), with torchrun's
environment (``calibrate.launch.worker_env``).

On a machine without a GPU each rank is forked from a server that imported torch, transformers
and the worker once (``sim.childproc.start_module``): a rank's imports are most of a tiny model's
run (3.5-4 s of CPU a rank here, against well under a second of training), and a process that
validates many times (the test suite, a sweep of validations) pays them once per server. Each
rank is still a process of its own with its own process group, as torchrun's would be. Where
NVIDIA's driver is loaded, each rank is a fresh interpreter instead (``subprocess``): a process
forked from one that has touched CUDA (``torch.cuda.is_available()`` at an import initialises the
driver) cannot use it."""

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from calibrate.launch import describe, free_port, stop, wait_all, worker_env
from sim.childproc import RunningChild, start_module
from sim.errors import UserError

# what every rank imports before it runs: the worker (with its own imports) and the model class it
# builds, which transformers imports lazily
RANK_PRELOAD = ("validation.worker", "transformers.models.llama.modeling_llama")
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # present where NVIDIA's kernel driver is loaded


def run_ranks(module: str, args: list[str], nproc: int, timeout_s: float) -> None:
    """Run ``python -m module *args`` as ``nproc`` ranks; raise UserError if one fails or hangs
    (the others are stopped at once)."""
    if NVIDIA_DRIVER.exists():
        _fresh_ranks(module, args, nproc, timeout_s)
    else:
        _forked_ranks(module, args, nproc, timeout_s)


def _forked_ranks(module: str, args: list[str], nproc: int, timeout_s: float) -> None:
    port = free_port()
    command = f"python -m {module} {' '.join(args)}"
    ranks: list[RunningChild] = []
    try:
        for r in range(nproc):
            env = worker_env(r, nproc, port, command)
            ranks.append(start_module(module, args, env=env, cwd=os.getcwd(), preload=RANK_PRELOAD))
        _watch(ranks, timeout_s)
    except OSError as e:  # a rank's server ended (killed from outside)
        raise UserError(f"real run failed: a rank's fork server ended ({e}); stopped all ranks") from None
    finally:
        for child in ranks:
            with contextlib.suppress(OSError):
                child.result()  # stops a rank still running; its server serves on


def _watch(ranks: list[RunningChild], timeout_s: float) -> None:
    """Wait for every rank to exit 0; raise UserError at the first that fails or past the limit,
    which starts once every rank is forked (a server started now imports first)."""
    for child in ranks:
        _ = child.pid
    try:
        failed = wait_all(ranks, time.monotonic() + timeout_s)
    except TimeoutError:
        raise UserError(_timed_out(timeout_s)) from None
    if failed:
        rank, code = failed[0]
        output = ranks[rank].result()
        raise UserError(_failed(rank, code, output.stderr.strip() or output.stdout))


def _fresh_ranks(module: str, args: list[str], nproc: int, timeout_s: float) -> None:
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(nproc)]
        port = free_port()
        command = f"python -m {module} {' '.join(args)}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=worker_env(r, nproc, port, command),
                stdout=logs[r],
                stderr=logs[r],
            )
            for r in range(nproc)
        ]
        try:
            failed = wait_all(procs, time.monotonic() + timeout_s)
        except TimeoutError:
            stop(procs)
            raise UserError(_timed_out(timeout_s)) from None
        except BaseException:
            stop(procs)
            raise
        if failed:
            stop(procs)
            rank, code = failed[0]
            logs[rank].seek(0)
            raise UserError(_failed(rank, code, logs[rank].read().decode(errors="replace")))


def _failed(rank: int, code: int, output: str) -> str:
    """The one line a failed rank ends the run with: which rank, how, and its output's last line."""
    tail = output.strip().splitlines()[-1:]
    return f"real run failed: {describe(rank, code)}: {' '.join(tail)}"


def _timed_out(timeout_s: float) -> str:
    return f"real run did not finish within {timeout_s:.0f} s; stopped all ranks"


def run_real(spec: dict, nproc: int, timeout_s: float) -> list[dict]:
    """Run the real training described by ``spec``; return each rank's measurements."""
    import json

    with tempfile.TemporaryDirectory(prefix="fsdpsim-validate-") as tmp:
        spec = dict(spec, out_dir=tmp)
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        run_ranks("validation.worker", [str(spec_path)], nproc, timeout_s)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(nproc)]
