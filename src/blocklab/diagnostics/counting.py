"""Parameter counting."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from .._validate import ConfigError
from ..nn.block import TransformerBlock
from ..nn.config import BlockConfig

__all__ = ["count_params", "census"]


def _is_param(leaf) -> bool:
    """A floating-point array, or its abstract stand-in from `eqx.filter_eval_shape`."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.issubdtype(leaf.dtype, jnp.inexact)
    return eqx.is_inexact_array(leaf)


def _abstract(module):
    """A `BlockConfig` as its block, built abstractly (shapes only, no weights)."""
    if isinstance(module, BlockConfig):
        return eqx.filter_eval_shape(TransformerBlock, module, key=jax.random.key(0))
    return module


def count_params(module) -> int:
    """Number of trainable scalars: the sizes of all floating-point arrays in `module`.

    `module` may be a `BlockConfig`: its `TransformerBlock` is counted.

    Integer leaves are not parameters: the per-layer attention settings
    (`MultiHeadAttention.window`, `.rope_theta`, int32 data) are not counted.
    Works on abstract modules too (`eqx.filter_eval_shape`), so a census of a
    large configuration allocates nothing.
    """
    return _count(_abstract(module))


def _count(tree) -> int:
    leaves = jax.tree_util.tree_leaves(tree)
    return int(sum(leaf.size for leaf in leaves if _is_param(leaf)))


def census(module) -> dict[str, int]:
    """Parameter count per top-level part of `module`, plus `"total"`.

    Parts are the module's dataclass fields that hold parameters, in
    declaration order; for a `TransformerBlock` these are `norm1`, `norm2`,
    (`out_norm1`, `out_norm2`,) `attention` and `ffn`. `module` may be a
    `BlockConfig`: the census of its `TransformerBlock` (built abstractly).

    >>> census(TransformerBlock(256, 8, key=key))["attention"]
    262144
    """
    module = _abstract(module)
    if not dataclasses.is_dataclass(module) or isinstance(module, type):
        raise ConfigError(
            f"census: module must be an Equinox module (e.g. a TransformerBlock) "
            f"or a BlockConfig, got {type(module).__name__}; for a plain pytree "
            "(a dict of arrays) use count_params(tree)."
        )
    parts = {}
    for field in dataclasses.fields(module):
        n = _count(getattr(module, field.name, None))
        if n:
            parts[field.name] = n
    parts["total"] = _count(module)
    return parts
