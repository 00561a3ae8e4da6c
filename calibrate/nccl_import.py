"""``calibrate comm --from-nccl-tests FILE...``: a profile whose collectives come from nccl-tests.

nccl-tests measures collectives only, so the device and backend sections come from a base
profile: ``--base`` (a built-in name or a profile file), else the existing ``--out`` file.
The imported curves replace the base's curves of the same key; the topology links are refit
from the imported curves where they cover them and kept from the base where they do not.
"""

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from calibrate.nccl_tests import curves_from_runs, parse_file
from calibrate.profile_io import topology_links, write_profile_atomic
from calibrate.records import Curve
from calibrate.topology_fit import attach_nccl_fit
from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.registry import profile_document, read_profile_document


def _base_document(base: str | None, out: Path) -> tuple[dict[str, Any], str]:
    if base is not None:
        return profile_document(base, where="--base"), base
    if out.is_file():
        return read_profile_document(out), str(out)
    raise UserError(
        "nccl-tests outputs carry no device data: pass --base with a built-in profile "
        f"({', '.join(BUILTIN_PROFILES)}) or a profile file, or --out an existing profile"
    )


def _merge_topology(doc: dict[str, Any], curves: list[Curve]) -> dict[str, str]:
    links, notes = topology_links(curves, None)
    kinds = {c.key.spans_nodes for c in curves}
    for name, spans in (("intra_node", False), ("inter_node", True)):
        if spans in kinds:
            doc["topology"][name] = links[name]
        else:
            notes[name] = "kept from the base profile (no such nccl-tests run)"
    return notes


def import_nccl_tests(
    files: list[Path], *, out: Path, name: str, base: str | None, command: str, cluster: str | None = None
) -> None:
    runs = [parse_file(f) for f in files]
    curves, skipped = curves_from_runs(runs)
    if not curves:
        raise UserError("no usable nccl-tests results (types: " + "; ".join(skipped) + ")")
    doc, base_name = _base_document(base, out)
    keys = {(c.key.collective, c.key.group_size, c.key.dtype, c.key.spans_nodes) for c in curves}
    kept = [
        c
        for c in doc.get("collectives", [])
        if (c["collective"], c["group_size"], c["dtype"], c["spans_nodes"]) not in keys
    ]
    doc["collectives"] = kept + [c.to_dict() for c in curves]
    notes = _merge_topology(doc, curves)
    doc["name"], doc["calibrated"] = name, True
    doc["source"] = {
        **doc.get("source", {}),
        "method": "nccl-tests import: collectives and topology from nccl-tests outputs; device and backend from "
        + base_name,
        "nccl_tests_files": [str(f) for f in files],
        "nccl_version": next((r.nccl_version for r in runs if r.nccl_version), None),
        "device_name": runs[0].device_name,
        "world_size": max(r.ranks for r in runs),
        "nodes": max(len(r.hosts) for r in runs),
        "skipped": skipped,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "topology": notes,
    }
    doc["source"]["nccl_fit"] = attach_nccl_fit(doc, cluster, str(out))
    write_profile_atomic(out, doc)
    print(
        f"wrote {out} ({len(curves)} curves from {len(files)} nccl-tests files); {doc['source']['nccl_fit']}"
    )
