"""One protocol for every study: the registry that the CLI and the report iterate.

Each study module in `blocklab.experiments` exposes the same surface:

- a result type (a frozen dataclass of plain data) with `table()` (Markdown),
  `to_json()` (a strict-JSON-ready dict) and `figures(out_dir)` (the PNG
  paths it wrote, `[]` when it has none);
- `report_section(out_dir, *, quick, full, progress) -> str`: runs the study
  at the report's size, writes its PNGs into `out_dir` and returns a Markdown
  section (a `## ` heading first) that links them by file name. `quick`:
  every section reduced (minutes); `full`: the chapter's full protocol (on an
  accelerator, or `blocklab report --full`), else a CPU-sized one that the
  section names; `progress`: the section's own tqdm bars on stderr;
- `report_estimate(*, quick, full) -> float`: the section's expected seconds
  on 2 CPU cores.

A study declares both with `report_section_hook` / `report_estimate_hook`,
which give them this signature and its defaults and check the flags once, so
the study's own code starts from three checked bools.

`STUDIES` registers them (as `Study` objects) in the report's order, each
with the subcommand that runs it (`blocklab <command>`, named after the
study; an older command name stays an alias); `STUDY_NAMES` lists their
names in that order.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from .._validate import ConfigError, check_bool

__all__ = [
    "STUDIES",
    "STUDY_NAMES",
    "Study",
    "check_protocol",
    "check_report_flags",
    "report_estimate_hook",
    "report_section_hook",
    "study",
]


def check_protocol(
    owner: str, protocol: object, cls: type, names: str, *, article: str = "a"
) -> None:
    """`ConfigError` unless `protocol` is a `cls` (a study's protocol type);
    the message names `owner`, the type (after `article`), `names` (the
    study's protocols) and the type that came."""
    if not isinstance(protocol, cls):
        raise ConfigError(
            f"{owner}: protocol must be {article} {cls.__name__} ({names}), got "
            f"{type(protocol).__name__}."
        )


def check_report_flags(
    owner: str, quick: bool, full: bool, progress: bool = False
) -> tuple[bool, bool, bool]:
    """The flags of `report_section` / `report_estimate` as bools, or `ConfigError`.

    `quick` and `full` exclude each other (`quick` reduces every section,
    `full` runs the chapter's full protocol).
    """
    quick = check_bool(owner, "quick", quick)
    full = check_bool(owner, "full", full)
    progress = check_bool(owner, "progress", progress)
    if quick and full:
        raise ConfigError(
            f"{owner}: quick=True and full=True exclude each other; choose one."
        )
    return quick, full, progress


def _named_after(hook: Callable, body: Callable) -> Callable:
    # The body's name and docstring, but the hook's own signature (the
    # protocol's, with its defaults), which `inspect` reads before it would
    # follow `__wrapped__` to the body.
    signature = inspect.signature(hook)
    functools.update_wrapper(
        hook,
        body,
        assigned=("__module__", "__name__", "__qualname__", "__doc__"),
        updated=(),
    )
    hook.__signature__ = signature
    return hook


def report_section_hook(
    owner: str,
) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Decorate a study's `report_section` body: the protocol's signature.

    The result is `report_section(out_dir, *, quick=False, full=False,
    progress=False) -> str`; it checks the flags (`check_report_flags`, its
    errors naming `<owner>.report_section`) and calls the body with
    `Path(out_dir)` and three bools.
    """

    def decorate(body: Callable[..., str]) -> Callable[..., str]:
        name = f"{owner}.report_section"

        def report_section(
            out_dir: str | Path,
            *,
            quick: bool = False,
            full: bool = False,
            progress: bool = False,
        ) -> str:
            quick, full, progress = check_report_flags(name, quick, full, progress)
            return body(Path(out_dir), quick=quick, full=full, progress=progress)

        return _named_after(report_section, body)

    return decorate


def report_estimate_hook(
    owner: str,
) -> Callable[[Callable[..., float]], Callable[..., float]]:
    """Decorate a study's `report_estimate` body: the protocol's signature.

    The result is `report_estimate(*, quick=False, full=False) -> float`; it
    checks the flags (errors naming `<owner>.report_estimate`) and calls the
    body with two bools.
    """

    def decorate(body: Callable[..., float]) -> Callable[..., float]:
        name = f"{owner}.report_estimate"

        def report_estimate(*, quick: bool = False, full: bool = False) -> float:
            quick, full, _ = check_report_flags(name, quick, full)
            return body(quick=quick, full=full)

        return _named_after(report_estimate, body)

    return decorate


@dataclasses.dataclass(frozen=True)
class Study:
    """One study: its module, its command and its report section.

    Attributes:
        name: the study's name (its report section, `blocklab report --only`).
        command: the subcommand that runs it: `blocklab <command>`, the study's
            name with `-` for `_`.
        aliases: other subcommand names that run it.
        title: one line for help texts.
        module_name: its module, `blocklab.experiments.<module_name>`
            (default: `name`).
    """

    name: str
    title: str
    aliases: tuple[str, ...] = ()
    module_name: str = ""

    def __post_init__(self) -> None:
        if not self.module_name:
            object.__setattr__(self, "module_name", self.name)

    @property
    def command(self) -> str:
        return self.name.replace("_", "-")

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"blocklab.experiments.{self.module_name}")

    @property
    def report_section(self) -> Callable[..., str]:
        """`report_section(out_dir, *, quick, full, progress) -> str`."""
        return self.module.report_section

    @property
    def report_estimate(self) -> Callable[..., float]:
        """`report_estimate(*, quick, full) -> float` (seconds on 2 CPU cores)."""
        return self.module.report_estimate

    def section(
        self, out_dir: str | Path, *, quick: bool, full: bool, progress: bool
    ) -> str:
        """Run the report's section (one signature for every study)."""
        return self.report_section(
            Path(out_dir), quick=quick, full=full, progress=progress
        )

    def estimate(self, *, quick: bool, full: bool) -> float:
        """The section's expected seconds on 2 CPU cores."""
        return float(self.report_estimate(quick=quick, full=full))


#: The studies, in the order of `blocklab report`.
STUDIES: tuple[Study, ...] = (
    Study(
        "census",
        "parameter census of transformer blocks",
        module_name="parameter_census",
    ),
    Study("norms", "cost of the normalizers vs X -> 2X (exercise 9)"),
    Study("activations", "GELU vs SwiGLU on CharLM (11.1.4.2)", aliases=("train",)),
    Study("signal", "signal propagation at initialization (ex. 3-7)"),
    Study("check", "the chapter's identities and closed forms"),
    Study(
        "lr_sensitivity",
        "learning-rate sensitivity with and without QK-norm (ex. 11)",
        aliases=("lr-sweep", "lr_sweep"),
    ),
    Study("mup", "μP: coordinate check and learning-rate transfer"),
    Study("proxies", "small-scale proxies: LR sensitivity per intervention"),
    Study("induction", "induction heads: find, ablate, patch, lenses"),
    Study(
        "real_text",
        "real text: byte-level BPE vs bytes in bits per byte; save, reload, generate",
    ),
)

#: The studies' names, in the order of `blocklab report`.
STUDY_NAMES: tuple[str, ...] = tuple(s.name for s in STUDIES)


def study(name: str) -> Study:
    """The study called `name`: its study name, command or an alias."""
    for s in STUDIES:
        if name in (s.name, s.command, *s.aliases):
            return s
    raise ConfigError(
        f"blocklab.experiments.protocol.study: unknown study {name!r}; choose from "
        f"{[s.name for s in STUDIES]} (or their commands "
        f"{[s.command for s in STUDIES]})."
    )
