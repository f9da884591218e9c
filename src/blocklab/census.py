"""Parameter counting."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax

__all__ = ["count_params", "census"]


def count_params(module) -> int:
    """Number of trainable scalars: the sizes of all floating-point arrays in `module`."""
    leaves = jax.tree_util.tree_leaves(eqx.filter(module, eqx.is_inexact_array))
    return int(sum(leaf.size for leaf in leaves))


def census(module) -> dict[str, int]:
    """Parameter count per top-level part of `module`, plus `"total"`.

    Parts are the module's dataclass fields that hold parameters, in
    declaration order; for a `TransformerBlock` these are `norm1`, `norm2`,
    (`out_norm1`, `out_norm2`,) `attention` and `ffn`.

    >>> census(TransformerBlock(256, 8, key=key))["attention"]
    262144
    """
    parts = {}
    for field in dataclasses.fields(module):
        n = count_params(getattr(module, field.name, None))
        if n:
            parts[field.name] = n
    parts["total"] = count_params(module)
    return parts
