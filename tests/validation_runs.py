"""``fsdpsim validate`` of the tiny scenario on 2 gloo ranks, as the end-to-end validation tests run it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "scenarios" / "tiny.toml")


def validate_tiny(profile: Path, *overrides: str, extra: tuple[str, ...] = ()) -> dict:
    sets = [a for o in overrides for a in ("--set", o)] + list(extra)
    cmd = [
        sys.executable,
        "-m",
        "sim.cli.main",
        "validate",
        TINY,
        "--nproc",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--profile",
        str(profile),
        "--format",
        "json",
        *sets,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def row(result: dict, metric: str) -> dict:
    return next(r for r in result["rows"] if r["metric"] == metric)
