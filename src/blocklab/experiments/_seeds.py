"""The seed rule of the studies: `blocklab.training.member_axis.check_seeds`, one
rule everywhere.

One meaning per name, in every study and command: `seeds` lists the seeds
themselves (`seeds=(0, 1, 2)`, `blocklab activations --seeds 0 1 2`);
`num_seeds` counts them, meaning seeds `0 .. num_seeds - 1`
(`signal_propagation(num_seeds=4)`, `blocklab signal --num-seeds 4`). The
older `seeds=N` count of the signal and check studies is still accepted,
with a `DeprecationWarning` (`resolve_num_seeds`).

A seed is a non-negative integer below $2^{32}$ (it becomes
`jax.random.key(seed)`, whose seed is a uint32), given as a Python or NumPy
integer (not a `bool`); a list of seeds of a study is non-empty and holds no
duplicate (two equal seeds would be the same run twice).
"""

from __future__ import annotations

import warnings
from typing import Any

from .._validate import ConfigError, check_int
from ..training.member_axis import MAX_SEED, check_seeds

__all__ = ["check_seed", "check_seeds", "resolve_num_seeds"]


def check_seed(owner: str, name: str, seed: Any) -> int:
    """Return `seed` as an int in `[0, 2**32 - 1]`, or raise `ConfigError`."""
    return check_int(owner, name, seed, min=0, max=MAX_SEED)


def resolve_num_seeds(
    owner: str, num_seeds: Any, seeds: Any = None, *, default: int, min: int = 1
) -> int:  # noqa: A002 - reads best at the call site
    """The count of seeds, from `num_seeds` or the deprecated count `seeds=`.

    `seeds` (not `None`) is the older spelling of the count: it is accepted
    with a `DeprecationWarning`, unless `num_seeds` was given too (then
    `ConfigError`). The count is an int `>= min`.
    """
    if seeds is not None:
        if num_seeds != default:
            raise ConfigError(
                f"{owner}: got num_seeds={num_seeds!r} and the deprecated count "
                f"seeds={seeds!r}; pass num_seeds only."
            )
        warnings.warn(
            f"{owner}: seeds={seeds!r} as a count is deprecated (in "
            "blocklab.experiments `seeds` lists the seeds themselves); pass "
            f"num_seeds={seeds!r}.",
            DeprecationWarning,
            stacklevel=3,
        )
        num_seeds = seeds
    return check_int(owner, "num_seeds", num_seeds, min=min)
