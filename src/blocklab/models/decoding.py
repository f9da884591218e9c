r"""Decoding a whole model: its cache, and the cached forward pass.

A `DecoderCache` holds, for every layer of a model's `Stack`, the keys and
values its attention has computed so far (`MultiHeadAttention.init_cache`),
stacked with a leading layer axis, and for every sequence its length: the
index where its next token goes, which is also that token's position (its RoPE
angle, or its row of a learned position table). `extend` runs new tokens
through a model with it; `init_cache`, `prefill` and `decode_step` are the
checked entry points, which `DecoderLM` and `CharLM` expose as one-line
methods of the same names (only their docstrings and argument names differ),
and `blocklab.generate` loops on it.

A decode loop that reruns the same blocks many times may instead split the
model and its cache per layer once, before the loop (`unstack`), and run the
blocks one after another (`decode_blocks`): `generate`'s unrolled loop.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .._validate import ConfigError, check_ids, check_int
from ..nn.functional import linear
from ..nn.hooks import Hooks, at, scope
from ..nn.kv_cache import AttentionCache, write_cache

__all__ = [
    "DecoderCache", "Decoding", "init_cache", "extend", "prefill", "decode_step",
    "model_limits", "Unstacked", "unstack", "decode_blocks",
]  # fmt: skip


class DecoderCache(eqx.Module):
    r"""Keys, values and lengths of a batch of sequences being decoded (a pytree).

    Attributes:
        layers: the attention caches of the $N$ layers as one pytree, each
            leaf with a leading axis of size $N$ (what the blocks' attention
            `init_cache` returns, stacked), so `Stack.step` scans it together
            with the block parameters.
        length: `batch_shape` int32, the tokens held per sequence: the cache
            index and the position of each sequence's next token. RoPE
            positions therefore continue from each sequence's own length.
        max_len: the cache capacity (static): a sequence may hold at most
            `max_len` tokens.

    Every layer keeps all `max_len` positions, local (window) layers too: the
    layers of a scanned stack share one cache shape, and a window layer masks
    the keys older than its window instead of dropping them.
    """

    layers: Any
    length: Int[Array, "*batch"]
    max_len: int = eqx.field(static=True)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.length.shape)


def init_cache(
    model: Any,
    batch_shape: tuple[int, ...] = (),
    max_len: int | None = None,
    dtype: Any = None,
    *,
    owner: str,
) -> DecoderCache:
    """An empty cache (length 0) for `model` (a `DecoderLM` or `CharLM`).

    `max_len` defaults to the model's and may not exceed it; `dtype` defaults
    to the token embedding's. `owner` (`"DecoderLM.init_cache"`, ...) names
    the caller in errors, as in `prefill` and `decode_step`.
    """
    limit = model_limits(model)[1]
    max_len = check_int(
        owner, "max_len", limit if max_len is None else max_len, min=1, max=limit
    )
    if isinstance(batch_shape, (int, np.integer)):
        batch_shape = (int(batch_shape),)
    if not isinstance(batch_shape, tuple) or not all(
        isinstance(n, (int, np.integer)) and n >= 1 for n in batch_shape
    ):
        raise ConfigError(
            f"{owner}: batch_shape must be a tuple of positive ints, e.g. () for "
            f"one sequence or (B,) for a batch, got {batch_shape!r}."
        )
    batch_shape = tuple(int(n) for n in batch_shape)
    dtype = model.token_emb.weight.dtype if dtype is None else jnp.dtype(dtype)
    stack = model.stack
    attn = stack.block(0).attention
    one = attn.init_cache(batch_shape, max_len, dtype)
    layers = jax.tree_util.tree_map(
        lambda a: jnp.broadcast_to(a, (stack.num_blks, *a.shape)), one
    )
    return DecoderCache(layers, jnp.zeros(batch_shape, jnp.int32), max_len)


def model_limits(model: Any) -> tuple[int, int]:
    """`(vocab_size, max_len)` of a `DecoderLM` (`model.cfg`) or a `CharLM`."""
    cfg = getattr(model, "cfg", model)
    return int(cfg.vocab_size), int(cfg.max_len)


def _prompt_ids(owner: str, name: str, prompt: Any, *, batch: str = "") -> Array:
    """`prompt` as an array of integer token ids of shape `(T,)` or `(B, T)`
    with `T >= 1`, refused as `owner`'s argument `name` otherwise; `batch`
    is said after `(B, T)` in the message (`generate`, `capture_generate`)."""
    ids = jnp.asarray(prompt)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ConfigError(
            f"{owner}: {name} must be integer token ids, got dtype {ids.dtype}."
        )
    if ids.ndim not in (1, 2) or ids.shape[-1] < 1:
        raise ConfigError(
            f"{owner}: {name} must be one prompt (T,) or a batch (B, T){batch} "
            f"with T >= 1, got shape {tuple(ids.shape)}."
        )
    return ids


def _embed(
    model: Any, ids: Array, positions: Array, hooks: Hooks | None = None
) -> Array:
    """The model's input embedding of `ids` at `positions` (both `(..., Tq)`)."""
    h = model.token_emb.weight[ids]
    scale = getattr(getattr(model, "cfg", None), "embed_scale", None)
    if scale is not None:
        h = h * jnp.asarray(scale, h.dtype)
    h = at(hooks, "hook_embed", h)
    if model.pos_emb is not None:
        h = h + at(hooks, "hook_pos_embed", model.pos_emb.weight[positions])
    return h


