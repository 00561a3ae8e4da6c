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
