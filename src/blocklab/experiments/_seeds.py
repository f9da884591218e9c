"""One rule for seeds, shared by every study that takes a list of them.

A seed is a non-negative integer below $2^{32}$ (it becomes
`jax.random.key(seed)`, whose seed is a uint32), given as a Python or NumPy
integer (not a `bool`); a list of seeds is non-empty and holds no duplicate
(two equal seeds would be the same run twice, and would be reported as two).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._validate import ConfigError, check_int

__all__ = ["check_seed", "check_seeds"]

_MAX_SEED = 2**32 - 1


def check_seed(owner: str, name: str, seed: Any) -> int:
    """Return `seed` as an int in `[0, 2**32 - 1]`, or raise `ConfigError`."""
    return check_int(owner, name, seed, min=0, max=_MAX_SEED)


def check_seeds(owner: str, name: str, seeds: Any) -> tuple[int, ...]:
    """Return `seeds` as a tuple of distinct ints in `[0, 2**32 - 1]` (non-empty)."""
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Iterable):
        raise ConfigError(
            f"{owner}: {name} must be a sequence of int seeds, got {seeds!r}."
        )
    out = tuple(check_seed(owner, f"{name}[{i}]", s) for i, s in enumerate(seeds))
    if not out:
        raise ConfigError(f"{owner}: {name} must hold at least one seed, got none.")
    dup = sorted({s for s in out if out.count(s) > 1})
    if dup:
        raise ConfigError(
            f"{owner}: {name} must be distinct, got {list(out)} (repeated: {dup}); "
            "each seed is one run."
        )
    return out
