"""`blocklab activations` (alias `blocklab train`): the chapter's GELU vs SwiGLU
comparison (and any other acts); the study is `blocklab.experiments.activations`."""

from __future__ import annotations

import argparse

from ..._validate import ConfigError
from ...experiments import activations as study
from ...experiments._render import dumps
from ...experiments._seeds import check_seeds
from ...nn.ffn import ACTS
from .._format import minutes
from . import add_no_progress

NAME = "activations"
ALIASES = ("train",)
HELP = "train CharLM on the Time Machine with each FFN activation (chapter 11.1.4.2)"
OUTPUT_FILES = ("png",)

EPILOG = (
    "A run whose loss turns non-finite is frozen at its last finite model and "
    "reported, not raised: its later checkpoints print as 'diverged' (null in "
    "--json, with the run named in the 'diverged' field) and the exit status is "
    "still 0, because a diverged run is a result of the protocol. Exit status 2: "
    "bad arguments (checked before any training); 1: a failure while working."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--act", nargs="+", choices=ACTS, default=["gelu", "swiglu"],
        help="the FFN activations to compare (default: gelu swiglu)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps (>= 1)")
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0],
        help="distinct non-negative int seeds (default: 0)",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW rate (> 0)")
    parser.add_argument(
        "--batch-size", type=int, default=64,
        help="sequences per step (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--num-hiddens", type=int, default=128,
        help="model width, a multiple of --num-heads (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--num-heads",
        type=int,
        default=4,
        help="attention heads (default: %(default)s)",
    )
    parser.add_argument(
        "--num-blks",
        type=int,
        default=2,
        help="transformer blocks (default: %(default)s)",
    )
    parser.add_argument(
        "--seq-len", type=int, default=128,
        help="sequence length (characters per training sequence; --steps counts "
        "optimizer steps)",
    )  # fmt: skip
    parser.add_argument(
        "--png", default="train_losses.png",
        help="where to write the loss curves (default: %(default)s)",
    )  # fmt: skip
    add_no_progress(parser)


def _options(args: argparse.Namespace) -> dict:
    return dict(
        num_hiddens=args.num_hiddens, num_heads=args.num_heads, num_blks=args.num_blks,
        seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
    )  # fmt: skip


def validate(args: argparse.Namespace) -> None:
    """Every value checked before any training (one rule for seeds, see `_seeds`)."""
    owner = "blocklab activations"
    if len(set(args.act)) != len(args.act):
        raise ConfigError(f"{owner}: --act must be distinct, got {args.act}.")
    check_seeds(args.seeds, name="--seeds", _owner=owner)
    for name in ("steps", "batch_size", "num_hiddens", "num_heads", "num_blks",
                 "seq_len"):  # fmt: skip
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(
                f"{owner}: --{name.replace('_', '-')} must be >= 1, got {value}."
            )
    if not args.lr > 0 or args.lr == float("inf"):
        raise ConfigError(f"{owner}: --lr must be a finite rate > 0, got {args.lr}.")
    if args.num_hiddens % args.num_heads:
        raise ConfigError(
            f"{owner}: --num-hiddens must be a multiple of --num-heads, got "
            f"{args.num_hiddens} and {args.num_heads}."
        )


def estimate(args: argparse.Namespace) -> str:
    """The line `blocklab` prints before the run (stderr): the report's
    calibration (0.26 s per step and run at the default size, plus
    compilation), scaled by tokens x width^2."""
    scale = (args.batch_size * args.seq_len) / (64 * 128) * (
        args.num_blks * args.num_hiddens**2) / (2 * 128**2)  # fmt: skip
    seconds = len(args.act) * len(args.seeds) * args.steps * 0.26 * scale + 20
    return (
        f"{len(args.act)} activations x {len(args.seeds)} seeds x {args.steps} "
        f"steps, about {minutes(seconds)} on 2 CPU cores"
    )


def run(args: argparse.Namespace) -> int:
    validate(args)
    result = study.compare_activations(
        args.act, args.seeds, args.steps,
        progress=not (args.no_progress or args.json), **_options(args),
    )  # fmt: skip
    result.plot(args.png)  # --png names the file; figures(out_dir) picks its own
    if args.json:
        print(dumps(result.to_json()))
        return 0
    print(
        f"CharLM, seeds {args.seeds}: training loss averaged over the "
        f"{result.window} steps before each checkpoint (mean ± std over seeds)\n"
    )
    print(result.table())
    for d in result.diverged:
        print(f"\n{d['act']}, seed {d['seed']}: diverged at step {d['step']}")
    print(f"\nloss curves: {args.png}")
    return 0
