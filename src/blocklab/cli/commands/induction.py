"""`blocklab induction`: train a small model until induction heads form, find
them by their prefix-matching score, ablate them, patch them from a clean run
into a corrupted one, and read the logit and Jacobian lenses; every seed in
one vmapped program.

The study and its protocols live in `blocklab.experiments.induction`.
"""

from __future__ import annotations

import argparse

from ..._validate import check_int
from ...experiments import induction as study
from ...experiments._seeds import check_seeds
from .._format import minutes
from . import add_no_progress, add_out_dir, add_protocol, print_with_figures
from ._overrides import PROTOCOL_HELP, add_seeds_and_steps, study_protocol

NAME = "induction"
HELP = "induction heads: train, find (prefix matching), ablate, patch, lenses"
OUTPUT_DIRS = ("out",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_protocol(parser, study.PROTOCOLS, help=PROTOCOL_HELP)
    add_seeds_and_steps(parser)
    add_out_dir(parser, "induction")
    add_no_progress(parser)


def validate(args: argparse.Namespace) -> None:
    if args.seeds is not None:
        check_seeds(args.seeds, name="--seeds", _owner="blocklab induction")
    check_int("blocklab induction", "--steps", args.steps, min=1, optional=True)


def estimate(args: argparse.Namespace) -> str:
    """The line `blocklab` prints before the run (stderr)."""
    p = study_protocol(study.PROTOCOLS, args)
    return (
        f"protocol {args.protocol}, {len(p.seeds)} seeds x {p.steps} steps, about "
        f"{minutes(study.estimate_seconds(p))} on 2 CPU cores"
    )


def run(args: argparse.Namespace) -> int:
    protocol = study_protocol(study.PROTOCOLS, args)
    result = study.run_induction(protocol, progress=not args.no_progress)
    return print_with_figures(args, result, result.table)
