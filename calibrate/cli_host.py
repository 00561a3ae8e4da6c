"""``calibrate host``: measure the host side into a profile's ``node`` section, atomically."""

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from calibrate.profile_io import write_profile_atomic
from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.registry import read_profile_document

NODE_FIELDS = (
    "host_to_device_Bps",
    "device_to_host_Bps",
    "pageable_host_to_device_Bps",
    "pageable_device_to_host_Bps",
    "nvme_read_Bps",
    "nvme_write_Bps",
    "cpu_adam_s_per_param",
    "cpu_torch_adamw_s_per_param",
    "cpu_torch_sgd_s_per_param",
)


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "host", help="measure host copies, the CPU optimizer and NVMe into a profile's node section"
    )
    p.add_argument("--profile", help="profile JSON to update (atomically); or give --base and --out")
    p.add_argument("--base", help="built-in profile (or file) to start from, with --out")
    p.add_argument("--out", help="profile JSON to write, with --base")
    p.add_argument(
        "--ranks-per-node", type=int, default=1, help="ranks sharing this host's cores (default 1)"
    )
    p.add_argument("--nvme-path", help="a folder on the NVMe drive to time (ZeRO-Infinity's nvme_path)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")


def _document(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.profile and not (args.base or args.out):
        return read_profile_document(args.profile), args.profile
    if args.base and args.out and not args.profile:
        if args.base in BUILTIN_PROFILES:
            return json.loads(json.dumps(BUILTIN_PROFILES[args.base])), args.out
        return read_profile_document(args.base), args.out
    raise UserError("calibrate host: give --profile FILE, or --base PROFILE and --out FILE")


def run_host_command(args: argparse.Namespace, command: str) -> None:
    from pathlib import Path

    from calibrate.host import measure_host

    if args.ranks_per_node < 1 or args.reps < 1:
        raise UserError("--ranks-per-node and --reps must be >= 1")
    nvme = Path(args.nvme_path) if args.nvme_path else None
    if nvme is not None and not nvme.is_dir():
        raise UserError(f"--nvme-path {args.nvme_path}: not a folder")
    doc, out = _document(args)
    figures = measure_host(reps=args.reps, ranks_per_node=args.ranks_per_node, nvme_path=nvme)
    node = dict(doc.get("node", {}))
    node.update({k: figures[k] for k in NODE_FIELDS if k in figures})
    doc["node"] = node
    doc.setdefault("source", {})["host"] = {
        **{k: v for k, v in figures.items() if k not in NODE_FIELDS or k in node},
        "method": "calibrate host (calibrate/host.py)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
    }
    write_profile_atomic(out, doc)
    shown = ", ".join(f"{k} {figures[k]:.3g}" for k in NODE_FIELDS if k in figures)
    print(f"host: {shown}; wrote {out}")
    if "cpu_adam_unavailable" in figures:
        print(f"DeepSpeed CPU Adam not measured: {figures['cpu_adam_unavailable']}")
