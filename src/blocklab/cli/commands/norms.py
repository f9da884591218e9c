"""`blocklab norms`: time the normalizers against their peers and X -> 2X (ex. 9).

The study is `blocklab.experiments.norms.run_norms` (its docstring explains
the fresh and donated modes and how bandwidth is counted).
"""

from __future__ import annotations

import argparse

from ..._validate import check_int
from ...experiments import norms as study
from ...experiments._render import dumps

NAME = "norms"
HELP = "time rms_norm / layer_norm (fresh and donated) vs Equinox, Flax NNX and X -> 2X"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape",
        type=int,
        nargs="+",
        default=list(study.DEFAULT_SHAPE),
        metavar="N",
        help="shape of X, features last (default 64 512 1024)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=20,
        help="timed rounds, at least 1 (median and best are reported)",
    )
    parser.add_argument("--seed", type=int, default=0, help="a seed >= 0")


def validate(args: argparse.Namespace) -> None:
    for i, n in enumerate(args.shape):
        check_int("blocklab norms", f"--shape[{i}]", n, min=1)
    check_int("blocklab norms", "--reps", args.reps, min=1)
    check_int("blocklab norms", "--seed", args.seed, min=0)


def run(args: argparse.Namespace) -> int:
    result = study.run_norms(
        shape=args.shape, reps=args.reps, seed=args.seed, progress=not args.json
    )
    if args.json:
        print(dumps(result.to_json()))
        return 0
    print(result.table())
    print()
    print(result.summary())
    return 0
