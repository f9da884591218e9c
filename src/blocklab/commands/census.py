"""`blocklab census`: parameter counts of the chapter's blocks, per part."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

from ..block import PLACEMENTS, TransformerBlock
from ..census import census
from ..ffn import ACTS, FeedForward
from ..norms import NORMS

NAME = "census"
HELP = "parameter census of transformer blocks (attention, FFN, norms, total)"

#: The chapter's configurations: label -> TransformerBlock options.
CHAPTER_BLOCKS = {
    "default (pre, rms, swiglu)": {},
    "2017 (post, layer, gelu, bias)": dict(
        norm="layer", act="gelu", placement="post", bias=True
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-hiddens", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument(
        "--act",
        nargs="+",
        choices=ACTS,
        default=None,
        help="census of the default block with each of these acts",
    )
    parser.add_argument("--norm", choices=sorted(NORMS), default="rms")
    parser.add_argument("--placement", choices=PLACEMENTS, default="pre")
    parser.add_argument("--bias", action="store_true")


def block_census(num_hiddens: int, num_heads: int, **options) -> dict[str, int]:
    """`census` of an abstract `TransformerBlock(num_hiddens, num_heads, **options)`.

    `eqx.filter_eval_shape` builds the block without allocating or drawing
    weights, so the census of a d = 4096 block costs nothing.
    """
    import equinox as eqx

    blk = eqx.filter_eval_shape(
        lambda: TransformerBlock(
            num_hiddens, num_heads, key=jax.random.key(0), **options
        )
    )
    return census(blk)


def _rows(args) -> dict[str, dict[str, int]]:
    if args.act is None:
        configs = dict(CHAPTER_BLOCKS)
    else:
        configs = {
            f"{a} ({args.placement}, {args.norm}{', bias' if args.bias else ''})": dict(
                act=a, norm=args.norm, placement=args.placement, bias=args.bias
            )
            for a in args.act
        }
    return {
        label: block_census(args.num_hiddens, args.num_heads, **opts)
        for label, opts in configs.items()
    }


def _table(rows: dict[str, dict[str, int]], d: int) -> str:
    lines = [
        "| block | attention | ffn | norms | total | total / d^2 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, c in rows.items():
        norms = sum(v for k, v in c.items() if "norm" in k)
        lines.append(
            f"| {label} | {c['attention']} | {c['ffn']} | {norms} | "
            f"{c['total']} | {c['total'] / d**2:.2f} |"
        )
    return "\n".join(lines)


def _ffn_rows(d: int) -> dict[str, int]:
    import equinox as eqx

    from ..census import count_params

    return {
        a: count_params(
            eqx.filter_eval_shape(lambda a=a: FeedForward(d, a, key=jax.random.key(0)))
        )
        for a in ACTS
    }


def run(args: argparse.Namespace) -> int:
    rows = _rows(args)
    if args.json:
        print(json.dumps({"blocks": rows, "ffn": _ffn_rows(args.num_hiddens)}))
        return 0
    print(_table(rows, args.num_hiddens))
    print()
    for act, n in _ffn_rows(args.num_hiddens).items():
        print(f"FeedForward({args.num_hiddens}, {act!r}): {n} parameters")
    return 0


def report_section(out_dir: Path, *, quick: bool) -> str:
    del out_dir, quick
    d, h = 256, 8
    rows = {label: block_census(d, h, **opts) for label, opts in CHAPTER_BLOCKS.items()}
    ffn = _ffn_rows(d)
    ffn_lines = "\n".join(
        f"| {a} | {n} | {n / (8 * d * d):.4f} |" for a, n in ffn.items()
    )
    return (
        f"## Parameter census (d = {d}, {h} heads)\n\n"
        f"{_table(rows, d)}\n\n"
        "The chapter: attention 262144, FFN 524544, total 787200 = 12.01 d^2.\n\n"
        f"| FeedForward({d}, act) | parameters | / 8 d^2 |\n"
        f"|---|---:|---:|\n{ffn_lines}\n"
    )
