"""The `blocklab` subcommands, one module each: argument parsing, one call into
`blocklab.experiments`, and the rendering of its result. No experiment logic.

Every command module defines:

- `NAME` (the subcommand: a study's name, `blocklab.experiments.protocol`)
  and `HELP` (one line); optionally `ALIASES` (older names that still work)
  and `EPILOG` (the help's closing paragraph: exit statuses, caveats);
- `add_arguments(parser)`: its options (`--json` is added by `blocklab.cli`);
- `run(args) -> int`: prints a human-readable table, or one JSON object on
  stdout when `args.json` is set (render it with
  `blocklab.experiments.dumps`: strict JSON, non-finite -> null, and say which
  run diverged in a `diverged` field); returns the exit status;
- optionally `validate(args)`: checks argument values (raise `ConfigError`)
  before any work; `blocklab.cli` calls it, then checks the
  output paths (`--png`, `--out`, and the names in `OUTPUT_FILES` /
  `OUTPUT_DIRS`), all before `run`.

The report's sections are not here: each study module has its own
`report_section` and `report_estimate` (one signature for all, see
`blocklab.experiments.protocol`), and `blocklab report` iterates
`blocklab.experiments.protocol.STUDIES`.
"""

from collections.abc import Callable, Iterable

from ...experiments._render import dumps
from ...experiments.protocol import STUDY_NAMES

#: The sections of `blocklab report` (study names), in the order it presents them.
REPORT_SECTIONS = STUDY_NAMES

#: Subcommand modules (`blocklab NAME`): one per study, then the tools.
COMMANDS = (*REPORT_SECTIONS, "launch", "plan", "generate", "eval")


def add_num_seeds(parser, *, help: str) -> None:  # noqa: A002
    """`--num-seeds N`: seeds 0..N-1 (the default depends on other options).

    One meaning per name: `--seeds` lists seeds (`blocklab activations --seeds
    0 1 2`); a count is `--num-seeds`.
    """
    parser.add_argument("--num-seeds", type=int, default=None, metavar="N", help=help)


def num_seeds_of(args, default: int) -> int:
    """`--num-seeds`, else `default`."""
    return default if args.num_seeds is None else args.num_seeds


def add_protocol(parser, protocols: Iterable[str], *, help: str) -> None:  # noqa: A002
    """`--protocol NAME`: one of the study's named protocols (default `cpu`)."""
    parser.add_argument(
        "--protocol", choices=sorted(protocols), default="cpu", help=help
    )


def add_out_dir(parser, default: str, *, what: str = "PNG plots") -> None:
    """`--out DIR`: the folder the command writes its figures into."""
    parser.add_argument(
        "--out",
        default=default,
        metavar="DIR",
        help=f"folder for the {what} (default: %(default)s)",
    )


def add_no_progress(parser) -> None:
    """`--no-progress`: no estimate line and no progress bars on stderr."""
    parser.add_argument(
        "--no-progress", action="store_true",
        help="no estimate and no progress bars on stderr",
    )  # fmt: skip


def print_with_figures(args, result, *tables: Callable[[], str]) -> int:
    """Write `result`'s figures into `--out`, then print: one JSON object (the
    result's, with the figures' paths) under `--json`, else each of `tables`
    (rendered only then) and the figures' paths. Returns the exit status 0."""
    paths = result.figures(args.out)
    if args.json:
        print(dumps({**result.to_json(), "figures": [str(p) for p in paths]}))
        return 0
    print("\n\n".join(table() for table in tables))
    print("\nfigures: " + ", ".join(str(p) for p in paths))
    return 0
