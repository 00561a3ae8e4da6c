"""``validation.fake_memory``'s measurement run in a child process of its own.

Split from ``validation.fake_memory``, whose measurement leaves a destroyed process group and
global fake-mode state behind, so every caller that measures more than once (``--memory-only``,
the offload section, the tests and the bench) runs each measurement here, as
``python -m validation.fake_memory``, and reads back the one JSON object it prints.
"""

import json
import os
import time
from pathlib import Path
from typing import Any

from sim.childproc import ChildTimeout, run_module
from sim.errors import UserError


def measure_fake_memory_subprocess(
    scenario_path: str, overrides: list[str], timeout_s: float, detail: bool = False
) -> dict[str, Any]:
    """``measure_fake_memory`` in a ``python -m validation.fake_memory`` child of its own, forked
    from a server that imported torch and transformers once (``sim.childproc``).

    Adds ``process_wall_s`` (the child's whole run; the server's imports only in a process's
    first) and ``max_rss_bytes`` (the child's peak resident memory, the imported packages
    included). A failing or timed-out child raises a UserError.
    """
    args = [str(scenario_path)]
    for text in overrides:
        args += ["--set", text]
    if detail:
        args.append("--detail")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:  # forked from a server that imported torch and transformers once (sim.childproc)
        proc = run_module(
            "validation.fake_memory",
            args,
            env=env,
            cwd=root,
            timeout_s=timeout_s,
            preload=("validation.fake_memory",),
        )
    except ChildTimeout:
        raise UserError(
            f"fake memory measurement of {scenario_path} {' '.join(overrides)} timed out after {timeout_s:.0f} s"
        ) from None
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise UserError(
            f"fake memory measurement of {scenario_path} {' '.join(overrides)} failed "
            f"(exit code {proc.returncode}):\n{tail}"
        )
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise UserError(
            f"fake memory measurement of {scenario_path}: no JSON in the child's output"
        ) from None
    result["process_wall_s"] = time.perf_counter() - start
    return result
