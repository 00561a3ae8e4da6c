"""Start N ranks of ``python -m validation.worker`` on this machine (gloo), as torchrun would."""

import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from calibrate.launch import _describe, _free_port, _stop, worker_env
from sim.errors import UserError


def run_ranks(module: str, args: list[str], nproc: int, timeout_s: float) -> None:
    """Run ``python -m module *args`` as ``nproc`` ranks; raise UserError if one fails or hangs."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(nproc)]
        port = _free_port()
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
            _wait(procs, logs, time.monotonic() + timeout_s, timeout_s)
        except BaseException:
            _stop(procs)
            raise


def _wait(procs: list[subprocess.Popen], logs: list, deadline: float, timeout_s: float) -> None:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            logs[rank].seek(0)
            tail = logs[rank].read().decode(errors="replace").strip().splitlines()[-1:]
            raise UserError(f"real run failed: {_describe(rank, code or 0)}: {' '.join(tail)}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise UserError(f"real run did not finish within {timeout_s:.0f} s; stopped all ranks")
        time.sleep(0.05)


def run_real(spec: dict, nproc: int, timeout_s: float) -> list[dict]:
    """Run the real training described by ``spec``; return each rank's measurements."""
    import json

    with tempfile.TemporaryDirectory(prefix="fsdpsim-validate-") as tmp:
        spec = dict(spec, out_dir=tmp)
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        run_ranks("validation.worker", [str(spec_path)], nproc, timeout_s)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(nproc)]
