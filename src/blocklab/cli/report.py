"""`blocklab report`: the chapter's experiments as one Markdown report with PNGs.

The report is sized to the machine. On a CPU (`jax.default_backend() ==
"cpu"`) the two long sections run reduced protocols (about 15 minutes in all
on 2 cores): the activation comparison trains seed 0 only (the chapter's own
comparison; seeds 0-2 take 16 minutes) and exercise 11 (hours at its full
protocol) runs the `cpu` protocol. Each names its protocol and says how to run
the full one. On a GPU or TPU, or with `--full`, every section runs the full
protocol. `--quick` reduces every section (minutes).

No work is lost: `report.md` is only replaced when a section has finished,
each time by the whole report so far (header and finished sections), written
to a temporary file and renamed over the old one. An interrupt or a failing
section leaves the last complete version in place, never a bare header.
Ctrl-C acts within seconds (`blocklab.cli._interrupt`); a section that has
finished is written first (the write is shielded from the interrupt), and the
exit message (`--json`: its `kept` field) names the report and its sections.

The estimate printed first comes from the measured times of the last timing
run (`blocklab.experiments.timing.REPORT_TIMES`, the figures the README
quotes), and from a study's own formula for a section never measured. A
finished report ends with a `_(total: ... s; mode ...)_` line, which a timing
run records (`python -m blocklab.experiments.timing record`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from .._io import atomic_write
from .._validate import ConfigError, check_bool
from ..experiments._render import dumps
from ..experiments.protocol import STUDIES, study
from ..experiments.timing import report_estimates, report_mode
from . import _interrupt
from .commands import REPORT_SECTIONS

NAME = "report"
HELP = "reproduce the chapter: write DIR/report.md and PNG figures"
OUTPUT_DIRS = ("out",)

__all__ = ["write_report", "on_accelerator"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default="blocklab-report",
        metavar="DIR",
        help="output folder (default: ./blocklab-report/)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="reduced sizes and step counts in every section (minutes on a laptop CPU)",
    )
    size.add_argument(
        "--full",
        action="store_true",
        help="the chapter's full protocol in every section, also on a CPU (there, "
        "exercise 11 alone takes hours; it is the default on a GPU or TPU)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="SECTION",
        help=f"only these sections, from {list(REPORT_SECTIONS)} (a study's "
        "command name, e.g. lr-sensitivity, or alias, e.g. train, works too)",
    )


def validate(args: argparse.Namespace) -> None:
    """`--only` names known studies (by study name, command or alias)."""
    if args.only is not None:
        _sections(args.only)


def on_accelerator() -> bool:
    """Whether JAX's default backend is a GPU or TPU (not the CPU)."""
    import jax

    return jax.default_backend() != "cpu"


