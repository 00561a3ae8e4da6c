"""``fsdpsim profiles``: list the built-in hardware profiles, or print one as JSON, a template
for a profile of your own (``fsdpsim profiles show h100-sxm > my-gpu.json``, edit, then
``--set cluster.profile=my-gpu.json``)."""

import argparse
import json

from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.registry import load_profile, profile_document
from sim.outputs.display import gib


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("profiles", help="list the built-in hardware profiles, or `profiles show NAME`")
    p.add_argument("action", nargs="?", choices=("list", "show"), default="list")
    p.add_argument("name", nargs="?", help="with show: a built-in profile name or a profile file")


def main(args: argparse.Namespace) -> int:
    if args.action == "show":
        if not args.name:
            raise UserError(f"profiles show needs a profile name; built-in: {', '.join(BUILTIN_PROFILES)}")
        print(json.dumps(profile_document(args.name, where="profiles show"), indent=1))
        return 0
    print(f"{'name':<14}{'device':<34}{'memory':>12}{'bf16 peak':>12}{'matmul bf16':>13}{'HBM':>11}")
    for name in BUILTIN_PROFILES:
        d = load_profile(name).device
        matmul = d.matmul_flops.get("bf16")
        print(
            f"{name:<14}{d.name[:33]:<34}{gib(d.memory_bytes):>12}{d.peak_flops.get('bf16', 0) / 1e12:>9.0f} TF"
            f"{(f'{matmul / 1e12:.0f} TF' if matmul else '-'):>13}{d.hbm_bandwidth_Bps / 1e12:>8.2f} TB/s"
        )
    return 0
