"""Reading and writing profile files: validated by ``sim.hardware.profile``, written atomically.

A profile is written to a temporary file beside the target, flushed and fsynced, then moved
over the target with ``os.replace`` (atomic on POSIX): a reader sees the old file or the new
one, never half of one. Before writing, the document is validated with the simulator's own
loader, so calibration never leaves a profile the simulator would refuse.
"""

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from calibrate.records import Curve
from sim.errors import UserError
from sim.hardware.parse import profile_from_dict
from sim.hardware.schema import SCHEMA_VERSION


def write_profile_atomic(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    profile_from_dict(data, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_profile_dict(path: str | Path) -> dict[str, Any]:
    """The JSON object of a profile file, validated by ``sim.profile.profile_from_dict``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such profile file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a valid JSON profile ({e})") from None
    profile_from_dict(data, str(path))
    return data


def _preferred(curves: Sequence[Curve], spans_nodes: bool, dtype: str | None) -> Curve | None:
    """The all-gather curve of the largest group (then reduce-scatter, all-reduce, all-to-all)."""
    for collective in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        cands = [c for c in curves if c.key.collective == collective and c.key.spans_nodes == spans_nodes]
        if dtype is not None and any(c.key.dtype == dtype for c in cands):
            cands = [c for c in cands if c.key.dtype == dtype]
        if cands:
            return max(cands, key=lambda c: c.key.group_size)
    return None


def _describe(c: Curve) -> str:
    return f"fit of {c.key.collective} {c.key.dtype} over {c.key.group_size} ranks"


def topology_links(curves: Sequence[Curve], dtype: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """``topology.intra_node`` / ``inter_node`` link models from the curves, and where each came from.

    A single-node run has no inter-node curve; inter_node then copies intra_node (and says so),
    which only matters to a scenario that spans nodes with this profile.
    """
    intra, inter = _preferred(curves, False, dtype), _preferred(curves, True, dtype)
    if intra is None and inter is None:
        raise UserError("no collective curves to derive the topology from")
    notes: dict[str, str] = {}
    links: dict[str, Any] = {}
    for name, curve, other in (("intra_node", intra, inter), ("inter_node", inter, intra)):
        chosen = curve or other
        assert chosen is not None
        links[name] = {"latency_s": chosen.fit.latency_s, "bus_bw_Bps": chosen.fit.bus_bw_Bps}
        notes[name] = (
            _describe(chosen) if curve else f"not measured (no such group); copied from {_describe(chosen)}"
        )
    return links, notes


def comm_profile(
    *,
    name: str,
    curves: Sequence[Curve],
    device: dict[str, Any],
    backend: dict[str, Any],
    gpus_per_node: int,
    source: dict[str, Any],
    topology_dtype: str | None,
) -> dict[str, Any]:
    """The whole profile document of a comm calibration (no ``compute`` section yet)."""
    links, notes = topology_links(curves, topology_dtype)
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "calibrated": True,
        "source": {**source, "topology": notes},
        "device": device,
        "backend": backend,
        "topology": {"gpus_per_node": gpus_per_node, **links},
        "collectives": [c.to_dict() for c in sorted(curves, key=_curve_order)],
    }


def _curve_order(c: Curve) -> tuple[str, int, str, bool]:
    return (c.key.collective, c.key.group_size, c.key.dtype, c.key.spans_nodes)
