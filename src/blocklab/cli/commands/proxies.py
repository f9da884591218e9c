"""`blocklab proxies`: learning-rate sensitivity vs width and depth for the
interventions of Wortsman et al. (2023), next to the paper's findings.

The study and its protocols live in `blocklab.experiments.proxies`.
"""

from __future__ import annotations

import argparse

from ...experiments import proxies as study
from ...experiments._render import dumps

NAME = "proxies"
HELP = "small-scale proxies: LR sensitivity vs width/depth per intervention"
OUTPUT_DIRS = ("out",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--protocol", choices=sorted(study.PROTOCOLS), default="cpu",
        help="cpu: about ten minutes on 2 cores; full: an accelerator; quick: minutes",
    )  # fmt: skip
    parser.add_argument(
        "--variants", nargs="+", choices=tuple(study.VARIANTS),
        default=list(study.VARIANTS), help="interventions to run (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--out", default="proxies", metavar="DIR",
        help="folder for the PNG plots (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    result = study.run_study(
        study.PROTOCOLS[args.protocol], args.variants, progress=not args.no_progress
    )
    paths = result.figures(args.out)
    if args.json:
        print(dumps({**result.to_json(), "figures": [str(p) for p in paths]}))
        return 0
    print(result.table())
    print()
    print(result.logit_table())
    print()
    print(result.findings_table())
    print("\nfigures: " + ", ".join(str(p) for p in paths))
    return 0
