"""`blocklab plan`: per-device bytes of a model on a mesh, without allocating it."""

from __future__ import annotations

import argparse
import dataclasses

from ..._validate import ConfigError, check_int
from ...experiments._render import dumps
from ...interop.pretrained import config_of
from ...nn.remat import parse_remat
from ...training import plan as study
from ...training.placement import parse_mesh

NAME = "plan"
HELP = (
    "per-device bytes of parameters, optimizer state and temporaries of a model "
    "on a mesh (blocklab plan --config llama3-8b --mesh data=8,model=4); with "
    "--fit, the fastest remat policy and microbatch count within --budget"
)
EPILOG = (
    "A mesh axis the rules split nothing over (model under fsdp) is accepted, as "
    "train_model accepts it, and shown: the 'unused' column (JSON: unused_axes) "
    "names it, and a note names the rules that would use it (fsdp+tp). A --batch "
    "that train_model would refuse on the mesh (not a multiple of the devices "
    "along the batch's axes, data and expert) is refused. --fit --budget 16GiB "
    "sizes every remat policy x microbatch count of one device's training step "
    "(compiled on this machine when the model fits it, else in closed form), "
    "prints bytes and estimated time per option and chooses the fastest that "
    "fits; a budget below every option is refused naming the smallest need."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="PRESET_OR_PATH",
        help=f"a preset ({', '.join(sorted(study.PRESET_CONFIGS))}), a checkpoint "
        "folder of any family load_pretrained reads (only its config.json is "
        "read), a transformers config.json, or a JSON file of DecoderConfig fields",
    )  # fmt: skip
    parser.add_argument(
        "--mesh", nargs="+", default=None, metavar="AXES",
        help="one or more meshes, each like data=8,model=4 (required without --fit)",
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
    parser.add_argument(
        "--fit", action="store_true",
        help="fit one device's training step to --budget: every remat policy x "
        "microbatch count, the fastest that fits",
    )  # fmt: skip
    parser.add_argument(
        "--budget", default=None, metavar="BYTES",
        help="with --fit: device memory, e.g. 16GiB, 500MB or 2e9",
    )  # fmt: skip
    parser.add_argument(
        "--policies", default=None, metavar="LIST",
        help="with --fit: remat policies to compare, separated by ';' (default: "
        f"{';'.join(study.FIT_POLICIES)})",
    )  # fmt: skip
    parser.add_argument(
        "--microbatches", type=int, nargs="+", default=None, metavar="K",
        help="with --fit: microbatch counts to compare (default: the powers of "
        "two dividing --batch)",
    )  # fmt: skip
    parser.add_argument(
        "--peak-flops", type=float, default=None, metavar="FLOPS",
        help="with --fit: the device's FLOP/s for the time estimate (default: "
        "this machine's float32 matmul rate, measured)",
    )  # fmt: skip


def validate(args: argparse.Namespace) -> None:
    """Every value checked before any work; the plans from shapes are cheap, so
    they are made here (the compile, if asked, waits for `run`)."""
    owner = "blocklab plan"
    args._cfg = config_of(args.config, name="--config")
    if args.seq_len is not None:
        check_int(owner, "--seq-len", args.seq_len, min=1)
    if args.fit:
        _validate_fit(owner, args)
        return
    for name in ("budget", "policies", "microbatches", "peak_flops"):
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{owner}: {flag} applies with --fit only.")
    if not args.mesh:
        raise ConfigError(
            f"{owner}: --mesh is required (e.g. --mesh data=8,model=4), or --fit "
            "with --budget."
        )
    for mesh in args.mesh:
        shape = parse_mesh(mesh)
        if args.batch is not None:
            study.check_global_batch(args.batch, shape, args.rules, name="--batch")
    args._plans = [_plan(args, mesh, compile=False) for mesh in args.mesh]


def _plan(args: argparse.Namespace, mesh: str, *, compile: bool):  # noqa: A002
    result = study.plan(
        args._cfg, mesh, rules=args.rules, batch=args.batch, seq_len=args.seq_len,
        precision=args.precision, compile=compile,
    )  # fmt: skip
    return dataclasses.replace(result, config=str(args.config))


def _validate_fit(owner: str, args: argparse.Namespace) -> None:
    if args.mesh or args.compile:
        raise ConfigError(
            f"{owner}: --fit sizes one device's step; drop --mesh and --compile."
        )
    if args.budget is None:
        raise ConfigError(f"{owner}: --fit needs --budget (e.g. --budget 16GiB).")
    study.parse_bytes(args.budget, name="--budget")
    if args.batch is not None:
        check_int(owner, "--batch", args.batch, min=1)
    if args.policies is not None:
        args.policies = [p for p in args.policies.split(";") if p.strip()]
        for p in args.policies:
            parse_remat(f"{owner}: --policies", p)
    for k in args.microbatches or ():
        check_int(owner, "--microbatches", k, min=1)
        if args.batch is not None and args.batch % k:
            raise ConfigError(
                f"{owner}: --microbatches {k} does not divide --batch {args.batch}."
            )


def _fit(args: argparse.Namespace):
    cfg = args._cfg
    seq = args.seq_len or min(study.DEFAULT_SEQ_LEN, cfg.max_len)
    batch = args.batch or study.DEFAULT_BATCH
    result = study.plan_step(
        cfg, (batch, seq), args.budget, policies=args.policies,
        microbatches=args.microbatches, precision=args.precision,
        peak_flops=args.peak_flops,
    )  # fmt: skip
    return dataclasses.replace(result, config=str(args.config))


def run(args: argparse.Namespace) -> int:
    if args.fit:
        result = _fit(args)
        if args.json:
            print(dumps({"fit": result.to_json()}))
        else:
            print(result.table())
        return 0
    results = getattr(args, "_plans", None)
    if args.compile or results is None:
        results = [_plan(args, mesh, compile=args.compile) for mesh in args.mesh]
    if args.json:
        print(dumps({"plans": [r.to_json() for r in results]}))
        return 0
    print(study.plans_table(results))
    return 0
