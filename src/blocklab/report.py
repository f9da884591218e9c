"""`blocklab report`: the chapter's experiments as one Markdown report with PNGs."""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from .commands import COMMANDS

NAME = "report"
HELP = "reproduce the chapter: write DIR/report.md and PNG figures"

__all__ = ["write_report"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default="blocklab-report",
        metavar="DIR",
        help="output folder (default: ./blocklab-report/)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced sizes and step counts (minutes on a laptop CPU)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=COMMANDS,
        metavar="SECTION",
        help=f"only these sections, from {list(COMMANDS)}",
    )


def write_report(
    out_dir: str | Path, *, quick: bool = False, only: list[str] | None = None
) -> Path:
    """Run the report's sections and write `out_dir/report.md`; returns its path.

    Sections are written as they finish, so an interrupted run keeps every
    section already done.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.md"
    names = [n for n in COMMANDS if only is None or n in only]
    header = (
        "# blocklab report\n\n"
        f"Generated {time.strftime('%Y-%m-%d %H:%M')}"
        f"{' (quick mode: reduced sizes)' if quick else ''}.\n"
    )
    path.write_text(header)
    bar = tqdm(names, desc="report", unit="section")
    for name in bar:
        bar.set_postfix_str(name)
        module = importlib.import_module(f"blocklab.commands.{name}")
        t0 = time.perf_counter()
        section = module.report_section(out, quick=quick)
        seconds = time.perf_counter() - t0
        with path.open("a") as f:
            f.write(f"\n{section.rstrip()}\n\n_({name}: {seconds:.1f} s)_\n")
    return path


def run(args: argparse.Namespace) -> int:
    path = write_report(args.out, quick=args.quick, only=args.only)
    if args.json:
        print(json.dumps({"report": str(path)}))
    else:
        print(f"wrote {path}")
    return 0
