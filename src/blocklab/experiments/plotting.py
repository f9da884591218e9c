"""Small matplotlib helpers for the experiments, the CLI and the report.

PNG files only (the Agg backend, no display), written atomically
(`blocklab._io.atomic_path`: a failed write never leaves a half-written
figure or destroys an earlier one).

Figures never crash on what a diverged run produces: non-finite points
(NaN, +-inf) are dropped, values beyond +-1e100 are clipped (matplotlib's
tick and transform arithmetic overflows past about 1e300, and a log axis
spanning 1e-4 .. 1e30 is still drawable), points <= 0 are dropped from a log
axis, and the figure says how many points it left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from numpy.typing import ArrayLike  # noqa: E402

from .._io import atomic_path  # noqa: E402
from .._validate import ConfigError  # noqa: E402

__all__ = ["line_plot", "bar_plot", "sanitize"]

#: Finite values beyond this magnitude are clipped before plotting.
CLIP = 1e100


def sanitize(
    x: ArrayLike, y: ArrayLike, *, logx: bool = False, logy: bool = False
) -> tuple[np.ndarray, np.ndarray, int]:
    """Drop the points of (x, y) that cannot be drawn; clip the extreme ones.

    Returns `(x, y, dropped)`: float64 arrays of the drawable points, with
    |values| clipped to `CLIP`, and the number of points dropped (non-finite in
    either coordinate, or <= 0 on a log axis).
    """
    xs = np.asarray(x, np.float64).ravel()
    ys = np.asarray(y, np.float64).ravel()
    if xs.shape != ys.shape:
        raise ConfigError(
            f"plotting: x has {xs.size} values and y {ys.size}; they must match."
        )
    keep = np.isfinite(xs) & np.isfinite(ys)
    if logx:
        keep &= xs > 0
    if logy:
        keep &= ys > 0
    xs, ys = np.clip(xs[keep], -CLIP, CLIP), np.clip(ys[keep], -CLIP, CLIP)
    return xs, ys, int(keep.size - keep.sum())


def _note_dropped(ax, dropped: int) -> None:
    if dropped:
        ax.annotate(
            f"{dropped} non-finite or off-scale point{'s' * (dropped > 1)} not shown",
            (0.99, 0.01),
            xycoords="axes fraction",
            ha="right",
            va="bottom",
            fontsize=7,
            color="firebrick",
        )


def _save(fig, path: Path) -> Path:
    try:
        fig.tight_layout()
    except (ValueError, np.linalg.LinAlgError):  # degenerate axes: keep the layout
        pass
    with atomic_path(path, owner="plotting") as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def line_plot(
    path: str | Path,
    x: ArrayLike | Mapping[str, ArrayLike],
    ys: Mapping[str, ArrayLike],
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    logx: bool = False,
    logy: bool = False,
    bands: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
    hlines: Mapping[str, float | int] | None = None,
) -> Path:
    """Write a PNG with one line per entry of `ys` and return its path.

    Args:
        path: the PNG file to write (parent folders are created).
        x: shared x values, or one sequence per label of `ys`.
        ys: label -> y values. Non-finite points are left out (see the module
            docstring), and the figure notes how many.
        xlabel, ylabel, title: axis labels and an optional title.
        logx, logy: logarithmic axes.
        bands: label -> (low, high), drawn as a shaded band (min-max over seeds).
        hlines: label -> y, drawn as dashed horizontal reference lines
            (non-finite ones are skipped).
    """
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    dropped = 0
    for label, y in ys.items():
        xs = x[label] if isinstance(x, Mapping) else x
        px, py, n = sanitize(xs, y, logx=logx, logy=logy)
        dropped += n
        (line,) = ax.plot(px, py, label=label)
        if bands and label in bands:
            lo, hi = bands[label]
            bx, blo, _ = sanitize(xs, lo, logx=logx, logy=logy)
            bx2, bhi, _ = sanitize(xs, hi, logx=logx, logy=logy)
            if bx.shape == bx2.shape and np.array_equal(bx, bx2) and bx.size:
                ax.fill_between(bx, blo, bhi, color=line.get_color(), alpha=0.2)
    for label, y in (hlines or {}).items():
        y = float(y)
        if not np.isfinite(y) or (logy and y <= 0):
            dropped += 1
            continue
        y = float(np.clip(y, -CLIP, CLIP))
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
    _note_dropped(ax, dropped)
    return _save(fig, path)


def bar_plot(
    path: str | Path,
    groups: Mapping[str, Mapping[str, float | int | None]],
    *,
    ylabel: str,
    title: str | None = None,
) -> Path:
    """Write a PNG of grouped bars and return its path.

    Args:
        path: the PNG file to write (parent folders are created).
        groups: group label (on the x axis) -> series label -> value; a series
            missing from a group, or a non-finite value, leaves a gap (the
            figure notes non-finite values).
        ylabel, title: the y-axis label and an optional title.
    """
    path = Path(path)
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(groups)), 4.0), dpi=120)
    pos = np.arange(len(groups))
    dropped = 0
    for i, name in enumerate(series):
        vals = np.array(
            [
                np.nan if values.get(name) is None else float(values[name])
                for values in groups.values()
            ],
            np.float64,
        )
        present = [name in values for values in groups.values()]
        dropped += int(np.sum(~np.isfinite(vals) & np.asarray(present, bool)))
        vals = np.where(np.isfinite(vals), np.clip(vals, -CLIP, CLIP), 0.0)
        ax.bar(pos + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
    ax.set_xticks(pos, list(groups), rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend()
    _note_dropped(ax, dropped)
    return _save(fig, path)