def _sections(only: Sequence[str]) -> set[str]:
    """The study names of `only` (study names, commands or aliases)."""
    if isinstance(only, str):
        only = [only]
    names = set()
    for name in only:
        try:
            names.add(study(name).name)
        except ConfigError:
            raise ConfigError(
                f"write_report: unknown section {name!r} in only; choose from "
                f"{list(REPORT_SECTIONS)}."
            ) from None
    return names


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def write_report(
    out_dir: str | Path,
    *,
    quick: bool = False,
    full: bool | None = None,
    only: Sequence[str] | None = None,
    progress: bool = True,
) -> Path:
    """Run the report's sections and write `out_dir/report.md`; returns its path.

    Args:
        out_dir: the folder for `report.md` and the figures (created).
        quick: every section at a reduced size (minutes).
        full: the full protocol in every section; default: on a GPU or TPU
            yes, on a CPU no (the activation comparison and exercise 11 then run
            reduced protocols that the report names).
        only: run only these sections (kept in the report's order).
        progress: a tqdm bar over the sections, an estimate before each long
            one, and the bars of the sections that have their own (on stderr).

    `report.md` is replaced atomically each time a section finishes, by the
    whole report so far; until the first section finishes an earlier report
    is left untouched, and an interrupt never loses finished sections.
    """
    owner = "write_report"
    quick = check_bool(owner, "quick", quick)
    progress = check_bool(owner, "progress", progress)
    full = on_accelerator() if full is None else check_bool(owner, "full", full)
    if quick and full:
        raise ConfigError(
            f"{owner}: quick=True and full=True exclude each other; choose one."
        )
    wanted = None if only is None else _sections(only)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.md"
    studies = [s for s in STUDIES if wanted is None or s.name in wanted]
    mode = (
        "quick mode: reduced sizes"
        if quick
        else "full protocol"
        if full
        else "sized for a CPU: the activation comparison on seed 0 and exercise 11 "
        "at a reduced protocol; `blocklab report --full` runs the full ones"
    )
    header = (
        f"# blocklab report\n\nGenerated {time.strftime('%Y-%m-%d %H:%M')} ({mode}).\n"
    )
    estimates, measured = estimate_sections(studies, quick=quick, full=full)
    if progress:
        tqdm.write(
            f"report: {len(studies)} sections, about "
            f"{_minutes(sum(estimates.values()))} on 2 CPU cores ({mode}; "
            f"{_source(estimates, measured)})",
            file=sys.stderr,
        )
    sections: list[str] = []
    done: list[str] = []
    start = time.perf_counter()
    bar = tqdm(studies, desc="report", unit="section", disable=not progress)
    for s in bar:
        bar.set_postfix_str(s.name)
        if progress and estimates[s.name] >= 60:
            tqdm.write(
                f"report: {s.name}: about {_minutes(estimates[s.name])}",
                file=sys.stderr,
            )
        t0 = time.perf_counter()
        section = s.section(out, quick=quick, full=full, progress=progress)
        with _interrupt.shield():  # a finished section is written, Ctrl-C or not
            seconds = time.perf_counter() - t0
            sections.append(f"{section.rstrip()}\n\n_({s.name}: {seconds:.1f} s)_\n")
            done.append(s.name)
            pending = len(studies) - len(sections)
            note = (
                f"\n_(in progress: {pending} more section{'s' * (pending > 1)} to "
                "come)_\n"
                if pending
                else ""
            )
            end = (
                ""
                if pending
                else f"\n_(total: {time.perf_counter() - start:.1f} s; mode "
                f"{report_mode(quick=quick, full=full)})_\n"
            )
            atomic_write(
                path, header + note + "".join(f"\n{s}" for s in sections) + end
            )
            _interrupt.keep(report=str(path), sections=list(done))
    return path


def estimate_sections(
    studies, *, quick: bool, full: bool
) -> tuple[dict[str, float], dict | None]:
    """Seconds per section on 2 CPU cores: measured in the mode's last timing
    run where it has the section (`blocklab.experiments.timing`), else the
    study's own formula; and that timing run's record (or None)."""
    formulas = {s.name: s.estimate(quick=quick, full=full) for s in studies}
    return report_estimates(formulas, quick=quick, full=full)


def _source(estimates: dict[str, float], measured: dict | None) -> str:
    """Where the estimate comes from, in words."""
    have = set() if measured is None else set(measured.get("sections", {}))
    timed = [n for n in estimates if n in have]
    guessed = [n for n in estimates if n not in have]
    if not timed:
        return "from the studies' formulas; never measured in this mode"
    text = (
        f"measured {measured['date']}, {measured['machine']}"
        if len(timed) == len(estimates)
        else f"{len(timed)} sections measured {measured['date']}, {measured['machine']}"
    )
    if guessed:
        text += f"; {', '.join(guessed)} estimated (not in that timing run)"
    return text


def run(args: argparse.Namespace) -> int:
    path = write_report(
        args.out,
        quick=args.quick,
        full=True if args.full else None,
        only=args.only,
        progress=not args.json,
    )
    if args.json:
        print(dumps({"report": str(path)}))
    else:
        print(f"wrote {path}")
    return 0
