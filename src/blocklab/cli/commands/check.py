"""`blocklab check`: the chapter's identities and closed forms against the library.

The study is `blocklab.experiments.check.run_check` (its module docstring
describes the four kinds of rows and their tolerances).
"""

from __future__ import annotations

import argparse

from ..._validate import check_int
from ...experiments import check as study
from ...experiments._render import dumps
from .._format import minutes
from . import add_num_seeds, num_seeds_of

NAME = "check"
HELP = "the chapter's identities and closed forms, checked against the library"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_num_seeds(
        parser,
        help="seeds 0..N-1 for the spread predictions, N >= 2 (default 4, or 8 "
        "with --full)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="the report's table: more seeds, the alpha = 0.7 / 0.5 runs, every "
        "block configuration and the chapter's 128 MiB timing array (minutes)",
    )


def _num_seeds(args: argparse.Namespace) -> int:
    return num_seeds_of(args, 8 if args.full else 4)


def estimate(args: argparse.Namespace) -> str:
    """The line `blocklab` prints before the run (stderr): the report's
    calibration (its table is `--full`)."""
    seconds = study.report_estimate(quick=not args.full)
    return f"{_num_seeds(args)} seeds, about {minutes(seconds)} on 2 CPU cores"


def validate(args: argparse.Namespace) -> None:
    check_int("blocklab check", "--num-seeds", _num_seeds(args), min=2)


def run(args: argparse.Namespace) -> int:
    result = study.run_check(num_seeds=_num_seeds(args), quick=not args.full)
    if args.json:
        print(dumps(result.to_json()))
    else:
        print(result.table())
    return 0
