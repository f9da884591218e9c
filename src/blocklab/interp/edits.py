r"""The usual edits for `blocklab.interp.intervene`: each returns an
`fn(value, layer) -> value` for one site.

- `patch`: the value another run had there (activation patching).
- `ablate`: zero or mean in chosen entries along one axis: `ablate_heads` on
  `attn.hook_z` `(..., T, H, p)`, `ablate_neurons` on `mlp.hook_post`
  `(..., T, F)`.
- `steer`: a vector added at chosen layers, with a scale.

For a site of the scanned stack, a `source` recorded stacked `(L, ...)` is
read at the edit's `layer`; one recorded for a single layer is used as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jaxtyping import ArrayLike

from .._validate import ConfigError
from ..nn.hooks import Edit

__all__ = ["patch", "ablate", "ablate_heads", "ablate_neurons", "steer"]


def _at_layer(source, value, layer, owner):
    src = jnp.asarray(source)
    if layer is not None and src.ndim == value.ndim + 1:
        src = src[layer]
    try:
        return jnp.broadcast_to(src, value.shape).astype(value.dtype)
    except ValueError:
        raise ConfigError(
            f"{owner}: the source of shape {tuple(jnp.shape(source))} does not fit "
            f"the site's value of shape {tuple(value.shape)} (nor, stacked over "
            "layers, (L, *value.shape))."
        ) from None


def _mask(value, index, axis, owner):
    """Boolean mask, broadcastable to `value`, true at `index` along `axis`."""
    if not -value.ndim <= axis < value.ndim:
        raise ConfigError(
            f"{owner}: axis={axis} is out of range for the site's value of shape "
            f"{tuple(value.shape)}."
        )
    axis = axis % value.ndim
    n = value.shape[axis]
    idx = jnp.atleast_1d(jnp.asarray(index))
    if idx.size == 0:  # no entries: an empty list reads as float32
        idx = idx.astype(jnp.int32)
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ConfigError(f"{owner}: index must be integers, got dtype {idx.dtype}.")
    hit = jnp.zeros(n, bool).at[idx].set(True, mode="drop")
    shape = [1] * value.ndim
    shape[axis] = n
    return hit.reshape(shape)


def patch(
    source: Any,
    *,
    index: int | Sequence[int] | ArrayLike | None = None,
    axis: int = -2,
) -> Edit:
    r"""Replace the site's value with `source`'s: $a \leftarrow a'$.

    Args:
        source: the value another run had at this site (from `capture`),
            stacked `(L, ...)` or for one layer; it broadcasts to the site.
        index: patch only these entries along `axis` (heads of `hook_z` at
            `axis=-2`, positions of a residual site at `axis=-2`); `None`
            patches all.
        axis: the axis `index` counts along.
    """

    def fn(value, layer):
        src = _at_layer(source, value, layer, "patch")
        if index is None:
            return src
        return jnp.where(_mask(value, index, axis, "patch"), src, value)

    return fn


def ablate(
    index: int | Sequence[int] | ArrayLike,
    *,
    axis: int,
    mode: str = "zero",
    mean: Any = None,
) -> Edit:
    r"""Replace entries `index` along `axis` with zero or with a mean.

    `mode="zero"`: $a_i \leftarrow 0$. `mode="mean"`: $a_i \leftarrow
    \bar a_i$, with $\bar a$ = `mean` (e.g. a mean over a reference
    corpus, broadcastable to the site; stacked `(L, ...)` allowed), or, when
    `mean` is `None`, the mean of this run's value over every axis before
    `axis` (the positions and the batch).
    """
    if mode not in ("zero", "mean"):
        raise ConfigError(f"ablate: mode must be 'zero' or 'mean', got {mode!r}.")
    if mode == "zero" and mean is not None:
        raise ConfigError("ablate: mean is only used with mode='mean'.")

    def fn(value, layer):
        hit = _mask(value, index, axis, "ablate")
        if mode == "zero":
            fill = jnp.zeros((), value.dtype)
        elif mean is None:
            lead = tuple(range(value.ndim + axis if axis < 0 else axis))
            fill = jnp.mean(value, axis=lead, keepdims=True).astype(value.dtype)
        else:
            fill = _at_layer(mean, value, layer, "ablate")
        return jnp.where(hit, fill, value)

    return fn


def ablate_heads(
    heads: int | Sequence[int] | ArrayLike, *, mode: str = "zero", mean: Any = None
) -> Edit:
    """`ablate` of attention heads, for the site `attn.hook_z` `(..., T, H, p)`
    (each head's mixed values before $W_O$: the head no longer writes, or
    writes its mean)."""
    return ablate(heads, axis=-2, mode=mode, mean=mean)


def ablate_neurons(
    neurons: int | Sequence[int] | ArrayLike, *, mode: str = "zero", mean: Any = None
) -> Edit:
    """`ablate` of FFN hidden units, for `mlp.hook_post` (or `mlp.hook_pre`)
    `(..., T, F)`."""
    return ablate(neurons, axis=-1, mode=mode, mean=mean)


def steer(
    vector: Any,
    *,
    scale: float = 1.0,
    layers: int | Sequence[int] | None = None,
    positions: int | Sequence[int] | None = None,
) -> Edit:
    r"""Add a steering vector: $h \leftarrow h + c\, v$ at the chosen layers
    and positions of a residual site (`hook_resid_pre`/`_mid`/`_post`,
    `(..., T, d)`).

    Args:
        vector: $v$, shape `(d,)` (or anything broadcasting to the site).
        scale: $c$.
        layers: block indices to steer at (`None`: every layer the site
            name selects).
        positions: token positions to steer at (`None`: all).
    """

    def fn(value, layer):
        v = jnp.asarray(vector)
        try:
            add = jnp.broadcast_to(scale * v, value.shape).astype(value.dtype)
        except ValueError:
            raise ConfigError(
                f"steer: a vector of shape {tuple(v.shape)} does not fit the "
                f"site's value of shape {tuple(value.shape)}."
            ) from None
        if positions is not None:
            add = jnp.where(_mask(value, positions, -2, "steer"), add, 0)
        out = value + add
        if layers is None:
            return out
        if layer is None:
            raise ConfigError("steer: layers= is for a site of the scanned stack.")
        hit = jnp.isin(layer, jnp.atleast_1d(jnp.asarray(layers, jnp.int32)))
        return jnp.where(hit, out, value)

    return fn
