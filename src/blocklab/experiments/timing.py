"""Timing: wall-clock of jitted calls and machine peaks, and the report's
measured times.

Benchmarks report ratios against references measured in the same run (a peer
implementation, this machine's float32 matmul peak, or its memory bandwidth),
never absolute timings in tests.

`blocklab report`'s times have one source, `report_times.json` beside this
module: per mode (`cpu`, the default on a CPU; `quick`; `full`) the seconds
each section took in a timing run, the total, the date and the machine. The
report's estimate reads it (`report_estimates`; a study's own formula for a
section that was not measured), and the README and `docs/install.md` quote
it (a test compares them). A timing run updates it from a finished report:

    blocklab report --out r && python -m blocklab.experiments.timing record \
        r/report.md --machine "idle 2-core CPU"
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .._io import atomic_write
from .._validate import ConfigError

__all__ = [
    "REPORT_TIMES",
    "Timing",
    "format_duration",
    "matmul_peak_flops",
    "measured_report_times",
    "parse_report_times",
    "record_report_times",
    "report_estimates",
    "report_mode",
    "time_call",
    "time_round_robin",
]

#: The measured times of `blocklab report` (see the module docstring).
REPORT_TIMES = Path(__file__).with_name("report_times.json")

#: The report's modes: its default on a CPU, `--quick`, `--full`.
MODES = ("cpu", "quick", "full")


@dataclass(frozen=True)
class Timing:
    """Seconds per call over `reps` timed calls (after warm-up)."""

    median: float
    best: float
    reps: int

    @property
    def ms(self) -> float:
        """Median in milliseconds."""
        return 1e3 * self.median


def time_call(
    fn: Callable,
    *args,
    reps: int = 20,
    warmup: int = 2,
    make_args: Callable[[], tuple] | None = None,
) -> Timing:
    """Time `fn(*args)` (blocking on its result) `reps` times after `warmup` calls.

    With `make_args`, fresh arguments are built (untimed) before every call;
    that is how donated inputs (`donate_argnums`) are timed, since a donated
    buffer cannot be used twice.
    """

    def once() -> float:
        call_args = make_args() if make_args is not None else args
        jax.block_until_ready(call_args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*call_args))
        return time.perf_counter() - t0

    for _ in range(warmup):
        once()
    times = [once() for _ in range(reps)]
    return Timing(statistics.median(times), min(times), reps)


def time_round_robin(
    fns: Mapping[str, Callable[[], Any]],
    reps: int,
    *,
    block: int = 1,
    pause: float = 0.0,
) -> dict[str, Timing]:
    r"""Time each thunk of `fns` (name -> no-argument callable) in turn, so
    that a noisy machine slows them all alike.

    A round sleeps `pause` seconds before each name, then times `block` calls
    of it; $\lceil r / b \rceil$ rounds are run ($r$ = `reps`, $b$ = `block`),
    so each thunk is timed $b \lceil r / b \rceil$ times ($r$ when $b = 1$).
    No warm-up: call each thunk once before, and block on its result inside it
    (`jax.block_until_ready`) when it is asynchronous.

    Returns:
        name -> `Timing` (median and best seconds of that thunk's calls).
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(-(-reps // block)):
        for name, fn in fns.items():
            if pause:
                time.sleep(pause)
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {
        name: Timing(statistics.median(ts), min(ts), len(ts))
        for name, ts in times.items()
    }


def matmul_peak_flops(n: int = 2048, dtype=jnp.float32, reps: int = 10) -> float:
    """This machine's achieved matmul rate in FLOP/s: best of `reps` n x n x n products.

    $2n^3$ floating-point operations per product; the best (not the median)
    time estimates the peak.
    """
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(jnp.matmul)
    return 2 * n**3 / time_call(matmul, a, b, reps=reps).best


# The report's measured times ---------------------------------------------


def report_mode(*, quick: bool, full: bool) -> str:
    """The report's mode: `quick`, `full` or `cpu` (the default on a CPU)."""
    return "quick" if quick else "full" if full else "cpu"


def format_duration(seconds: float | int) -> str:
    """`679` -> `"11 min 19 s"` (the README's form); under a minute `"42 s"`."""
    seconds = round(float(seconds))
    minutes, rest = divmod(seconds, 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _load(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"modes": {}}
    if not isinstance(data, dict) or not isinstance(data.get("modes"), dict):
        raise ConfigError(f"{path}: not a report-times file (no 'modes' object).")
    return data


def measured_report_times(mode: str, path: str | Path = REPORT_TIMES) -> dict | None:
    """The timing run of `mode` (`date`, `machine`, `total_seconds`,
    `sections`: name -> seconds), or None when that mode was never measured
    (or the file is absent, as in an install without package data)."""
    if mode not in MODES:
        raise ConfigError(f"measured_report_times: mode must be one of {MODES}, "
                          f"got {mode!r}.")  # fmt: skip
    return _load(path)["modes"].get(mode)


def report_estimates(
    formulas: dict[str, float],
    *,
    quick: bool,
    full: bool,
    path: str | Path = REPORT_TIMES,
) -> tuple[dict[str, float], dict | None]:
    """Seconds per section: the measured time where the mode's timing run has
    the section, else `formulas[name]` (the study's own estimate).

    Returns `(seconds, record)`: `record` is the mode's timing run (None when
    it has none). `total = sum(seconds.values())`.
    """
    record = measured_report_times(report_mode(quick=quick, full=full), path)
    measured = {} if record is None else record.get("sections", {})
    seconds = {
        name: float(measured.get(name, estimate)) for name, estimate in formulas.items()
    }
    return seconds, record


#: The lines `blocklab report` writes: one per section, one at the end.
_SECTION = re.compile(r"^_\((?P<name>[a-z_]+): (?P<seconds>[0-9.]+) s\)_$", re.M)
_TOTAL = re.compile(
    r"^_\(total: (?P<seconds>[0-9.]+) s; mode (?P<mode>[a-z]+)\)_$", re.M
)


def parse_report_times(text: str) -> tuple[str, dict[str, float], float]:
    """`(mode, section -> seconds, total seconds)` of a finished `report.md`."""
    total = _TOTAL.search(text)
    if total is None:
        raise ConfigError(
            "parse_report_times: no '_(total: ... s; mode ...)_' line; the report "
            "is unfinished (interrupted) or older than this version."
        )
    sections = {m["name"]: float(m["seconds"]) for m in _SECTION.finditer(text)}
    return total["mode"], sections, float(total["seconds"])


def record_report_times(
    report_md: str | Path,
    *,
    machine: str,
    date: str | None = None,
    peak_rss_gb: float | None = None,
    path: str | Path = REPORT_TIMES,
) -> dict[str, Any]:
    """Write the times of a finished `report.md` into `path` (its mode's entry,
    replaced); returns that entry."""
    mode, sections, total = parse_report_times(
        Path(report_md).read_text(encoding="utf-8")
    )
    data = _load(path)
    entry: dict[str, Any] = {
        "date": date or time.strftime("%Y-%m-%d"),
        "machine": machine,
        "total_seconds": round(total),
        "sections": {k: round(v, 1) for k, v in sections.items()},
    }
    if peak_rss_gb is not None:
        entry["peak_rss_gb"] = peak_rss_gb
    data["modes"][mode] = entry
    atomic_write(Path(path), json.dumps(data, indent=2) + "\n")
    return entry


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m blocklab.experiments.timing",
        description="record the section times of a finished blocklab report in "
        "the package's report_times.json",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record a finished report.md's times")
    rec.add_argument("report_md", help="the report.md of a finished run")
    rec.add_argument("--machine", required=True, help="e.g. 'idle 2-core CPU'")
    rec.add_argument("--date", default=None, help="default: today (YYYY-MM-DD)")
    rec.add_argument("--peak-rss-gb", type=float, default=None,
                     help="the run's peak resident memory, if measured")  # fmt: skip
    rec.add_argument("--path", default=str(REPORT_TIMES), help="the JSON to update")
    args = parser.parse_args(argv)
    entry = record_report_times(
        args.report_md, machine=args.machine, date=args.date,
        peak_rss_gb=args.peak_rss_gb, path=args.path,
    )  # fmt: skip
    print(json.dumps(entry, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
