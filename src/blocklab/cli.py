"""The `blocklab` console script: `blocklab report` and one command per experiment."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .commands import COMMANDS

__all__ = ["main", "build_parser"]


def _command_modules():
    return [importlib.import_module(f"blocklab.commands.{name}") for name in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `blocklab` with every subcommand registered."""
    from . import report

    parser = argparse.ArgumentParser(
        prog="blocklab",
        description="The transformer block in JAX: build, train, diagnose, verify.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in [report, *_command_modules()]:
        p = sub.add_parser(
            module.NAME.replace("_", "-"), help=module.HELP, description=module.HELP
        )
        module.add_arguments(p)
        p.add_argument(
            "--json",
            action="store_true",
            help="print the results as one JSON object instead of a table",
        )
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse `argv` (default `sys.argv[1:]`) and run the subcommand."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
