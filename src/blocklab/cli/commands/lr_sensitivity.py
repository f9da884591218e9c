"""`blocklab lr-sensitivity` (alias `blocklab lr-sweep`): learning-rate sensitivity
with and without QK-norm (ex. 11).

The study, its protocols and its decision rule live in
`blocklab.experiments.lr_sensitivity`.
"""

from __future__ import annotations

import argparse
import sys

import jax
from tqdm.auto import tqdm

from ..._io import check_writable
from ..._validate import ConfigError
from ...experiments import lr_sensitivity as study
from ...experiments._render import dumps
from ...experiments._seeds import MAX_SEED, check_seed
from .._format import minutes
from . import add_no_progress, add_out_dir

NAME = "lr_sensitivity"
ALIASES = ("lr-sweep",)
HELP = "learning-rate sensitivity of CharLM with and without QK-norm (exercise 11)"
OUTPUT_DIRS = ("out",)
SIZES = ("steps", "record_every", "num_hiddens", "num_blks", "batch_size", "seq_len")

EPILOG = (
    "Runs that diverge (high rates) are part of the result, not a failure: they are "
    "frozen at their last finite model, print as 'diverged' (null in --json, named "
    "in the 'diverged' field) and the exit status is 0. Exit status 2: bad "
    "arguments (checked before any training); 1: a failure while working. The "
    "full protocol takes hours on a 2-core CPU; --quick runs a reduced one."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true",
        help="the reduced protocol 'quick' instead of the full one",
    )  # fmt: skip
    parser.add_argument(
        "--lrs", nargs="+", type=float, default=None,
        help="distinct positive learning rates (default: 10^-4, 10^-3.5, ..., 10^-1)",
    )  # fmt: skip
    for name in SIZES:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None,
            help="override the protocol's value (>= 1)",
        )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="a non-negative int seed")
    add_out_dir(parser, "lr_sensitivity")
    add_no_progress(parser)


def protocol_of(args: argparse.Namespace) -> study.LRProtocol:
    """The protocol of the command line: `quick` or `full`, with any overrides."""
    base = study.QUICK if args.quick else study.FULL
    changes = {n: getattr(args, n) for n in SIZES if getattr(args, n) is not None}
    for name, value in changes.items():
        if value < 1:
            raise ConfigError(
                f"blocklab lr-sensitivity: --{name.replace('_', '-')} must be >= 1, "
                "got "
                f"{value}."
            )
    return base.replace(**changes) if changes else base


def validate(args: argparse.Namespace) -> None:
    """Every value checked before any training."""
    owner = "blocklab lr-sensitivity"
    protocol_of(args)
    check_seed(owner, "--seed", args.seed)
    if args.seed >= MAX_SEED:  # the data key is seed + 1
        raise ConfigError(
            f"{owner}: --seed must lie in [0, {MAX_SEED - 1}] (the data order uses "
            f"seed + 1), got {args.seed}."
        )
    for path in study.figure_paths(args.out):  # files inside --out
        check_writable(path, owner=owner, name="--out figure")
    if args.lrs is not None:
        study._check_lrs(owner, args.lrs)


def estimate(args: argparse.Namespace) -> str:
    """The line `blocklab` prints before the run (stderr)."""
    protocol = protocol_of(args)
    lrs = tuple(args.lrs) if args.lrs else study.LRS
    return (
        f"protocol {'quick' if args.quick else 'full'}, {len(lrs)} rates x 2 "
        f"models x {protocol.steps} steps, about "
        f"{minutes(study.estimate_seconds(protocol, lrs))} on 2 CPU cores"
    )


def warn_if_slow(protocol: study.LRProtocol, lrs) -> None:
    """On a CPU backend, say on stderr how long a large study will take."""
    line = study.slow_warning(protocol, lrs)
    if line is not None and jax.default_backend() == "cpu":
        tqdm.write(line, file=sys.stderr)  # keeps any progress bar intact


def run(args: argparse.Namespace) -> int:
    validate(args)
    protocol = protocol_of(args)
    lrs = tuple(args.lrs) if args.lrs else study.LRS
    warn_if_slow(protocol, lrs)
    result = study.run_study(
        protocol, lrs, seed=args.seed, progress=not (args.no_progress or args.json)
    )
    paths = result.figures(args.out)
    if args.json:
        print(dumps(result.to_json()))
        return 0
    print(protocol.describe(lrs) + "\n")
    print(result.table())
    print(
        "\nlearning-rate sensitivity: "
        + ", ".join(f"{m} {result.sensitivity[m]:.3f}" for m in study.MODELS)
    )
    print("\n" + result.explanation())
    print("\nplots: " + ", ".join(str(p) for p in paths))
    return 0
