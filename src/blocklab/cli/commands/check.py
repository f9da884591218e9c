"""`blocklab check`: the chapter's identities and closed forms against the library.

The study is `blocklab.experiments.check.run_check` (its module docstring
describes the four kinds of rows and their tolerances).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..._validate import check_int
from ...experiments import check as study
from ...experiments._render import dumps

NAME = "check"
HELP = "the chapter's identities and closed forms, checked against the library"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds for the spread predictions, at least 2 (default 4, or 8 with "
        "--full)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="the report's table: more seeds, the alpha = 0.7 / 0.5 runs, every "
        "block configuration and the chapter's 128 MiB timing array (minutes)",
    )


def validate(args: argparse.Namespace) -> None:
    check_int("blocklab check", "--seeds", args.seeds, min=2, optional=True)


def run(args: argparse.Namespace) -> int:
    seeds = args.seeds if args.seeds is not None else 8 if args.full else 4
    result = study.run_check(seeds=seeds, quick=not args.full)
    if args.json:
        print(dumps(result.to_json()))
    else:
        print(result.table())
    return 0


def report_estimate(*, quick: bool) -> float:
    """Seconds on 2 idle CPU cores (measured: 138 s for the report's 8 seeds)."""
    return 80.0 if quick else 140.0


def report_section(out_dir: Path, *, quick: bool) -> str:
    del out_dir
    return study.run_check(seeds=4 if quick else 8, quick=quick, gpt1=True).section()