def _head(model: Any, h: Array, hooks: Hooks | None = None) -> Array:
    """Final norm and head, float32 logits (as the model's `__call__`)."""
    normed = model.norm(h, hooks=scope(hooks, "ln_final"))
    if hasattr(model, "logits"):  # DecoderLM: head, readout multiplier, softcap
        return model.logits(normed, hooks=hooks)
    # a DecoderLM without `logits`, or CharLM (tied; readout 1, or d0/d: muP)
    weight = getattr(model, "head_weight", model.token_emb.weight)
    z = linear(normed, weight, out_dtype=jnp.float32)
    c = getattr(model, "readout_multiplier", 1.0)
    z = z if c == 1.0 else z * jnp.asarray(c, z.dtype)
    return at(hooks, "unembed.hook_out", z)


def extend(
    model: Any,
    ids: Int[Array, "*batch Tq"],
    cache: DecoderCache,
    num_valid: Int[ArrayLike, "*#batch"] | None = None,
    *,
    hooks: Hooks | None = None,
) -> tuple[Float[Array, "*batch Tq vocab"], DecoderCache]:
    r"""Run `Tq` new tokens per sequence through `model` with its cache (no checks).

    Sequence $b$'s tokens go to cache indices and positions
    $\ell_b, \ldots, \ell_b + T_q - 1$ ($\ell_b$ = `cache.length[b]`); token
    $i$ sees the cached tokens and new tokens $\le \ell_b + i$, so its logits
    are those of the uncached model at position $\ell_b + i$ of the sequence.
    The new length is $\ell_b$ + `num_valid` (default $T_q$): tokens beyond
    `num_valid` (right padding of a ragged batch) are written but will be
    overwritten by that sequence's next tokens before anyone reads them.
    """
    start = cache.length
    Tq = ids.shape[-1]
    positions = start[..., None] + jnp.arange(Tq, dtype=start.dtype)
    h = _embed(model, ids, positions, hooks)
    kw = {} if hooks is None else {"hooks": hooks}
    h, layers = model.stack.step(h, cache.layers, start, **kw)
    grow = Tq if num_valid is None else jnp.asarray(num_valid, start.dtype)
    return _head(model, h, hooks), DecoderCache(layers, start + grow, cache.max_len)


class Unstacked(NamedTuple):
    """A decode loop's state with the blocks run one after another
    (`unstack`, `decode_blocks`): per-layer caches, and per layer the keys
    and values of the previous token, not yet written."""

    layers: tuple
    pending: tuple
    length: Array


def unstack(model: Any, cache: DecoderCache) -> tuple[tuple, Unstacked]:
    """The blocks of `model` (`Stack.unstack`) and `cache` split per layer,
    for `decode_blocks`. Call it outside the decode loop: the slices are
    then taken once. Each layer's pending row starts as the cached row just
    before `cache.length` (row 0 of an empty cache): rewriting it changes
    nothing. The last token's keys and values stay pending: to get the full
    cache back, write them with `attention.write_cache` at `length - 1`.

    A batch of one sequence, `batch_shape == (1,)`, is held as one sequence
    (no batch axis; `decode_blocks` takes and returns it with its axis): with
    a unit batch axis, XLA drops the axis in a fused copy of each in-place
    write, and copies every layer's cache at every step.
    """
    blocks = model.stack.unstack()
    one = cache.length.shape == (1,)
    layers = tuple(
        jax.tree_util.tree_map(lambda a, i=i: a[i, 0] if one else a[i], cache.layers)
        for i in range(len(blocks))
    )
    length = cache.length[0] if one else cache.length
    last = jnp.maximum(length - 1, 0)
    pending = tuple(_rows_at(layer, last) for layer in layers)
    return blocks, Unstacked(layers, pending, length)


