"""`blocklab proxies`: learning-rate sensitivity vs width and depth for the
interventions of Wortsman et al. (2023), next to the paper's findings.

The study and its protocols live in `blocklab.experiments.proxies`.
"""

from __future__ import annotations

import argparse

from ...experiments import proxies as study
from .._format import minutes
from . import add_no_progress, add_out_dir, add_protocol, print_with_figures

NAME = "proxies"
HELP = "small-scale proxies: LR sensitivity vs width/depth per intervention"
OUTPUT_DIRS = ("out",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_protocol(
        parser, study.PROTOCOLS,
        help="cpu: about ten minutes on 2 cores; full: an accelerator; quick: minutes",
    )  # fmt: skip
    parser.add_argument(
        "--variants", nargs="+", choices=tuple(study.VARIANTS),
        default=list(study.VARIANTS), help="interventions to run (default: all)",
    )  # fmt: skip
    add_out_dir(parser, "proxies")
    add_no_progress(parser)


def estimate(args: argparse.Namespace) -> str:
    """The line `blocklab` prints before the run (stderr)."""
    p = study.PROTOCOLS[args.protocol]
    seconds = study.estimate_seconds(p, len(args.variants))
    return (
        f"protocol {args.protocol}, {len(args.variants)} variants, about "
        f"{minutes(seconds)} on 2 CPU cores"
    )


def run(args: argparse.Namespace) -> int:
    result = study.run_study(
        study.PROTOCOLS[args.protocol], args.variants, progress=not args.no_progress
    )
    return print_with_figures(
        args, result, result.table, result.logit_table, result.findings_table
    )
