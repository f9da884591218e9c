"""`blocklab signal`: signal propagation at initialization (11.1.2.2, ex. 3-7)."""

from __future__ import annotations

import argparse

from ..._validate import ConfigError, check_int
from ...experiments import signal as study
from ...experiments._render import dumps
from ...interop.pretrained import pretrained_config
from ...nn.block import PLACEMENTS
from ...training.checkpoint import CheckpointError
from .._format import minutes
from . import add_num_seeds, add_out_dir, num_seeds_of

NAME = "signal"
HELP = "signal propagation at initialization: stream RMS, token spread, gradients"
OUTPUT_DIRS = ("out",)

EPILOG = (
    "--num-seeds N runs seeds 0..N-1 (N >= 1) as one vmapped program. Statistics that "
    "overflow (e.g. a large --alpha) are reported, not raised: null in --json, "
    "with the placements named in 'nonfinite', exit status 0. Exit status 2: bad "
    "arguments (checked before any work); 1: a failure while working. --arch runs "
    "the statistics on the stack of a real architecture's preset "
    "(blocklab.DecoderConfig) instead of the chapter's placements; --pretrained PATH "
    "on the architecture of a checkpoint folder (config.json, as transformers "
    "writes it), freshly initialized per seed."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS),
        help="the norm placements to measure (default: all)",
    )  # fmt: skip
    parser.add_argument("--qk-norm", action="store_true", help="QK-norm in every block")
    add_num_seeds(parser, help="seeds 0..N-1, vmapped (default 3)")
    parser.add_argument("--blocks", type=int, default=32, help="depth N")
    parser.add_argument("--alpha", type=float, default=1.0, help="scale all weights")
    parser.add_argument("--no-ffn", action="store_true", help="zero FFN sublayers")
    parser.add_argument(
        "--num-hiddens", type=int, default=256,
        help="model width, a multiple of the 4 heads (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--arch", choices=study.ARCHS, default=None,
        help="measure this architecture's stack (a DecoderConfig preset) instead",
    )  # fmt: skip
    parser.add_argument(
        "--pretrained", default=None, metavar="PATH",
        help="measure the architecture of this checkpoint folder (its config.json, "
        "freshly initialized per seed) instead",
    )  # fmt: skip
    add_out_dir(parser, "signal-figures", what="PNG figures")
    parser.add_argument(
        "--exercises", nargs="+", choices=study.EXERCISES, default=[],
        help="also run these chapter exercises",
    )  # fmt: skip


def estimate(args: argparse.Namespace) -> str:
    """The line `blocklab` prints before the run (stderr). Calibrated on 2
    CPU cores (2026-12-01): 21.5 s at the defaults (3 seeds x 4 placements x
    32 blocks, d = 256) and 30.1 s at 6 seeds, i.e. about 13 s of start-up
    and compilation plus 0.022 s per seed, placement and block at d = 256,
    scaled by (d / 256)^2."""
    if args.arch is not None or args.pretrained is not None:
        runs = 1
    else:
        runs = len(args.placements)
    work = num_seeds_of(args, 3) * runs * args.blocks * (args.num_hiddens / 256) ** 2
    line = f"about {minutes(13 + 0.022 * work)} on 2 CPU cores"
    return line + (" (exercises not included)" if args.exercises else "")


def validate(args: argparse.Namespace) -> None:
    """Every value checked before any work."""
    owner = "blocklab signal"
    check_int(owner, "--num-seeds", num_seeds_of(args, 3), min=1)
    for name in ("blocks", "num_hiddens"):
        check_int(owner, f"--{name.replace('_', '-')}", getattr(args, name), min=1)
    if args.num_hiddens % 4:
        raise ConfigError(
            f"{owner}: --num-hiddens must be a multiple of the 4 heads, got "
            f"{args.num_hiddens}."
        )
    if not 0 < args.alpha < float("inf"):
        raise ConfigError(
            f"{owner}: --alpha must be a finite scale > 0, got {args.alpha}."
        )
    if len(set(args.placements)) != len(args.placements):
        raise ConfigError(
            f"{owner}: --placements must be distinct, got {args.placements}."
        )
    if args.arch is not None and (args.qk_norm or args.no_ffn or args.alpha != 1.0):
        raise ConfigError(
            f"{owner}: --arch measures the preset as configured; --qk-norm, --no-ffn "
            "and --alpha apply to the chapter's stack only."
        )
    if args.pretrained is not None:
        others = {
            "--arch": args.arch is not None,
            "--qk-norm": args.qk_norm,
            "--no-ffn": args.no_ffn,
            "--alpha": args.alpha != 1.0,
            "--exercises": bool(args.exercises),
            "--blocks": args.blocks != 32,
            "--num-hiddens": args.num_hiddens != 256,
        }
        given = [flag for flag, on in others.items() if on]
        if given:
            raise ConfigError(
                f"{owner}: --pretrained measures the checkpoint's architecture as "
                f"configured (depth and width from its config.json); drop {given}."
            )
        try:  # a folder that is not a checkpoint fails here, before any work
            pretrained_config(args.pretrained)
        except CheckpointError as e:
            raise ConfigError(f"{owner}: --pretrained {args.pretrained}: {e}") from None


def run(args: argparse.Namespace) -> int:
    validate(args)
    num_seeds = num_seeds_of(args, 3)
    size = dict(num_seeds=num_seeds, num_blks=args.blocks, num_hiddens=args.num_hiddens)
    if args.pretrained is not None:
        result = study.signal_pretrained(args.pretrained, num_seeds=num_seeds)
    elif args.arch is not None:
        result = study.signal_arch(args.arch, num_heads=4, **size)
    else:
        result = study.signal_propagation(
            args.placements, num_heads=4, qk_norm=args.qk_norm, alpha=args.alpha,
            ffn=not args.no_ffn, **size,
        )  # fmt: skip
    result.figures(args.out)
    plain = (
        args.arch is None
        and args.pretrained is None
        and not (args.qk_norm or args.no_ffn or args.alpha != 1)
    )
    pre = result.stats.get("pre") if plain else None
    exercises = study.run_exercises(args.exercises, num_heads=4, pre=pre, **size)
    if args.json:
        out = result.to_json()
        if exercises:
            out["exercises"] = {n: ex.to_json() for n, ex in exercises.items()}
        print(dumps(out))
        return 0
    if args.pretrained is not None:
        o = result.options
        print(
            f"{args.pretrained}: {o['arch']}, {o['num_blks']} blocks, "
            f"d={o['num_hiddens']}, {o['num_heads']} heads, freshly initialized; "
            f"mean [min, max] over {num_seeds} seed(s)"
        )
        print(result.table())
        print(f"\nfigures in {args.out}/")
        return 0
    print(
        f"{args.blocks} blocks, d={args.num_hiddens}, 4 heads"
        + (f", arch {args.arch}" if args.arch else f", alpha={args.alpha:g}")
        + f"{', QK-norm' if args.qk_norm else ''}{', no FFN' if args.no_ffn else ''}; "
        f"mean [min, max] over {num_seeds} seed(s)"
    )
    print(result.table())
    for n, ex in exercises.items():
        print(f"\n{study.TITLES[n]}\n\n{ex.table()}")
    print(f"\nfigures in {args.out}/")
    return 0
