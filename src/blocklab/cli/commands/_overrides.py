"""A study protocol on the command line (`blocklab induction`, `blocklab
real-text`): `--protocol`'s help, the `--seeds` and `--steps` options, and
the protocol with them applied."""

from collections.abc import Mapping

#: `--protocol`'s help for a study whose `cpu` protocol takes a few minutes.
PROTOCOL_HELP = (
    "cpu: a few minutes on 2 cores; quick: the report's size; full: an accelerator"
)


def add_seeds_and_steps(parser, *, per_model: bool = False) -> None:
    """`--seeds SEED...` and `--steps N` of a study's protocol (default: the
    protocol's); `per_model`: the study trains several models, each with
    these seeds and steps."""
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, metavar="SEED",
        help="the seeds (default: the protocol's), trained as one vmapped sweep"
        + (" per model" if per_model else ""),
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=None, metavar="N",
        help="training steps" + (" of each model" if per_model else "")
        + " (default: the protocol's)",
    )  # fmt: skip


def study_protocol(protocols: Mapping, args, **changes):
    """`protocols[args.protocol]` with `--seeds`, `--steps` and `changes`
    (field -> value) applied where they are not None."""
    changes = {
        "seeds": None if args.seeds is None else tuple(args.seeds),
        "steps": args.steps,
        **changes,
    }
    protocol = protocols[args.protocol]
    return protocol.replace(**{k: v for k, v in changes.items() if v is not None})
