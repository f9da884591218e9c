"""`blocklab real-text`: a byte-level BPE tokenizer and a Llama-style model
trained on the shipped corpus through the token pipeline, against a
character (byte) model of the same parameter count and step budget, in
validation bits per byte; every seed of each model in one vmapped sweep. The
BPE model is saved with its tokenizer as one checkpoint folder and continues
a prompt greedily, also in `transformers` when it is installed.

The study and its protocols live in `blocklab.experiments.real_text`.
"""

from __future__ import annotations

import argparse

from ..._validate import check_int
from ...experiments import real_text as study
from ...experiments._seeds import check_seeds
from . import add_no_progress, add_out_dir, add_protocol, print_with_figures
from ._overrides import PROTOCOL_HELP, add_seeds_and_steps, study_protocol

NAME = "real_text"
HELP = "real text: byte-level BPE vs bytes in bits per byte; save, reload, generate"
OUTPUT_DIRS = ("out", "save")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_protocol(parser, study.PROTOCOLS, help=PROTOCOL_HELP)
    add_seeds_and_steps(parser, per_model=True)
    parser.add_argument(
        "--prompt", default=None, metavar="TEXT",
        help="the prompt the saved model continues (default: the protocol's)",
    )  # fmt: skip
    parser.add_argument(
        "--save", default=None, metavar="DIR",
        help="keep the BPE model and its tokenizer as a checkpoint folder here "
        "(replaced if it exists; default: a temporary folder)",
    )  # fmt: skip
    parser.add_argument(
        "--no-transformers", action="store_true",
        help="skip loading the folder in transformers (default: checked when "
        "transformers is installed)",
    )  # fmt: skip
    add_out_dir(parser, "real_text")
    add_no_progress(parser)


def validate(args: argparse.Namespace) -> None:
    owner = "blocklab real-text"
    if args.seeds is not None:
        check_seeds(args.seeds, name="--seeds", _owner=owner)
    check_int(owner, "--steps", args.steps, min=1, optional=True)
    if args.prompt is not None:
        study.RealTextProtocol("check", 1, prompt=args.prompt)


def _protocol(args: argparse.Namespace) -> study.RealTextProtocol:
    return study_protocol(study.PROTOCOLS, args, prompt=args.prompt)


def estimate(args: argparse.Namespace) -> str:
    """One line: the protocol and its expected time on 2 CPU cores."""
    p = _protocol(args)
    seconds = study.estimate_seconds(p)
    time = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return (
        f"protocol {p.name}, {p.steps} steps x {len(p.seeds)} seeds per model; "
        f"about {time} on 2 CPU cores"
    )


def run(args: argparse.Namespace) -> int:
    protocol = _protocol(args)
    result = study.run_real_text(
        protocol,
        folder=args.save,
        check_transformers=False if args.no_transformers else None,
        progress=not (args.no_progress or args.json),
    )
    return print_with_figures(args, result, result.table)
