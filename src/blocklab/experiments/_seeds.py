"""The seed rule of the studies: `blocklab.training.member_axis.check_seeds`, one
rule everywhere.

One meaning per name, in every study and command: `seeds` lists the seeds
themselves (`seeds=(0, 1, 2)`, `blocklab activations --seeds 0 1 2`);
`num_seeds` counts them, meaning seeds `0 .. num_seeds - 1`
(`signal_propagation(num_seeds=4)`, `blocklab signal --num-seeds 4`).

A seed is a non-negative integer below $2^{32}$ (it becomes
`jax.random.key(seed)`, whose seed is a uint32), given as a Python or NumPy
integer (not a `bool`); a list of seeds of a study is non-empty and holds no
duplicate (two equal seeds would be the same run twice).
"""

from __future__ import annotations

from typing import Any

from .._validate import check_int
from ..training.member_axis import MAX_SEED, check_seeds

__all__ = ["check_seed", "check_seeds"]


def check_seed(owner: str, name: str, seed: Any) -> int:
    """Return `seed` as an int in `[0, 2**32 - 1]`, or raise `ConfigError`."""
    return check_int(owner, name, seed, min=0, max=MAX_SEED)
