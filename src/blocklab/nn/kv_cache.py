r"""One attention layer's key/value cache.

An `AttentionCache` holds one layer's keys and values; `write_cache` writes new
rows into it in place. `MultiHeadAttention.init_cache` builds one and its
cached forward uses it; a whole model's cache (`blocklab.models.decoding`)
stacks one per layer and scans it with the blocks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int

from .._validate import ConfigError, check_bool
from .functional import _check_int_array

__all__ = ["AttentionCache", "check_per_sequence", "check_start", "write_cache"]


class AttentionCache(NamedTuple):
    """The keys and values of one attention layer for cached decoding (a pytree).

    Attributes:
        k: `(*batch, num_kv_heads, head_dim, max_len)` keys after QK-norm and
            RoPE at their absolute positions, stored transposed: a decoding
            step's $q^\top k_j$ then reads them as they lie (XLA:CPU copied a
            `(max_len, head_dim)` layout into this one for every layer and
            step).
        v: `(*batch, num_kv_heads, max_len, head_dim)` values.

    Index $j$ on the `max_len` axis is the token at position $j$. Build one with
    `MultiHeadAttention.init_cache`; `MultiHeadAttention.step` writes into it.
    Stacked caches (one per layer, leading layer axis) go through a scanned
    `Stack` as data.
    """

    k: Array
    v: Array


def write_cache(
    cache: AttentionCache,
    rows: AttentionCache,
    start: Int[ArrayLike, ""] | Int[ArrayLike, "*batch"],
    *,
    stacked: bool = False,
) -> AttentionCache:
    """`cache` with `rows` (new keys and values, `(*batch, KV, Tq, p)`, as
    `MultiHeadAttention.step(..., defer_write=True)` returns them) written at
    cache indices `start .. start + Tq - 1` of each sequence. `stacked`: both
    carry a leading layer axis (a `Stack`'s caches), written alike."""
    extra = 1 if check_bool("write_cache", "stacked", stacked) else 0
    outer = cache.v.shape[:extra]
    lead, Tq, L = cache.v.shape[extra:-3], rows.v.shape[-2], cache.v.shape[-2]
    start = check_start("write_cache", start, tuple(lead), Tq, L)
    n, m = int(np.prod(lead)), int(np.prod(outer))
    KV, p = cache.v.shape[-3], cache.v.shape[-1]
    # Scatters at the rows' (sequence, time) indices into the cache seen flat:
    # XLA does them in place on the cache's own layout (a vmap of per-sequence
    # updates had it transpose a stacked cache, twice per decoding step).
    t = start.reshape(1, n, 1, 1) + jnp.arange(Tq)  # (1, n, 1, Tq)
    slab = (jnp.arange(m)[:, None, None, None] * n + jnp.arange(n)[:, None, None]) * KV
    heads = slab + jnp.arange(KV)[:, None]  # (m, n, KV, 1)
    v_rows = (heads * L + t).reshape(-1)  # rows of p in v (m n KV Tq)
    # k is (…, KV, p, L): element (h, c, t) at (h p + c) L + t
    k_at = (heads[..., None] * p + jnp.arange(p)[:, None]) * L + t[..., None, :]

    def put_v(buf, new):
        new = new.astype(buf.dtype)
        if n == 1:  # one start: a plain slice update
            at = (0,) * (buf.ndim - 2) + (start.reshape(()), 0)
            return jax.lax.dynamic_update_slice(buf, new, at)
        flat = buf.reshape(-1, p).at[v_rows].set(new.reshape(-1, p))
        return flat.reshape(buf.shape)

    def put_k(buf, new):
        new = jnp.swapaxes(new.astype(buf.dtype), -1, -2)  # (…, KV, p, Tq)
        if n == 1:
            at = (0,) * (buf.ndim - 1) + (start.reshape(()),)
            return jax.lax.dynamic_update_slice(buf, new, at)
        flat = buf.reshape(-1).at[k_at.reshape(-1)].set(new.reshape(-1))
        return flat.reshape(buf.shape)

    return AttentionCache(put_k(cache.k, rows.k), put_v(cache.v, rows.v))


def check_per_sequence(
    owner: str, name: str, value: Any, lead: tuple, shape: str
) -> Array:
    """`value` checked as integers that are a scalar or broadcast to the batch
    shape `lead` (`shape` names it in the error); returned as an array."""
    arr = _check_int_array(owner, name, value)
    try:
        ok = np.broadcast_shapes(arr.shape, lead) == lead
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"{owner}: {name} must be a scalar or have the batch shape "
            f"{shape}, got shape {tuple(arr.shape)}."
        )
    return arr


def check_start(owner: str, start: Any, lead: tuple, Tq: int, max_len: int) -> Array:
    """`start` checked and broadcast to the batch shape `lead` (int32)."""
    arr = check_per_sequence(owner, "start", start, lead, f"x.shape[:-2] = {lead}")
    if not isinstance(start, jax.core.Tracer):
        top = int(np.max(np.asarray(start))) if np.size(start) else 0
        if top + Tq > max_len:
            raise ConfigError(
                f"{owner}: start + Tq must be <= the cache's max_len={max_len}, got "
                f"start={np.asarray(start).tolist()}, Tq={Tq}."
            )
    return jnp.broadcast_to(arr.astype(jnp.int32), lead)
