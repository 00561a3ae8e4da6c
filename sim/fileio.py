"""Files in and out: a result is either completely written or not there at all, and a JSON file
that cannot be read is one clear ``UserError`` naming it. The one atomic writer and the one JSON
reader of the project (calibration and validation use them too)."""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from sim.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, flushed to disk,
    then ``os.replace``: a reader sees the old file or the new one, never half of one."""
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """``write_text_atomic`` for bytes (a compressed trace)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, data: Any) -> None:
    """``data`` as indented JSON (NaN and infinity refused), written atomically."""
    write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def read_json(path: str | Path, what: str) -> Any:
    """The JSON document at ``path``; a missing or malformed file is a ``UserError`` naming it
    (``what`` says what the file should have been, e.g. "profile")."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such {what} file")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{p}: not a valid JSON {what} ({e})") from None
