"""The chapter's studies as functions that return typed results.

One module per study. Each study is a function whose keyword arguments are
its protocol (the defaults are the chapter's) and which returns a dataclass
of plain data with methods that render it: `.table()` (Markdown),
`.to_json()` (a strict-JSON-ready dict) and `.figures(out_dir)` (PNG paths,
written atomically). Every study module also has
`report_section(out_dir, *, quick, full, progress)` and
`report_estimate(*, quick, full)`, one signature for all
(`blocklab.experiments.protocol`, whose `STUDIES` registers them with their
commands: `blocklab <study>`; `STUDY_NAMES` are their names). The CLI
(`blocklab.cli.commands`) and the report only parse arguments, call these
and print what they render; notebooks call them directly:

    import blocklab as bl
    result = bl.experiments.parameter_census.run_census(num_hiddens=512)
    print(result.table())

Layering: experiments import the library (models, training, diagnostics,
theory) and `blocklab.experiments.plotting`; nothing here imports
`blocklab.cli.commands` or
`blocklab.cli`. Submodules are imported on first use, so `import blocklab`
stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._render import dumps, markdown_table, nonfinite_paths, to_jsonable
from .protocol import STUDIES as _STUDIES
from .protocol import STUDY_NAMES

#: The study modules, importable as `blocklab.experiments.<module>`.
_LAZY = tuple(s.module_name for s in _STUDIES)

__all__ = [
    "STUDY_NAMES",
    "dumps",
    "markdown_table",
    "nonfinite_paths",
    "to_jsonable",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
