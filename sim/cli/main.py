"""``fsdpsim``: run a scenario, calibrate a machine, validate against real FSDP2, sweep and tune.

User mistakes print one line on stderr and exit with code 2; nothing half-written is left.
"""

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import cast

from sim.cli import cluster, comm, presets, profiles, run
from sim.cli.parser import ArgumentParser
from sim.errors import UserError

# verbs whose modules own their flags: ``main(argv) -> exit code``, imported only when asked for
DELEGATED = {
    "calibrate": "calibrate.cli",
    "validate": "validation.cli",
    "sweep": "sim.cli.sweep",
    "tune": "sim.cli.tune",
}


def _delegate(module: str, argv: list[str]) -> int:
    """Hand the rest of the command line to a module with its own flags."""
    try:
        cli = importlib.import_module(module)
    except ModuleNotFoundError as e:
        extra = "torch" if module.split(".")[0] in ("calibrate", "validation") else "dev"
        raise UserError(f"`fsdpsim` needs {e.name!r} for this command: pip install -e '.[{extra}]'") from None
    return int(cli.main(argv))


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="fsdpsim", description=__doc__)
    # each verb module adds its parser (all of this class: a mistake is one line, exit 2)
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True),
    )
    run.add_parser(sub)
    sub.add_parser("presets", help="list model presets and built-in hardware profiles")
    profiles.add_parser(sub)
    cluster.add_parser(sub)
    comm.add_parser(sub)
    sub.add_parser("calibrate", help="measure collectives and per-unit compute (see `fsdpsim calibrate -h`)")
    sub.add_parser("validate", help="compare a prediction with a real FSDP2 run (see `fsdpsim validate -h`)")
    sub.add_parser("sweep", help="run a grid of scenario variants (see `fsdpsim sweep -h`)")
    sub.add_parser("tune", help="search for the fastest configuration that fits (see `fsdpsim tune -h`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in DELEGATED:
        return _guard(lambda: _delegate(DELEGATED[argv[0]], argv[1:]))
    return _guard(lambda: _run_verb(argv))


def _run_verb(argv: list[str]) -> int:
    args = _parser().parse_args(argv)  # a mistake in the flags is a UserError: one line, exit 2
    commands = {
        "run": run.main,
        "presets": presets.main,
        "profiles": profiles.main,
        "cluster": cluster.main,
        "comm": comm.main,
    }
    return int(commands[args.command](args))


def _guard(action: Callable[[], int]) -> int:
    try:
        return int(action())
    except UserError as e:
        print(f"fsdpsim: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fsdpsim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