def _rows_at(layer: AttentionCache, index: Array) -> AttentionCache:
    """The cached keys and values at `index` (one per sequence), laid out as
    `step(..., defer_write=True)` returns new rows: `(*batch, KV, 1, p)`."""
    i = index[..., None, None, None]
    k = jnp.take_along_axis(layer.k, i, axis=-1)  # (*batch, KV, p, 1)
    v = jnp.take_along_axis(layer.v, i, axis=-2)  # (*batch, KV, 1, p)
    return AttentionCache(jnp.swapaxes(k, -1, -2), v)


def decode_blocks(
    model: Any, blocks: tuple, ids: Int[Array, "*batch 1"], state: Unstacked
) -> tuple[Float[Array, "*batch 1 vocab"], Unstacked]:
    """One token per sequence through the blocks run one after another: the
    logits of `decode_step`, and the next state.

    Each layer first writes its pending row (the previous token's keys and
    values) at `length - 1` (0 for an empty cache), then its block attends
    to the cache before `length` and to the new token (`step(...,
    defer_write=True)`), whose keys and values become the pending row.
    Written before it is read, each per-layer cache is updated in place;
    written after the reads, XLA copies it at every step, as nothing orders
    the write after them.
    """
    start = state.length
    one = ids.ndim == start.ndim + 2  # a batch of one, held as one sequence
    h = _embed(model, ids[0] if one else ids, start[..., None])
    layers, pending = [], []
    last = jnp.maximum(start - 1, 0)  # an empty cache: rewrite row 0
    for block, layer, rows in zip(blocks, state.layers, state.pending, strict=True):
        layer = write_cache(layer, rows, last)
        h, rows = block.step(h, layer, start, defer_write=True)
        layers.append(layer)
        pending.append(rows)
    logits = _head(model, h)
    return (logits[None] if one else logits), Unstacked(
        tuple(layers), tuple(pending), start + 1
    )


def _check_ids(owner: str, model: Any, ids: Any) -> Array:
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ConfigError(
            f"{owner}: ids must be integer token ids, got dtype {ids.dtype}."
        )
    vocab = model_limits(model)[0]
    return check_ids(owner, "token ids", ids, vocab, what="vocab_size")


def prefill(
    model: Any,
    ids: Any,
    cache: DecoderCache | None,
    lengths: Any,
    *,
    owner: str,
) -> tuple[Array, DecoderCache]:
    """Checked `extend` of a prompt: `model.prefill` of a `DecoderLM` or a
    `CharLM` (see `DecoderLM.prefill`); `owner` names it in errors."""
    ids = _check_ids(owner, model, ids)
    if ids.ndim < 1 or ids.shape[-1] < 1:
        raise ConfigError(
            f"{owner}: ids must be a prompt (T,) or a batch (..., T) with T >= 1, "
            f"got shape {tuple(ids.shape)}."
        )
    if cache is None:
        cache = init_cache(model, ids.shape[:-1], owner=owner)
    if not isinstance(cache, DecoderCache):
        raise ConfigError(
            f"{owner}: cache must be a DecoderCache (from init_cache), got "
            f"{type(cache).__name__}."
        )
    T = ids.shape[-1]
    if ids.shape[:-1] != cache.batch_shape:
        raise ConfigError(
            f"{owner}: ids of shape {tuple(ids.shape)} do not fit a cache for "
            f"batch_shape={cache.batch_shape}; ids must be (*batch_shape, T)."
        )
    if lengths is not None:
        lengths = jnp.asarray(lengths)
        if (
            not jnp.issubdtype(lengths.dtype, jnp.integer)
            or tuple(lengths.shape) != cache.batch_shape
        ):
            raise ConfigError(
                f"{owner}: lengths must be integers of shape batch_shape="
                f"{cache.batch_shape}, got dtype {lengths.dtype}, shape "
                f"{tuple(lengths.shape)}."
            )
        lengths = eqx.error_if(
            lengths,
            (lengths < 1) | (lengths > T),
            f"{owner}: lengths must lie in [1, T={T}].",
        )
    length = eqx.error_if(
        cache.length,
        cache.length + T > cache.max_len,
        f"{owner}: the new tokens do not fit the cache (max_len={cache.max_len}).",
    )
    cache = DecoderCache(cache.layers, length, cache.max_len)
    return extend(model, ids, cache, lengths)


