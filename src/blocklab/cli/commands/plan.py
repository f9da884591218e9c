"""`blocklab plan`: per-device bytes of a model on a mesh, without allocating it."""

from __future__ import annotations

import argparse

from ..._validate import check_int
from ...experiments import plan as study
from ...experiments._render import dumps
from ...training.placement import parse_mesh

NAME = "plan"
HELP = (
    "per-device bytes of parameters, optimizer state and temporaries of a model "
    "on a mesh (blocklab plan --config llama3-8b --mesh data=8,model=4)"
)
EPILOG = (
    "A mesh axis the rules split nothing over (model under fsdp) is accepted, as "
    "train_model accepts it, and shown: the 'unused' column (JSON: unused_axes) "
    "names it, and a note names the rules that would use it (fsdp+tp). A --batch "
    "that train_model would refuse on the mesh (not a multiple of the devices "
    "along the batch's axes, data and expert) is refused."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="PRESET_OR_PATH",
        help=f"a preset ({', '.join(sorted(study.PRESET_CONFIGS))}), a checkpoint "
        "folder of any family load_pretrained reads (only its config.json is "
        "read), a transformers config.json, or a JSON file of DecoderConfig fields",
    )  # fmt: skip
    parser.add_argument(
        "--mesh", nargs="+", required=True, metavar="AXES",
        help="one or more meshes, each like data=8,model=4",
    )  # fmt: skip
    parser.add_argument(
        "--rules", default="fsdp",
        help="a sharding preset: fsdp, tp, ep, dp, or a '+' combination (fsdp+tp)",
    )  # fmt: skip
    parser.add_argument(
        "--batch", type=int, default=None,
        help="global batch (sequences): a multiple of the devices along the "
        "batch's mesh axes (data, expert), as train_model requires (default: the "
        f"smallest such multiple >= {study.DEFAULT_BATCH})",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=int, default=None,
        help=f"sequence length (default: the model's max_len, at most "
        f"{study.DEFAULT_SEQ_LEN})",
    )  # fmt: skip
    parser.add_argument(
        "--precision", choices=("bf16", "float32"), default="bf16",
        help="bf16 (float32 parameters and state, bfloat16 compute) or float32",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action="store_true",
        help="also compile the training step for each mesh (simulated CPU devices "
        "in a child process) and report its temporaries (activations, gradients)",
    )  # fmt: skip


def validate(args: argparse.Namespace) -> None:
    """Every value checked before any work; the plans from shapes are cheap, so
    they are made here (the compile, if asked, waits for `run`)."""
    owner = "blocklab plan"
    study.config_of(args.config, name="--config")
    if args.seq_len is not None:
        check_int(owner, "--seq-len", args.seq_len, min=1)
    for mesh in args.mesh:
        shape = parse_mesh(mesh)
        if args.batch is not None:
            study.check_global_batch(args.batch, shape, args.rules, name="--batch")
    args._plans = [_plan(args, mesh, compile=False) for mesh in args.mesh]


def _plan(args: argparse.Namespace, mesh: str, *, compile: bool):  # noqa: A002
    return study.plan(
        args.config, mesh, rules=args.rules, batch=args.batch, seq_len=args.seq_len,
        precision=args.precision, compile=compile,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    results = getattr(args, "_plans", None)
    if args.compile or results is None:
        results = [_plan(args, mesh, compile=args.compile) for mesh in args.mesh]
    if args.json:
        print(dumps({"plans": [r.to_json() for r in results]}))
        return 0
    print(study.plans_table(results))
    return 0
