"""`blocklab mup`: the μP coordinate check and the learning-rate transfer study.

The study and its protocols live in `blocklab.experiments.mup`.
"""

from __future__ import annotations

import argparse

from ...experiments import mup as study
from .._format import minutes
from . import add_no_progress, add_out_dir, add_protocol, print_with_figures

NAME = "mup"
HELP = "μP: coordinate check (both parametrizations) and learning-rate transfer"
OUTPUT_DIRS = ("out",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_protocol(
        parser, study.PROTOCOLS,
        help="cpu: about ten minutes on 2 cores, with the transfer study; full: "
        "an accelerator; report/quick: the coordinate check only",
    )  # fmt: skip
    add_out_dir(parser, "mup")
    add_no_progress(parser)


def estimate(args: argparse.Namespace) -> str:
    """The line `blocklab` prints before the run (stderr)."""
    p = study.PROTOCOLS[args.protocol]
    return (
        f"protocol {p.name}, about {minutes(study.estimate_seconds(p))} on 2 CPU "
        f"cores (coordinate check at widths {list(p.widths)}"
        + (f", transfer study at {list(p.transfer_widths)}" if p.transfer else "")
        + ")"
    )


def run(args: argparse.Namespace) -> int:
    result = study.run_study(
        study.PROTOCOLS[args.protocol], progress=not args.no_progress
    )
    return print_with_figures(args, result, result.table)
