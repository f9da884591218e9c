"""Rendering helpers shared by every experiment and command: strict JSON, Markdown.

JSON is always *strict* (RFC 8259): a non-finite float (NaN, +-inf, which
Python's `json` would write as the invalid tokens `NaN` / `Infinity`) is
written as `null`, NumPy and JAX scalars become Python numbers, arrays become
(nested) lists, dataclasses become objects and paths become strings.
`nonfinite_paths` names where non-finite values were, so a caller can say
which run diverged instead of leaving a reader with an unexplained `null`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePath
from typing import Any

import numpy as np

from .._validate import ConfigError

__all__ = [
    "dumps",
    "figure_links",
    "json_floats",
    "markdown_table",
    "nonfinite_paths",
    "to_jsonable",
]


def _is_array(obj: Any) -> bool:
    # NumPy arrays and scalars, and JAX arrays, without importing JAX here.
    return isinstance(obj, (np.ndarray, np.generic)) or (
        hasattr(obj, "__array__") and hasattr(obj, "dtype") and hasattr(obj, "shape")
    )


def to_jsonable(obj: Any) -> Any:
    """`obj` as plain JSON data: dict / list / str / int / float / bool / None.

    Non-finite floats become `None`; NumPy/JAX scalars and arrays become
    Python numbers and lists; dataclasses and mappings become dicts (keys as
    strings); tuples and other sequences become lists; paths become strings.
    Raises `TypeError` naming the type of anything else.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, PurePath):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
        }
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if _is_array(obj):
        a = np.asarray(obj)
        if a.dtype == np.bool_:
            return a.tolist()
        if np.issubdtype(a.dtype, np.integer):
            return a.tolist()
        if np.issubdtype(a.dtype, np.floating):
            a = a.astype(np.float64)
            if a.ndim == 0:
                v = float(a)
                return v if math.isfinite(v) else None
            return [to_jsonable(v) for v in a]
        if np.issubdtype(a.dtype, np.str_):
            return a.tolist()
        raise ConfigError(f"to_jsonable: arrays of dtype {a.dtype} have no JSON form.")
    if isinstance(obj, (list, tuple, set, frozenset)) or (
        isinstance(obj, Sequence) and not isinstance(obj, (bytes, bytearray))
    ):
        return [to_jsonable(v) for v in obj]
    raise ConfigError(
        f"to_jsonable: a value of type {type(obj).__name__} has no JSON form."
    )


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` of `to_jsonable(obj)`: strict JSON (non-finite -> null)."""
    return json.dumps(to_jsonable(obj), allow_nan=False, **kwargs)


def json_floats(x: Any) -> Any:
    """`x` as float64 numbers in strict JSON: a float, or (nested) lists of
    floats, each non-finite value as `None`."""
    return to_jsonable(np.asarray(x, np.float64))


def nonfinite_paths(obj: Any, prefix: str = "") -> list[str]:
    """Dotted paths (`rows.gelu.loss[3]`) of the non-finite floats inside `obj`.

    Arrays report their first non-finite index only (`losses[17]`), so a
    diverged loss curve is one entry, not hundreds.
    """
    out: list[str] = []
    if isinstance(obj, float) and not math.isfinite(obj):
        return [prefix or "."]
    if isinstance(obj, (bool, int, str)) or obj is None:
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            out += nonfinite_paths(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if _is_array(obj):
        a = np.asarray(obj)
        if np.issubdtype(a.dtype, np.floating):
            bad = np.argwhere(~np.isfinite(a))
            if bad.size:
                index = ",".join(map(str, bad[0])) if a.ndim else ""
                return [f"{prefix}[{index}]" if index else (prefix or ".")]
        return out
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += nonfinite_paths(v, f"{prefix}[{i}]")
    return out


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[Any]], *, align: str | None = None
) -> str:
    """A Markdown table; `align` is one of `l`, `r`, `c` per column (default:
    the first column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header):
        raise ConfigError(
            f"markdown_table: align has {len(align)} letters for {len(header)} columns."
        )
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = [
        "| " + " | ".join(map(str, header)) + " |",
        "|" + "|".join(rule[a] for a in align) + "|",
    ]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def figure_links(paths: Iterable[PurePath]) -> str:
    """Markdown images of `paths`, one a line, each linked by file name (a
    report's figures sit beside it) with the file's stem as its alt text."""
    return "\n".join(f"![{p.stem}]({p.name})" for p in paths)
