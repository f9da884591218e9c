"""Durations as the command line prints them."""

from __future__ import annotations

__all__ = ["minutes"]


def minutes(seconds: float | int) -> str:
    """`42` -> `"42 s"`, `700` -> `"12 min"`, `20000` -> `"5.6 h"`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 3 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
