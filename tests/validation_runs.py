"""``fsdpsim validate`` of the tiny scenario on 2 gloo ranks, as the end-to-end validation tests run it."""

import contextlib
import io
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "scenarios" / "tiny.toml")


def validate_tiny(profile: Path, *overrides: str, extra: tuple[str, ...] = ()) -> dict:
    """``fsdpsim validate`` in this process, as its command line runs it: its ranks fork from
    servers that imported torch and transformers once (``validation.launch``), which this test
    process then keeps for its later validations."""
    from sim.cli.main import main

    sets = [a for o in overrides for a in ("--set", o)] + list(extra)
    argv = ["validate", TINY, "--nproc", "2", "--steps", "2", "--warmup", "1"]
    argv += ["--profile", str(profile), "--format", "json", *sets]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0, err.getvalue()[-2000:]
    text = out.getvalue()
    return json.loads(text[text.index("{") :])


def row(result: dict, metric: str) -> dict:
    return next(r for r in result["rows"] if r["metric"] == metric)
