"""The seed rule of the studies: `blocklab.training.sharding.check_seeds`, one rule everywhere.

A seed is a non-negative integer below $2^{32}$ (it becomes
`jax.random.key(seed)`, whose seed is a uint32), given as a Python or NumPy
integer (not a `bool`); a list of seeds of a study is non-empty and holds no
duplicate (two equal seeds would be the same run twice).
"""

from __future__ import annotations

from typing import Any

from .._validate import check_int
from ..training.sharding import MAX_SEED, check_seeds

__all__ = ["check_seed", "check_seeds"]


def check_seed(owner: str, name: str, seed: Any) -> int:
    """Return `seed` as an int in `[0, 2**32 - 1]`, or raise `ConfigError`."""
    return check_int(owner, name, seed, min=0, max=MAX_SEED)
