"""`blocklab plan`: per-device bytes of a model on a mesh, without allocating it."""

from __future__ import annotations

import argparse

from ...experiments import plan as study
from ...experiments._render import dumps
from ...training.placement import parse_mesh

NAME = "plan"
HELP = (
    "per-device bytes of parameters, optimizer state and temporaries of a model "
    "on a mesh (blocklab plan --config llama3-8b --mesh data=8,model=4)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="PRESET_OR_PATH",
        help=f"a preset ({', '.join(sorted(study.PRESET_CONFIGS))}) or a JSON file "
        "of DecoderConfig fields",
    )  # fmt: skip
    parser.add_argument(
        "--mesh", nargs="+", required=True, metavar="AXES",
        help="one or more meshes, each like data=8,model=4",
    )  # fmt: skip
    parser.add_argument(
        "--rules", default="fsdp",
        help="a sharding preset: fsdp, tp, ep, dp, or a '+' combination (fsdp+tp)",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", choices=("bf16", "float32"), default="bf16")
    parser.add_argument(
        "--compile", action="store_true",
        help="also compile the training step for each mesh (simulated CPU devices "
        "in a child process) and report its temporaries (activations, gradients)",
    )  # fmt: skip


def validate(args: argparse.Namespace) -> None:
    study.config_of(args.config)
    for mesh in args.mesh:
        parse_mesh(mesh)


def run(args: argparse.Namespace) -> int:
    results = [
        study.plan(
            args.config,
            mesh,
            rules=args.rules,
            batch=args.batch,
            seq_len=args.seq_len,
            precision=args.precision,
            compile=args.compile,
        )  # fmt: skip
        for mesh in args.mesh
    ]
    if args.json:
        print(dumps({"plans": [r.to_json() for r in results]}))
        return 0
    print(study.plans_table(results))
    return 0
