"""Start N ranks of ``python -m validation.worker`` on this machine (gloo), as torchrun would."""

import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from calibrate.launch import describe, free_port, stop, wait_all, worker_env
from sim.errors import UserError


def run_ranks(module: str, args: list[str], nproc: int, timeout_s: float) -> None:
    """Run ``python -m module *args`` as ``nproc`` ranks; raise UserError if one fails or hangs."""
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
            raise UserError(f"real run did not finish within {timeout_s:.0f} s; stopped all ranks") from None
        except BaseException:
            stop(procs)
            raise
        if failed:
            stop(procs)
            rank, code = failed[0]
            logs[rank].seek(0)
            tail = logs[rank].read().decode(errors="replace").strip().splitlines()[-1:]
            raise UserError(f"real run failed: {describe(rank, code)}: {' '.join(tail)}")


def run_real(spec: dict, nproc: int, timeout_s: float) -> list[dict]:
    """Run the real training described by ``spec``; return each rank's measurements."""
    import json

    with tempfile.TemporaryDirectory(prefix="fsdpsim-validate-") as tmp:
        spec = dict(spec, out_dir=tmp)
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        run_ranks("validation.worker", [str(spec_path)], nproc, timeout_s)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(nproc)]
