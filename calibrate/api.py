"""Calibration as Python functions, for validation and scripts: measure this machine with N
local ranks (``calibrate.launch`` starts them, as ``--nproc`` does) and write a profile.

Each raises ``CalibrationFailed`` when a rank fails and ``UserError`` for a bad request; the
ranks run ``python -m calibrate`` with the same arguments the command line would take.
"""

import shlex
from collections.abc import Sequence
from pathlib import Path

from calibrate.errors import CalibrationFailed
from calibrate.launch import launch


def run_local(argv: list[str], nproc: int, command: str) -> None:
    """``python -m calibrate *argv`` as ``nproc`` local ranks; ``command`` is recorded in the profile."""
    result = launch(argv, nproc, command)
    if not result.ok:
        raise CalibrationFailed(result.message)


def calibrate_comm(*, out: Path, nproc: int, max_bytes: int | None = None) -> None:
    """Measure all-gather, reduce-scatter and all-reduce over ``nproc`` local ranks into a new
    profile ``out`` (sizes up to ``max_bytes``, default the backend's)."""
    argv = ["comm", "--out", str(out)] + (["--max-bytes", str(max_bytes)] if max_bytes else [])
    run_local(argv, nproc, "calibrate " + shlex.join([*argv, "--nproc", str(nproc)]))


def calibrate_compute(*, scenario: str, profile: Path, nproc: int, overrides: Sequence[str] = ()) -> None:
    """Measure the per-unit compute of ``scenario`` (with ``overrides``) on ``nproc`` local ranks
    computing at once, as in training, and add it to the existing ``profile``."""
    argv = ["compute", scenario, "--profile", str(profile), *(a for o in overrides for a in ("--set", o))]
    run_local(argv, nproc, "calibrate " + shlex.join([*argv, "--nproc", str(nproc)]))
