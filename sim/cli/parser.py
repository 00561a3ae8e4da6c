"""The one argument-parser class of the command line, and the flags several verbs share."""

import argparse
from typing import NoReturn

from sim.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are a ``UserError``: one line naming the flag, exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog.removeprefix('fsdpsim ')}: {message}")


def add_set_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """``--set SECTION.KEY=VALUE`` (repeatable), collected in ``args.overrides``."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help
    )


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from '4096', '1K', '64M', '1G' (binary units, as nccl-tests' -b/-e)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in SIZE_UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)] if unit else t) * SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 1K, 64M, 1G)") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole positive number of bytes: {text!r}")
    return int(value)
