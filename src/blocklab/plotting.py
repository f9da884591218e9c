"""Small matplotlib helpers for the CLI and the report (PNG files, no display)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["line_plot", "bar_plot"]


def line_plot(
    path: str | Path,
    x: Sequence[float] | Mapping[str, Sequence[float]],
    ys: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    logx: bool = False,
    logy: bool = False,
    bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    hlines: Mapping[str, float] | None = None,
) -> Path:
    """Write a PNG with one line per entry of `ys` and return its path.

    Args:
        path: the PNG file to write (parent folders are created).
        x: shared x values, or one sequence per label of `ys`.
        ys: label -> y values.
        xlabel, ylabel, title: axis labels and an optional title.
        logx, logy: logarithmic axes.
        bands: label -> (low, high), drawn as a shaded band (min-max over seeds).
        hlines: label -> y, drawn as dashed horizontal reference lines.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, y in ys.items():
        xs = x[label] if isinstance(x, Mapping) else x
        (line,) = ax.plot(np.asarray(xs), np.asarray(y), label=label)
        if bands and label in bands:
            lo, hi = bands[label]
            ax.fill_between(np.asarray(xs), lo, hi, color=line.get_color(), alpha=0.2)
    for label, y in (hlines or {}).items():
        ax.axhline(y, linestyle="--", color="gray", linewidth=1)
        ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), fontsize=8)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    if title:
        ax.set_title(title)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(ys) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def bar_plot(
    path: str | Path,
    groups: Mapping[str, Mapping[str, float]],
    *,
    ylabel: str,
    title: str | None = None,
) -> Path:
    """Write a PNG of grouped bars and return its path.

    Args:
        path: the PNG file to write (parent folders are created).
        groups: group label (on the x axis) -> series label -> value; a series
            missing from a group leaves a gap.
        ylabel, title: the y-axis label and an optional title.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(groups)), 4.0), dpi=120)
    pos = np.arange(len(groups))
    for i, name in enumerate(series):
        vals = [values.get(name, np.nan) for values in groups.values()]
        ax.bar(pos + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
    ax.set_xticks(pos, list(groups), rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
