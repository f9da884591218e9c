"""`blocklab mup`: the μP coordinate check and the learning-rate transfer study.

The study and its protocols live in `blocklab.experiments.mup`.
"""

from __future__ import annotations

import argparse

from ...experiments import mup as study
from ...experiments._render import dumps

NAME = "mup"
HELP = "μP: coordinate check (both parametrizations) and learning-rate transfer"
OUTPUT_DIRS = ("out",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--protocol", choices=sorted(study.PROTOCOLS), default="cpu",
        help="cpu: about ten minutes on 2 cores, with the transfer study; full: "
        "an accelerator; report/quick: the coordinate check only",
    )  # fmt: skip
    parser.add_argument(
        "--out", default="mup", metavar="DIR",
        help="folder for the PNG plots (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    result = study.run_study(
        study.PROTOCOLS[args.protocol], progress=not args.no_progress
    )
    paths = result.figures(args.out)
    if args.json:
        print(dumps({**result.to_json(), "figures": [str(p) for p in paths]}))
        return 0
    print(result.table())
    print("\nfigures: " + ", ".join(str(p) for p in paths))
    return 0
