r"""Attention-head detectors and head-mask edits.

Scores read from an attention pattern $A$ (query $i$, key $j$; the
`blocks.*.attn.hook_pattern` site, `(..., T, T)` per head), and edits of the
per-head mixed values (`blocks.*.attn.hook_z`) for a mask of heads that may
differ by layer and be traced (one mask per seed under `vmap`):

- `prefix_matching_scores`: the induction score (Olsson et al. 2022, "In-context
  learning and induction heads") on sequences that end in a repeat;
- `previous_token_scores`: the weight on the previous token;
- `random_heads`: a control mask as large as a given one, disjoint from it;
- `heads_edit`: zero or patch the heads of a mask (`intervene`'s edit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._validate import ConfigError, check_int

__all__ = [
    "heads_edit",
    "prefix_matching_scores",
    "previous_token_scores",
    "random_heads",
]


def prefix_matching_scores(
    pattern: Float[Array, "*batch T T"], repeat: int
) -> Float[Array, "*batch"]:
    r"""$\frac1P \sum_{i=T-P}^{T-1} A_{i,\, i-P+1}$ for attention patterns $A$
    `(..., T, T)` (query, key) of sequences whose last $P$ = `repeat` tokens
    repeat the $P$ before them.

    Key $i - P + 1$ holds the token after the earlier occurrence of $x_i$.
    """
    P = check_int("prefix_matching_scores", "repeat", repeat, min=1)
    T = pattern.shape[-1]
    if pattern.ndim < 2 or pattern.shape[-2] != T or T < 2 * P:
        raise ConfigError(
            f"prefix_matching_scores: pattern must be (..., T, T) with T >= 2 * "
            f"repeat = {2 * P}, got shape {tuple(pattern.shape)}."
        )
    q = jnp.arange(T - P, T)
    return jnp.mean(pattern[..., q, q - P + 1], axis=-1)


def previous_token_scores(
    pattern: Float[Array, "*batch T T"],
) -> Float[Array, "*batch"]:
    r"""$\frac1{T-1} \sum_{i=1}^{T-1} A_{i,\, i-1}$, the mean weight on the
    previous token, for attention patterns `(..., T, T)` (query, key)."""
    q = jnp.arange(1, pattern.shape[-1])
    return jnp.mean(pattern[..., q, q - 1], axis=-1)


def random_heads(key: PRNGKeyArray, heads: Bool[Array, "L H"]) -> Bool[Array, "L H"]:
    """As many heads as the mask `heads` holds, drawn uniformly from the other
    heads (all of them when there are fewer): a mask disjoint from `heads`."""
    u = jnp.where(heads, jnp.inf, jax.random.uniform(key, heads.shape)).ravel()
    rank = jnp.argsort(jnp.argsort(u)).reshape(heads.shape)
    return (rank < jnp.sum(heads)) & ~heads


def heads_edit(
    heads: Bool[Array, "L H"], *, source: Float[Array, "L ..."] | None = None
) -> Callable[[Array, Any], Array]:
    r"""An edit of `blocks.*.attn.hook_z` `(..., T, H, p)` for the heads of a
    mask `(L, H)`, which may differ by layer and be traced (one mask per seed
    under vmap): at layer $l$, $z_{\cdot, h} \leftarrow 0$ (`source=None`, as
    `blocklab.interp.ablate_heads`) or $z_{\cdot, h} \leftarrow
    z'_{\cdot, h}$ with $z'$ = `source[l]` (a capture of another run stacked
    over layers, as `blocklab.interp.patch(source, index=..., axis=-2)`), for
    every head $h$ with `heads[l, h]`.
    """

    def fn(value, layer):
        hit = heads[layer][:, None]  # (H, 1): broadcasts over (..., T, H, p)
        if source is None:
            fill = jnp.zeros((), value.dtype)
        else:
            fill = jnp.broadcast_to(source[layer], value.shape).astype(value.dtype)
        return jnp.where(hit, fill, value)

    return fn
