"""`blocklab census`: parameter counts of the chapter's blocks, per part."""

from __future__ import annotations

import argparse

from ...experiments import parameter_census as study
from ...experiments._render import dumps
from ...nn.block import PLACEMENTS
from ...nn.ffn import ACTS
from ...nn.normalization import NORMS

NAME = "census"
HELP = "parameter census of transformer blocks (attention, FFN, norms, total)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-hiddens", type=int, default=256, metavar="D",
        help="model width d, a multiple of --num-heads (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--num-heads", type=int, default=8, metavar="H",
        help="attention heads (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--act",
        nargs="+",
        choices=ACTS,
        default=None,
        help="census of the default block with each of these acts",
    )
    parser.add_argument(
        "--norm", choices=sorted(NORMS), default="rms",
        help="the normalizer of the --act blocks (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--placement", choices=PLACEMENTS, default="pre",
        help="where the --act blocks put their norms (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--bias", action="store_true",
        help="biases in the --act blocks' linear layers (default: none)",
    )  # fmt: skip


def _call(args: argparse.Namespace) -> study.CensusResult:
    blocks = (
        None
        if args.act is None
        else study.act_blocks(
            args.act, norm=args.norm, placement=args.placement, bias=args.bias
        )
    )
    return study.run_census(
        num_hiddens=args.num_hiddens, num_heads=args.num_heads, blocks=blocks
    )


def validate(args: argparse.Namespace) -> None:
    # Cheap (abstract blocks): running it is the most complete validation.
    args._result = _call(args)


def run(args: argparse.Namespace) -> int:
    result = getattr(args, "_result", None) or _call(args)
    if args.json:
        print(dumps(result.to_json()))
        return 0
    print(result.table())
    print()
    for act, n in result.ffn.items():
        print(f"FeedForward({result.num_hiddens}, {act!r}): {n} parameters")
    return 0
