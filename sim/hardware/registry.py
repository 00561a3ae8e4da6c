"""Where a profile comes from: a built-in name or a JSON file, resolved and validated in one place.

``load_profile`` is the simulator's only way to a ``HardwareProfile``; ``read_profile_document``
is the only reader of a profile file (calibration edits the document it returns). A file is parsed
once per content: loading the same unchanged file again (every point of a sweep) reuses it.
"""

import copy
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from sim.errors import UserError
from sim.fileio import read_json
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.parse import profile_from_dict
from sim.hardware.schema import DeviceSpec, HardwareProfile


def read_profile_document(path: str | Path) -> dict[str, Any]:
    """The JSON object of a profile file, validated (a UserError names the file and field)."""
    data = read_json(path, "profile")
    profile_from_dict(data, str(path))
    return dict(data)


def _check_exists(path: str, where: str) -> None:
    if not Path(path).is_file():
        raise UserError(
            f"{where}: {path!r} is neither a built-in profile ({', '.join(BUILTIN_PROFILES)}) nor an existing file"
        )


def profile_document(name_or_path: str, where: str = "cluster.profile") -> dict[str, Any]:
    """A fresh copy of a profile's JSON document (a built-in by name, or a file), to edit."""
    if name_or_path in BUILTIN_PROFILES:
        return copy.deepcopy(BUILTIN_PROFILES[name_or_path])
    _check_exists(name_or_path, where)
    return read_profile_document(name_or_path)


@lru_cache(maxsize=64)
def _load_file(path: str, mtime_ns: int, size: int) -> HardwareProfile:
    return profile_from_dict(read_json(path, "profile"), path)


@cache
def _load_builtin(name: str) -> HardwareProfile:
    return profile_from_dict(BUILTIN_PROFILES[name], f"built-in profile {name}")


def builtin_devices() -> dict[str, DeviceSpec]:
    """Every built-in profile's device, by profile name."""
    return {name: _load_builtin(name).device for name in BUILTIN_PROFILES}


def load_profile(name_or_path: str, where: str = "cluster.profile") -> HardwareProfile:
    """A built-in profile by name, or a JSON profile file by path."""
    if name_or_path in BUILTIN_PROFILES:
        return _load_builtin(name_or_path)
    _check_exists(name_or_path, where)
    stat = Path(name_or_path).stat()
    return _load_file(name_or_path, stat.st_mtime_ns, stat.st_size)
