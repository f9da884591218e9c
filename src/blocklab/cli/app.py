"""The `blocklab` console script: `blocklab report` and one command per study.

Every exit path is defined, and each exit status means one thing (`EXIT_CODES`):

- 0, done: the command's table (or, with `--json`, exactly one strict JSON
  object on stdout: non-finite numbers are `null`, and a `nonfinite` field
  lists where they were unless the command already says which run diverged);
  a diverged training run is a result, not a failure;
- 1, failed while working: any error that is not a `ConfigError` (an
  `OSError`, a bug), before or during the work;
- 2, bad arguments or configuration: argparse errors, an output path that
  cannot be written, and any `ConfigError`, whichever layer raises it and
  whenever (a command's `validate`, or deep in `blocklab.nn` during the run);
- 130, interrupted (Ctrl-C): within a few seconds, whatever the command is
  doing (`blocklab.cli._interrupt`), with what it had written kept and named
  (`--json`: `{"error": "interrupted", "interrupted": true, "kept": {...}}`).

On an error, `--json` prints `{"error": "...", "type": "..."}` on stdout;
without it the error is one line on stderr (a traceback only for an
unexpected exception, which is a bug). Output paths (`--png`, `--out` and any
the command lists in `OUTPUT_FILES` / `OUTPUT_DIRS`) are checked before any
work starts, so a typo never costs a finished run.

Run as the program (`blocklab ...`, `python -m blocklab.cli ...`: `main()`
without `argv`), the command runs in a worker thread that Ctrl-C stops
within seconds even inside a long compiled call, long compiles are announced
on stderr, and JAX's persistent compilation cache is on
(`blocklab.cli._compile`; `--no-compile-cache` or
`BLOCKLAB_COMPILE_CACHE=off` turn it off). `main(argv)` called from Python
runs the command in the caller's thread and leaves JAX's configuration as
it is.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import io
import json
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._io import check_writable
from .._validate import ConfigError
from ..experiments._render import dumps, nonfinite_paths
from . import _interrupt
from .commands import COMMANDS

__all__ = ["main", "build_parser", "UsageError"]

#: Output flags that name a figure (their suffix must be an image format).
FIGURE_FLAGS = ("png",)

#: Exit statuses.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPT = 0, 1, 2, 130

#: What each exit status means (also in `blocklab --help`).
EXIT_CODES = {
    EXIT_OK: "done",
    EXIT_FAILURE: "failed while working (an error, a bug)",
    EXIT_USAGE: "bad arguments or configuration (any ConfigError, an unwritable "
    "output path)",
    EXIT_INTERRUPT: "interrupted",
}


class UsageError(ConfigError):
    """A bad command line (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """An `ArgumentParser` that raises instead of printing and exiting, and
    reads `-1e-3` (any negative number, exponent included) as a value, not
    an option: `--lrs -1e-3 0.1` parses (and is then refused by its range)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but an unknown option is named before a missing
        required one (`plan --no-such-option` names the misspelled flag)."""
        try:
            return super().parse_known_args(args, namespace)
        except UsageError as e:
            if "arguments are required" not in str(e):
                raise
            required = [a for a in self._actions if a.required]
            for action in required:
                action.required = False
            try:
                _, extras = super().parse_known_args(args, argparse.Namespace())
            finally:
                for action in required:
                    action.required = True
            unknown = [a for a in extras if a.startswith("-")]
            if unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
            raise


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$")


def _wants_json(argv: Sequence[str]) -> bool:
    """`--json`, or a misspelling of it (`--jso`, `--jsno`), before any `--`:
    the error about the misspelled flag is then printed as JSON too."""
    own = argv[: argv.index("--")] if "--" in argv else argv
    return any(
        a == "--json"
        or (a.startswith("--") and difflib.get_close_matches(a, ["--json"], cutoff=0.8))
        for a in own
    )


def figure_suffix_error(path: Any) -> str | None:
    """Why `path` cannot be a figure (its suffix is not an image format
    matplotlib writes), or `None`."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix in formats:
        return None
    return (
        f"{str(path)!r} is not an image file name (its suffix {suffix or 'is empty'}"
        f"); use one of .{', .'.join(sorted(formats))}"
    )


def _command_modules():
    return [
        importlib.import_module(f"blocklab.cli.commands.{name}") for name in COMMANDS
    ]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `blocklab` with every subcommand registered."""
    from . import report

    table = "\n".join(f"  {code:>3}  {text}" for code, text in EXIT_CODES.items())
    parser = _Parser(
        prog="blocklab",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The transformer block in JAX: build, train, diagnose, verify. "
        "Each study of blocklab.experiments is a command of the same name.\n\n"
        f"exit status:\n{table}\n\n"
        "With --json every outcome is one JSON object on stdout.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in [report, *_command_modules()]:
        name = module.NAME.replace("_", "-")
        aliases = list(getattr(module, "ALIASES", ()))
        p = sub.add_parser(
            name,
            aliases=aliases,
            help=module.HELP,
            description=module.HELP,
            epilog=getattr(module, "EPILOG", None),
        )
        module.add_arguments(p)
        p.add_argument(
            "--json",
            action="store_true",
            help="print the result (or the error) as one strict JSON object",
        )
        p.add_argument(
            "--no-compile-cache",
            action="store_true",
            help="do not read or write JAX's persistent compilation cache (on by "
            "default, in ~/.cache/blocklab/jax or $XDG_CACHE_HOME/blocklab/jax; "
            "also BLOCKLAB_COMPILE_CACHE=off)",
        )
        p.set_defaults(_run=module.run, _module=module, _name=name)
    return parser


def _probe(folder: Path, *, owner: str, name: str, value) -> None:
    """Create `folder` and a temporary file in it: the only reliable test (root
    passes every `os.access` check, and some filesystems are read-only)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(
            f"{owner}: {name}={str(value)!r} cannot be written "
            f"({e.strerror or e}: {folder})."
        ) from None


def _check_dir(path: str | os.PathLike, *, owner: str, name: str) -> Path:
    """Fail now if folder `path` cannot be created or written later."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{owner}: {name}={str(path)!r} is a file, not a folder.")
    _probe(path, owner=owner, name=name, value=path)
    return path


def _check_file(path: str | os.PathLike, *, owner: str, name: str) -> Path:
    """Fail now if file `path` cannot be written later."""
    try:
        path = check_writable(path, owner=owner, name=name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _probe(path.parent, owner=owner, name=name, value=path)
    return path


def check_outputs(args: argparse.Namespace) -> None:
    """Check every output path of the parsed command before any work starts.

    Files: `args.png` and the names in the command module's `OUTPUT_FILES`;
    folders: `args.out` (unless listed in `OUTPUT_FILES`) and `OUTPUT_DIRS`.
    """
    module = getattr(args, "_module", None)
    owner = f"blocklab {getattr(args, '_name', args.command)}"
    files = set(getattr(module, "OUTPUT_FILES", ())) | {"png"}
    dirs = (set(getattr(module, "OUTPUT_DIRS", ())) | {"out"}) - files
    for name in sorted(files):
        if getattr(args, name, None) is not None:
            _check_file(getattr(args, name), owner=owner, name=f"--{name}")
            if name in FIGURE_FLAGS:
                why = figure_suffix_error(getattr(args, name))
                if why:
                    raise ConfigError(f"{owner}: --{name}={why}.")
    for name in sorted(dirs):
        if getattr(args, name, None) is not None:
            _check_dir(getattr(args, name), owner=owner, name=f"--{name}")


def _strict(text: str) -> str:
    """The command's JSON output as one strict JSON object (non-finite -> null)."""
    try:
        obj = json.loads(text)  # lenient: accepts NaN / Infinity from json.dumps
    except json.JSONDecodeError:
        # Stray lines (a warning printed to stdout): keep the last JSON line,
        # send the others to stderr.
        lines = text.splitlines()
        for i in range(len(lines) - 1, -1, -1):
            try:
                obj = json.loads(lines[i])
            except json.JSONDecodeError:
                continue
            rest = lines[:i] + lines[i + 1 :]
            if rest:
                print("\n".join(rest), file=sys.stderr)
            break
        else:
            raise
    if isinstance(obj, dict):
        bad = nonfinite_paths(obj)
        if bad and "diverged" not in obj and "nonfinite" not in obj:
            obj["nonfinite"] = bad
    else:  # keep the promise of one object
        obj = {"result": obj}
    return dumps(obj)


def _error(as_json: bool, exc: BaseException, message: str | None = None) -> None:
    text = message or str(exc) or type(exc).__name__
    if as_json:
        print(dumps({"error": text, "type": type(exc).__name__}))
    else:
        # "blocklab census: msg" -> "blocklab census: error: msg", like argparse.
        owner, sep, rest = text.partition(": ")
        if not (sep and owner.startswith("blocklab")):
            owner, rest = "blocklab", text
        print(f"{owner}: error: {rest}", file=sys.stderr)


class _Abandoned(KeyboardInterrupt):
    """Ctrl-C while the command was inside a long C call: the process ends."""


def _interrupted(as_json: bool, name: str) -> None:
    """Say that the command was interrupted, and what it kept."""
    kept = _interrupt.kept()
    if as_json:
        print(
            dumps(
                {
                    "error": "interrupted",
                    "type": "KeyboardInterrupt",
                    "interrupted": True,
                    "kept": kept,
                }
            )
        )
        return
    what = "; ".join(
        f"{k}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in kept.items()
    )
    print(
        f"{name}: error: interrupted" + (f"; kept {what}" if what else ""),
        file=sys.stderr,
    )


def _estimate_line(args: argparse.Namespace) -> str | None:
    """The command's `estimate(args)` as one line, or None."""
    estimate = getattr(args._module, "estimate", None)
    if estimate is None or getattr(args, "no_progress", False):
        return None
    line = estimate(args)
    return None if line is None else f"blocklab {args._name}: {line}"


def _call(args: argparse.Namespace, *, program: bool) -> int:
    """Run the command; as the program, in a worker thread that Ctrl-C stops
    within seconds (`blocklab.cli._interrupt`)."""

    def work() -> int:
        return int(args._run(args) or 0)

    if not program or getattr(args._module, "MAIN_THREAD", False):
        return work()

    def say() -> None:
        print(
            f"blocklab {args._name}: interrupted; stopping (Ctrl-C again ends it now)",
            file=sys.stderr,
            flush=True,
        )

    status = _interrupt.run_interruptible(work, on_interrupt=say)
    if status is _interrupt.STILL_RUNNING:
        raise _Abandoned
    return status


def _setup_program(args: argparse.Namespace):
    """As the program: the compile cache and the compile notices (returned)."""
    from . import _compile

    folder = _compile.enable_cache(_compile.cache_setting(args.no_compile_cache))
    if getattr(args, "no_progress", False):
        return None
    return _compile.CompileNotices(cached=folder is not None).start()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse `argv` (default `sys.argv[1:]`), run the subcommand and
    return the exit status (see the module docstring)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    _interrupt.reset()
    notices = None
    # A `--json` after `--` belongs to the command that `blocklab launch` runs.
    as_json = _wants_json(argv)
    out = io.StringIO()
    try:
        parser = build_parser()
        if as_json:  # --help would print text: keep it inside one JSON object
            try:
                with contextlib.redirect_stdout(out):
                    args = parser.parse_args(argv)
            except SystemExit as e:
                if e.code not in (0, None):
                    raise UsageError(f"exit status {e.code}") from None
                print(dumps({"help": out.getvalue()}))
                return EXIT_OK
        else:
            args = parser.parse_args(argv)
        if program:
            notices = _setup_program(args)
        validate = getattr(args._module, "validate", None)
        if validate is not None:
            validate(args)
        check_outputs(args)
    except KeyboardInterrupt as e:
        _error(as_json, e, "interrupted")
        return EXIT_INTERRUPT
    except ConfigError as e:  # UsageError included
        _error(as_json, e)
        return EXIT_USAGE
    except Exception as e:  # not a refusal of an argument: a failure
        _error(as_json, e, f"{e} ({type(e).__name__} while checking the arguments)")
        traceback.print_exc(file=sys.stderr)
        return EXIT_FAILURE

    out = io.StringIO()
    try:
        if args.command != "launch":  # join a `blocklab launch` / cluster job
            from ..training.distributed import initialize

            initialize()
        line = _estimate_line(args)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        if as_json:
            with contextlib.redirect_stdout(out):
                status = _call(args, program=program)
        else:
            status = _call(args, program=program)
    except KeyboardInterrupt as e:
        _interrupted(as_json, f"blocklab {args._name}")
        if isinstance(e, _Abandoned):  # the worker is inside a C call
            _interrupt.flush()
            os._exit(EXIT_INTERRUPT)
        return EXIT_INTERRUPT
    except ConfigError as e:
        _error(as_json, e)
        return EXIT_USAGE
    except (ValueError, TypeError, OSError) as e:  # not a ConfigError: a failure
        _error(as_json, e)
        return EXIT_FAILURE
    except SystemExit as e:  # a command that exits by itself
        if isinstance(e.code, int) or e.code is None:
            status = int(e.code or 0)
            if not as_json:
                return status
            if status:
                _error(as_json, e, f"exited with status {status}")
                return status
        else:  # sys.exit("message"): Python's status for it is 1
            _error(as_json, e, str(e.code))
            return EXIT_FAILURE
    except Exception as e:  # a bug: keep the traceback for the report
        if as_json:
            _error(as_json, e, f"{e} (internal error; please report)")
            traceback.print_exc(file=sys.stderr)
        else:
            traceback.print_exc(file=sys.stderr)
        return EXIT_FAILURE
    finally:
        if notices is not None:
            notices.stop()
    if as_json:
        try:
            print(_strict(out.getvalue()))
        except ValueError as e:
            _error(as_json, e, f"the command printed no single JSON value: {e}")
            return EXIT_FAILURE
    return status


if __name__ == "__main__":
    sys.exit(main())
