"""`blocklab launch`: run one command as N local processes of one JAX job.

`blocklab launch --processes N -- COMMAND ...` is `blocklab.launch_local`
(see `blocklab.training.launcher`): N processes on the loopback, each with the
environment that `blocklab.training.distributed.initialize()` reads; process 0's stdout
is this command's stdout, every process's stderr passes through with a `[i]`
prefix; when one fails, every other one is ended and the error names it, its
exit status and its last lines of stderr. With `--json`, one JSON object: the
exit statuses, the wall time and process 0's output (parsed when it is JSON).

Scripts and `blocklab` commands that call `blocklab.training.distributed.initialize()`
(the `blocklab` CLI does, for every command) run unchanged under it.
"""

from __future__ import annotations

import argparse
import sys

from ..._validate import ConfigError, check_int
from ...experiments._render import dumps
from ...training.launcher import launch_local

NAME = "launch"
HELP = "run a command as N local processes of one JAX job (blocklab launch -- CMD)"

#: Runs in the main thread: its loop polls its processes in Python (Ctrl-C acts
#: at once) and must end them all before it exits.
MAIN_THREAD = True

EPILOG = (
    "Exit status 0: every process exited with 0; 1: a process could not start "
    "or failed, or the job ran past --timeout (every other process was ended); "
    "2: bad arguments."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--processes", type=int, default=2, metavar="N", help="processes (default 2)"
    )
    parser.add_argument(
        "--devices-per-process", type=int, default=None, metavar="D",
        help="simulated CPU devices per process (XLA_FLAGS); default: JAX's",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="S",
        help="end every process and fail after S seconds (default: no limit)",
    )  # fmt: skip
    parser.add_argument(
        "--init-timeout", type=int, default=60, metavar="S",
        help="seconds for every process to join the job (default 60)",
    )  # fmt: skip
    parser.add_argument(
        "--heartbeat-timeout", type=int, default=10, metavar="S",
        help="seconds after which a silent process counts as dead (default 10)",
    )  # fmt: skip
    parser.add_argument(
        "cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
        help="the command every process runs",
    )  # fmt: skip


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError(
            "blocklab launch: give the command after --, e.g. blocklab launch "
            "--processes 2 -- python train.py"
        )
    return cmd


def validate(args: argparse.Namespace) -> None:
    """Every option checked, with its flag's name, before anything starts."""
    owner = "blocklab launch"
    check_int(owner, "--processes", args.processes, min=1)
    check_int(owner, "--devices-per-process", args.devices_per_process, min=1,
              optional=True)  # fmt: skip
    check_int(owner, "--init-timeout", args.init_timeout, min=1)
    check_int(owner, "--heartbeat-timeout", args.heartbeat_timeout, min=1)
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"{owner}: --timeout must be > 0, got {args.timeout}.")
    _command(args)


def run(args: argparse.Namespace) -> int:
    result = launch_local(
        _command(args), args.processes, devices_per_process=args.devices_per_process,
        timeout=args.timeout, init_timeout=args.init_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        stdout=None if args.json else sys.stdout,
    )  # fmt: skip
    if args.json:
        print(dumps(result.to_json()))
    else:
        print(
            f"blocklab launch: {result.processes} processes finished in "
            f"{result.seconds:.1f} s",
            file=sys.stderr,
        )
    return 0
