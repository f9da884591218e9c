r"""T5's relative position bias: bucketed key-minus-query offsets, one scalar per head.

T5 (Raffel et al., 2020) has no absolute positions. Each attention logit
$q_i^\top k_j$ of a self-attention layer gets an additive, learned bias
$b_h(\beta(j - i))$ that depends only on the head $h$ and on the *bucket*
$\beta$ of the relative position $r = j - i$ (key position minus query
position). Small offsets have a bucket each; larger ones share
logarithmically wider buckets up to `max_distance`, beyond which all offsets
share the last bucket.

With $n$ buckets (`num_buckets`) and maximum distance $M$:

- bidirectional (an encoder): $n \leftarrow n/2$ (integer halving); offsets
  $r > 0$ (keys to the right) use the upper half, offset $+n$; the distance
  is $d = |r|$;
- causal (a decoder's self-attention): $d = \max(-r, 0)$ (future keys map to
  bucket 0; they are masked anyway);

then, with $m = \lfloor n/2 \rfloor$ exact buckets,
$$\beta(d) = \begin{cases} d & d < m \\
\min\!\Big(m + \operatorname{trunc}\big(\tfrac{\ln(d/m)}{\ln(M/m)}\,(n-m)\big),
\; n - 1\Big) & d \ge m, \end{cases}$$
the logarithm evaluated in float32 as Mesh TensorFlow and `transformers`
(`T5Attention._relative_position_bucket`) evaluate it. The float32 rounding
decides the bucket where the real value is an integer (with $n = 16$,
$M = 128$: $d = 16, 32, 64$), so the buckets are tabulated once on the host
(NumPy, float32, truncation toward zero as a cast to an integer does) for
$d = 0, \ldots, M$ and looked up; every $d \ge M$ lands in bucket $n - 1$.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_float, check_int, check_key
from .stack import PerLayer, Stack

__all__ = [
    "RelativePositionBias",
    "bucket_table",
    "relative_bias_tables",
    "relative_position_bucket",
    "stack_bias_inputs",
]


def _check_buckets(
    owner: str, num_buckets, max_distance, bidirectional
) -> tuple[int, int, bool]:
    num_buckets = check_int(owner, "num_buckets", num_buckets, min=1)
    max_distance = check_int(owner, "max_distance", max_distance, min=1)
    bidirectional = check_bool(owner, "bidirectional", bidirectional)
    n = num_buckets // 2 if bidirectional else num_buckets
    m = n // 2
    if m < 1:
        raise ConfigError(
            f"{owner}: num_buckets={num_buckets} leaves no exact bucket "
            f"(bidirectional={bidirectional}: {n} buckets per direction, {m} exact); "
            f"use num_buckets >= {4 if bidirectional else 2}."
        )
    if max_distance <= m:
        raise ConfigError(
            f"{owner}: max_distance must exceed the {m} exact buckets "
            f"(num_buckets={num_buckets}, bidirectional={bidirectional}), got "
            f"max_distance={max_distance}; the logarithmic buckets span the "
            f"distances from {m} to max_distance."
        )
    return num_buckets, max_distance, bidirectional


@functools.lru_cache(maxsize=64)
def _table(num_buckets: int, max_distance: int, bidirectional: bool) -> np.ndarray:
    n = num_buckets // 2 if bidirectional else num_buckets
    m = n // 2
    d = np.arange(max_distance + 1)
    far = np.maximum(d, m).astype(np.float32)  # the log is read only for d >= m
    ratio = np.log(far / np.float32(m)) / np.float32(math.log(max_distance / m))
    large = m + (ratio * np.float32(n - m)).astype(np.int64)  # truncation
    out = np.where(d < m, d, np.minimum(large, n - 1))
    out = out.astype(np.int32)
    out.setflags(write=False)
    return out


def bucket_table(
    num_buckets: int = 32, max_distance: int = 128, *, bidirectional: bool = True
) -> np.ndarray:
    r"""$\beta(d)$ for the distances $d = 0, \ldots, M$ (int32, read-only),
    without the $+n$ offset of positive offsets in the bidirectional case;
    $\beta(d) = \beta(M) = n - 1$ for every $d \ge M$.

    Raises:
        ConfigError: fewer than one exact bucket, or `max_distance` not above
            the exact buckets (`transformers` would index outside the table).
    """
    return _table(
        *_check_buckets("bucket_table", num_buckets, max_distance, bidirectional)
    )


def relative_position_bucket(
    relative_position: Int[ArrayLike, "*shape"],
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Int[Array, "*shape"]:
    r"""The bucket $\beta$ of each relative position $r$ = key − query (see the
    module docstring): in $[0, n)$, the upper half for $r > 0$ when
    `bidirectional`. Works on traced arrays (a table lookup)."""
    num_buckets, max_distance, bidirectional = _check_buckets(
        "relative_position_bucket", num_buckets, max_distance, bidirectional
    )
    table = jnp.asarray(_table(num_buckets, max_distance, bidirectional))
    r = jnp.asarray(relative_position)
    if not jnp.issubdtype(r.dtype, jnp.integer):
        raise ConfigError(
            "relative_position_bucket: relative_position must be integers, got "
            f"dtype {r.dtype}."
        )
    if bidirectional:
        offset = jnp.where(r > 0, num_buckets // 2, 0)
        d = jnp.abs(r)
    else:
        offset = 0
        d = jnp.maximum(-r, 0)
    return (offset + table[jnp.minimum(d, max_distance)]).astype(jnp.int32)


class RelativePositionBias(eqx.Module):
    r"""T5's learned relative position bias, $B_{h,i,j} = W[\beta(p^k_j - p^q_i), h]$.

    `weight` is the `(num_buckets, num_heads)` table (the layout of
    `transformers`' `relative_attention_bias` embedding), drawn
    $\mathcal N(0, 0.02^2)$. Calling it gives the `(heads, Tq, Tk)` additive
    bias of the attention logits for query positions $p^q$ and key positions
    $p^k$ (T5 adds it to the unscaled logits $q^\top k$, before the mask).
    In T5 only the first layer of each stack owns a table; every layer of the
    stack adds the same bias. In umT5 every self-attention layer owns one
    (the model holds them stacked, a `Stack` of these, and gathers layer
    $i$'s bias inside the stack's scan: `gather`). Cross-attention has none.
    """

    weight: Float[Array, "buckets heads"]
    num_buckets: int = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    bidirectional: bool = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        init_std: float = 0.02,
        key: PRNGKeyArray,
    ):
        """Args:
        num_heads: heads $H$ (one bias per head).
        num_buckets: buckets $n$ (T5: 32).
        max_distance: $M$ (T5: 128).
        bidirectional: an encoder's buckets (both directions); `False`: a
            decoder's causal ones.
        init_std: the standard deviation of the initial table.
        key: PRNG key for the table.
        """
        owner = "RelativePositionBias"
        self.num_heads = check_int(owner, "num_heads", num_heads, min=1)
        self.num_buckets, self.max_distance, self.bidirectional = _check_buckets(
            owner, num_buckets, max_distance, bidirectional
        )
        std = check_float(owner, "init_std", init_std, min=0.0)
        key = check_key(owner, "key", key)
        self.weight = std * jax.random.normal(
            key, (self.num_buckets, self.num_heads), jnp.float32
        )

    def buckets(
        self,
        query_positions: Int[ArrayLike, "*#batch Tq"],
        key_positions: Int[ArrayLike, "*#batch Tk"],
    ) -> Int[Array, "*batch Tq Tk"]:
        """The bucket of every (query, key) pair."""
        q = jnp.asarray(query_positions)
        k = jnp.asarray(key_positions)
        for name, a in (("query_positions", q), ("key_positions", k)):
            if a.ndim < 1 or not jnp.issubdtype(a.dtype, jnp.integer):
                raise ConfigError(
                    f"RelativePositionBias: {name} must be integers of shape "
                    f"(..., T), got dtype {a.dtype}, shape {tuple(a.shape)}."
                )
        return relative_position_bucket(
            k[..., None, :] - q[..., :, None],
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def __call__(
        self,
        num_queries: int,
        num_keys: int,
        *,
        offset: Int[ArrayLike, "*batch"] | int = 0,
    ) -> Float[Array, "*batch heads Tq Tk"]:
        r"""The bias for queries at positions `offset + 0..num_queries-1` and
        keys at `0..num_keys-1` (a decoder step: `offset` = the number of
        cached tokens; it may be traced, or one per sequence `(...,)`).

        Returns:
            `(..., heads, num_queries, num_keys)` in the table's dtype.
        """
        return self.gather(self.grid(num_queries, num_keys, offset=offset))

    def grid(
        self,
        num_queries: int,
        num_keys: int,
        *,
        offset: Int[ArrayLike, "*batch"] | int = 0,
    ) -> Int[Array, "*batch Tq Tk"]:
        """The buckets of `__call__`'s (query, key) pairs, `(..., Tq, Tk)`:
        they depend on the buckets' settings only, not on the table, so one
        grid serves every layer of a stack (`gather`)."""
        owner = "RelativePositionBias"
        num_queries = check_int(owner, "num_queries", num_queries, min=1)
        num_keys = check_int(owner, "num_keys", num_keys, min=1)
        off = jnp.asarray(offset)
        q = off[..., None] + jnp.arange(num_queries)
        k = jnp.broadcast_to(jnp.arange(num_keys), (*off.shape, num_keys))
        return self.buckets(q, k)

    def from_positions(
        self,
        query_positions: Int[ArrayLike, "*#batch Tq"],
        key_positions: Int[ArrayLike, "*#batch Tk"],
    ) -> Float[Array, "*batch heads Tq Tk"]:
        """The bias for explicit positions: `(..., heads, Tq, Tk)`."""
        return self.gather(self.buckets(query_positions, key_positions))

    def gather(
        self, buckets: Int[Array, "*batch Tq Tk"]
    ) -> Float[Array, "*batch heads Tq Tk"]:
        r"""$B_{h,i,j} = W[\beta_{ij}, h]$ for given buckets (from `buckets`):
        `(..., heads, Tq, Tk)`, in the table's dtype."""
        return jnp.moveaxis(self.weight[buckets], -1, -3)


def relative_bias_tables(
    num_heads: int,
    num_blks: int,
    *,
    per_layer: bool,
    num_buckets: int,
    max_distance: int,
    bidirectional: bool,
    key: PRNGKeyArray,
) -> RelativePositionBias | Stack:
    """A stack's relative position bias: one `RelativePositionBias` shared by
    its layers (T5), or with `per_layer` a `Stack` of `num_blks` of them, the
    tables stacked `(num_blks, buckets, heads)` (umT5); `stack_bias_inputs`
    turns either into the stack's keywords."""

    def table(k):
        return RelativePositionBias(
            num_heads, num_buckets=num_buckets, max_distance=max_distance,
            bidirectional=bidirectional, key=k,
        )  # fmt: skip

    return Stack(table, num_blks, key=key) if per_layer else table(key)


def stack_bias_inputs(
    rel: RelativePositionBias | Stack | None,
    num_queries: int,
    num_keys: int,
    *,
    offset: Int[ArrayLike, "*batch"] | int = 0,
) -> dict[str, Any]:
    """The `Stack` keywords that add a relative position bias to every
    layer's self-attention scores (`{}` without one): a shared table's bias
    `score_bias`, `(..., H, Tq, Tk)` float32, the same for every layer (T5);
    or, for one table per layer (umT5: a `Stack` of tables, `(N, buckets,
    H)`), the buckets computed once and each layer's gather inside the
    stack's scan (`layer_inputs`, a `PerLayer`). Queries and keys as for
    `RelativePositionBias.__call__`."""
    if rel is None:
        return {}
    if isinstance(rel, Stack):
        grid = rel.block(0).grid(num_queries, num_keys, offset=offset)
        return {"layer_inputs": {"score_bias": PerLayer(rel.blocks, grid, _gather)}}
    bias = rel(num_queries, num_keys, offset=offset)
    return {"score_bias": bias.astype(jnp.float32)}


def _gather(table: RelativePositionBias, grid: Array) -> Array:
    return table.gather(grid).astype(jnp.float32)