def decode_step(
    model: Any, ids: Any, cache: DecoderCache, *, owner: str
) -> tuple[Array, DecoderCache]:
    """Checked `extend` of one token per sequence: `model.decode_step` (see
    `DecoderLM.decode_step`); `owner` names it in errors."""
    if not isinstance(cache, DecoderCache):
        raise ConfigError(
            f"{owner}: cache must be a DecoderCache (from init_cache or prefill), "
            f"got {type(cache).__name__}."
        )
    ids = _check_ids(owner, model, ids)
    if tuple(ids.shape) != cache.batch_shape:
        raise ConfigError(
            f"{owner} takes one token per sequence, ids of shape "
            f"batch_shape={cache.batch_shape}, got {tuple(ids.shape)}."
        )
    length = eqx.error_if(
        cache.length,
        cache.length >= cache.max_len,
        f"{owner}: the cache is full (max_len={cache.max_len}).",
    )
    logits, cache = extend(
        model, ids[..., None], DecoderCache(cache.layers, length, cache.max_len)
    )
    return logits[..., 0, :], cache


class Decoding:
    """The cached-decoding methods of a language model (`DecoderLM` and
    `CharLM` inherit them): each checks its arguments and calls this module's
    function of the same name, naming the model's class in its errors."""

    def init_cache(
        self,
        batch_shape: tuple[int, ...] = (),
        max_len: int | None = None,
        dtype: Any = None,
    ) -> DecoderCache:
        """An empty `DecoderCache` (length 0) for `batch_shape` sequences.

        Args:
            batch_shape: `()` for one sequence, `(B,)` for a batch.
            max_len: tokens each sequence may hold, at most (default)
                the model's `max_len`. Every layer keeps all of them, the local
                (window) layers too (one cache shape for the scanned stack;
                they mask the keys older than their window).
            dtype: of the keys and values; default the embedding's.
        """
        return init_cache(
            self, batch_shape, max_len, dtype, owner=f"{type(self).__name__}.init_cache"
        )

    def prefill(
        self,
        ids: Int[ArrayLike, "*batch T"],
        cache: DecoderCache | None = None,
        *,
        lengths: Int[ArrayLike, "*batch"] | None = None,
    ) -> tuple[Float[Array, "*batch T vocab"], DecoderCache]:
        r"""Run a prompt through the model, writing its keys and values.

        Sequence $b$'s tokens take positions and cache indices
        $\ell_b, \ldots, \ell_b + T - 1$ from its length $\ell_b$ in the
        cache (0 for a fresh one), so `prefill` also extends a cache by a
        chunk. Row $i$ of the logits equals `self(...)` at position
        $\ell_b + i$ of the whole sequence.

        Args:
            ids: `(T,)` or `(*batch, T)` token ids.
            cache: from `init_cache`; `None` makes one of the model's `max_len`.
            lengths: ragged right-padded prompts, shape `batch` (one per
                sequence, never per query): sequence $b$'s length grows
                by `lengths[b]` (in `[1, T]`) instead of $T$; its padding is
                written, but overwritten by its next tokens before any
                query sees it.

        Returns:
            `(logits, cache)`: `(*batch, T, vocab)` float32 logits and the
            cache with the new lengths.
        """
        return prefill(
            self, ids, cache, lengths, owner=f"{type(self).__name__}.prefill"
        )

    def decode_step(
        self, ids: Int[ArrayLike, "*batch"], cache: DecoderCache
    ) -> tuple[Float[Array, "*batch vocab"], DecoderCache]:
        """One new token per sequence: `ids` of shape `cache.batch_shape`, at
        each sequence's own position `cache.length`; returns its
        `(*batch, vocab)` float32 logits (those of `self` at that position)
        and the cache one longer. Its cost depends on `cache.max_len`, not on
        the position."""
        return decode_step(self, ids, cache, owner=f"{type(self).__name__}.decode_step")
