r"""One attention mask value: which keys each query sees.

A `Mask` is a small frozen pytree built once, at a model's top, and handed
unchanged to every layer. Query $i$ of a call sits at key index
$n_i = o + i$ (the offset $o$ is 0 for a whole sequence, the cache index of
the first new token when decoding), and key $j$ is visible from it iff every
factor that is set holds:
$$\underbrace{j \le n_i}_{\text{causal}} \wedge
\underbrace{j < L_i}_{\text{lengths}} \wedge
\underbrace{m_j}_{\text{key padding}} \wedge
\underbrace{\mathrm{seg}_i = \mathrm{seg}_j}_{\text{segments}} \wedge
\underbrace{w \le 0 \vee n_i - w < j \le n_i + r}_{\text{window}} \wedge
\underbrace{\lfloor n_i / C \rfloor = \lfloor j / C \rfloor}_{\text{chunks}}$$
with $r = 0$ for the causal sliding window (Gemma 3's local layers: the
last $w$ positions, itself included) and $r = w - 1$ for the bidirectional
one ($|n_i - j| < w$, ModernBERT's local layers), and $C$ the chunk of
chunked attention (Llama 4's local layers: a query sees the keys of its own
chunk of $C$ positions; with `causal`, only the earlier ones there).

Masks combine with `&` (the conjunction of the factors: lengths take the
minimum, key paddings the logical and). The value is materialized on demand:
`visible(...)` gives the boolean `(..., Tq, Tk)` matrix of the reference
path, `rule(...)` the per-query data (`attention_impls.MaskRule`) the fused
and chunked kernels evaluate block by block.

Where a layer takes a mask, a plain integer array (or int) in its place is
the chapter's `valid_lens` (`Mask.lengths(valid_lens)`), and `None` is no
mask (every key visible: an encoder).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int

from .._validate import ConfigError, check_choice, check_int
from .attention_impls import MaskRule, as_rows
from .functional import _check_int_array, _lengths

__all__ = ["Mask", "as_mask", "check_key_mask", "check_segment_ids", "WINDOW_MODES"]

#: `Mask.sliding(w, mode=...)`: the causal window or the bidirectional one.
WINDOW_MODES = ("causal", "bidirectional")


class Mask(eqx.Module):
    r"""Which keys each query sees (see the module docstring for the rule).

    Build it with the constructors and `&`: `Mask.causal()`,
    `Mask.lengths(L)`, `Mask.padding(m)`, `Mask.segments(ids)`,
    `Mask.sliding(w)`, `Mask.chunked(C)`, `Mask.offset(o)`; e.g. a packed
    language model's mask is `Mask.causal() & Mask.segments(ids)`. Flags are
    static (`is_causal`, `chunk`, `window_mode`), the rest are arrays, so
    one mask type serves every layer of a scanned stack.

    Attributes:
        is_causal: key $j$ visible only if $j \le n_i$.
        chunk: the chunk length $C \ge 1$ of chunked attention, or `None`.
        window_mode: `"causal"` ($r = 0$) or `"bidirectional"` ($r = w - 1$).
        window: int32 0-d window $w$ (0 = no window), or `None`.
        lens: lengths broadcasting to the queries `(..., Tq)` (the chapter's
            `valid_lens`: a scalar, `(Tq,)` per query, `(B, 1)` per sequence).
        key_valid: booleans broadcasting to the keys `(..., Tk)`.
        seg: integer segment ids `(..., T)` of a self-attention call (runs of
            equal ids are the segments, `check_segment_ids`).
        q_offset: int, or one per sequence `(...)`: the key index $o$ of
            the first query.
    """

    is_causal: bool = eqx.field(static=True, default=False)
    chunk: int | None = eqx.field(static=True, default=None)
    window_mode: str = eqx.field(static=True, default="causal")
    window: Int[Array, ""] | None = None
    lens: ArrayLike | None = None
    key_valid: ArrayLike | None = None
    seg: ArrayLike | None = None
    q_offset: ArrayLike | None = None

    # constructors ----------------------------------------------------------

    @classmethod
    def causal(cls) -> Mask:
        """Key $j$ visible from query $i$ iff $j \\le n_i$."""
        return cls(is_causal=True)

    @classmethod
    def lengths(cls, lens: ArrayLike) -> Mask:
        """Key $j$ visible from query $i$ iff $j < L_i$: the chapter's
        `valid_lens` (scalar, `(Tq,)` per query, `(B, 1)` per sequence, ...;
        checked when the mask is used, `functional._lengths`)."""
        return cls(lens=lens)

    @classmethod
    def padding(cls, valid: ArrayLike) -> Mask:
        """Key $j$ visible only where `valid[..., j]` (booleans `(Tk,)` or
        broadcasting to the keys `(..., Tk)`: an encoder's padding)."""
        return cls(key_valid=valid)

    @classmethod
    def segments(cls, ids: ArrayLike) -> Mask:
        """Packed sequences: query $i$ sees key $j$ only in its own segment
        (integers `(T,)` or `(..., T)`; a segment is a run of equal ids)."""
        return cls(seg=ids)

    @classmethod
    def sliding(cls, window: ArrayLike, mode: str = "causal") -> Mask:
        """A local window $w$: $n_i - w < j \\le n_i$ (`mode="causal"`) or
        $|n_i - j| < w$ (`"bidirectional"`); $w \\le 0$ is no window. An
        int or an int 0-d array (data: a scanned stack's layers differ)."""
        mode = check_choice("Mask.sliding", "mode", mode, WINDOW_MODES)
        if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
            window = jnp.asarray(window, jnp.int32)
        w = _check_int_array("Mask.sliding", "window", window)
        if jnp.ndim(w) != 0:
            raise ConfigError(
                f"Mask.sliding: window must be an int or a 0-d int array, got "
                f"shape {tuple(jnp.shape(w))}."
            )
        return cls(window=jnp.asarray(w, jnp.int32), window_mode=mode)

    @classmethod
    def chunked(cls, chunk: int) -> Mask:
        """Chunked attention (Llama 4): query $i$ sees key $j$ only if
        $\\lfloor n_i / C \\rfloor = \\lfloor j / C \\rfloor$ (combine with
        `Mask.causal()` for a decoder's local layers)."""
        return cls(chunk=check_int("Mask.chunked", "chunk", chunk, min=1))

    @classmethod
    def offset(cls, start: ArrayLike) -> Mask:
        """The first query sits at key index `start` (an int, or one per
        sequence): what a cached decoding step attends with."""
        return cls(q_offset=start)

    # combination ------------------------------------------------------------

    def __and__(self, other: Mask | None) -> Mask:
        """The conjunction of two masks (every factor of both must hold)."""
        if other is None:
            return self
        if not isinstance(other, Mask):
            return NotImplemented
        owner = "Mask.__and__"

        def one(name, a, b):
            if a is None or b is None:
                return a if b is None else b
            raise ConfigError(
                f"{owner}: both masks set {name}; combine at most one {name} "
                "(build the intersection yourself and pass it once)."
            )

        if self.chunk is not None and other.chunk is not None:
            if self.chunk != other.chunk:
                raise ConfigError(
                    f"{owner}: chunks {self.chunk} and {other.chunk} differ; "
                    "a mask has one chunk length."
                )
        if self.window is not None and other.window is not None:
            one("window", self.window, other.window)
        if self.lens is None or other.lens is None:
            lens = self.lens if other.lens is None else other.lens
        else:
            lens = jnp.minimum(jnp.asarray(self.lens), jnp.asarray(other.lens))
        if self.key_valid is None or other.key_valid is None:
            kv = self.key_valid if other.key_valid is None else other.key_valid
        else:
            kv = jnp.asarray(self.key_valid) & jnp.asarray(other.key_valid)
        return Mask(
            is_causal=self.is_causal or other.is_causal,
            chunk=self.chunk if other.chunk is None else other.chunk,
            window_mode=self.window_mode if other.window is None else other.window_mode,
            window=self.window if other.window is None else other.window,
            lens=lens,
            key_valid=kv,
            seg=one("segments", self.seg, other.seg),
            q_offset=one("an offset", self.q_offset, other.q_offset),
        )

    __rand__ = __and__

    @property
    def empty(self) -> bool:
        """Whether no factor is set (every key visible)."""
        return (
            not self.is_causal
            and self.chunk is None
            and all(
                a is None
                for a in (
                    self.window,
                    self.lens,
                    self.key_valid,
                    self.seg,
                    self.q_offset,
                )
            )
        )

    # materialization --------------------------------------------------------

    def _parts(self, owner, lead, Tq, Tk):
        """The checked data: `(n, lens, q_seg, k_seg, key_valid)`, `n` the
        queries' key indices (broadcasting to `(*lead, Tq)`), `lens`,
        `q_seg` `(*lead, Tq)`, `k_seg`, `key_valid` `(*lead, Tk)` (`None`:
        unset)."""
        lead = tuple(lead)
        n = jnp.arange(Tq)
        if self.q_offset is not None:
            o = _check_int_array(owner, "offset", self.q_offset)
            try:
                ok = np.broadcast_shapes(jnp.shape(o), lead) == lead
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(
                    f"{owner}: the mask's offset must be an int or one per "
                    f"sequence, shape {lead}, got shape {tuple(jnp.shape(o))}."
                )
            n = jnp.asarray(o)[..., None] + n
        lens = None
        if self.lens is not None:
            lens = _lengths(self.lens, (*lead, Tq), owner)
        if self.is_causal:
            lens = n + 1 if lens is None else jnp.minimum(lens, n + 1)
        q_seg = k_seg = None
        if self.seg is not None:
            if Tq != Tk or self.q_offset is not None:
                raise ConfigError(
                    f"{owner}: segment ids mask a self-attention over a whole "
                    f"sequence (Tq = Tk, no offset), got Tq={Tq}, Tk={Tk}."
                )
            q_seg = k_seg = check_segment_ids(owner, self.seg, (*lead, Tk))
        kv = None
        if self.key_valid is not None:
            kv = check_key_mask(owner, "key_mask", self.key_valid, (*lead, Tk))
        return n, lens, q_seg, k_seg, kv

    def _window_right(self):
        if self.window is None or self.window_mode == "causal":
            return None
        return self.window - 1

    def visible(
        self, lead: tuple[int, ...], Tq: int, Tk: int, owner: str = "Mask"
    ) -> Bool[Array, "..."] | None:
        r"""The boolean visibility (True = key visible), broadcasting to
        `(*lead, Tq, Tk)` (axes that no factor varies along are kept at 1),
        or `None` when every key is visible (an empty mask)."""
        if self.empty:
            return None
        n, lens, q_seg, k_seg, kv = self._parts(owner, lead, Tq, Tk)
        n, j = n[..., :, None], jnp.arange(Tk)
        factors = []
        if lens is not None:
            factors.append(j < lens[..., :, None])
        if self.window is not None:
            w, r = self.window, self._window_right()
            right = n if r is None else n + r
            factors.append(((j <= right) & (j > n - w)) | (w <= 0))
        if q_seg is not None:
            factors.append(q_seg[..., :, None] == k_seg[..., None, :])
        if kv is not None:
            factors.append(kv[..., None, :])
        if self.chunk is not None:
            factors.append(n // self.chunk == j // self.chunk)
        vis = factors[0]
        for f in factors[1:]:
            vis = vis & f
        return jnp.broadcast_to(vis, jnp.broadcast_shapes(vis.shape, (Tq, Tk)))

    def _chunk_array(self):
        return None if self.chunk is None else jnp.asarray(self.chunk, jnp.int32)

    def rule(
        self, lead: tuple[int, ...], Tq: int, Tk: int, owner: str = "Mask"
    ) -> MaskRule:
        """The mask as the kernels take it: a `MaskRule` whose arrays have
        the flattened batch `B = prod(lead)` as their leading axis."""
        n, lens, q_seg, k_seg, kv = self._parts(owner, lead, Tq, Tk)

        def rows(a, m):
            return None if a is None else as_rows(a, tuple(lead), m)

        n = jnp.broadcast_to(n, (*lead, Tq))
        return MaskRule(
            rows(n, Tq), rows(lens, Tq), self.window, rows(q_seg, Tq),
            rows(k_seg, Tk), self._window_right(), rows(kv, Tk),
            self._chunk_array(),
        )  # fmt: skip


def as_mask(mask: Any, owner: str = "mask") -> Mask | None:
    """A layer's mask argument read: a `Mask` as it is, `None` as no mask,
    and an integer array or int as the chapter's `valid_lens`
    (`Mask.lengths`, whose check refuses float and bool lengths by name);
    anything else is refused by name."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if hasattr(mask, "dtype") or isinstance(mask, (int, np.integer, list, tuple)):
        return Mask.lengths(mask)
    raise ConfigError(
        f"{owner}: the mask argument must be a Mask, integer lengths "
        f"(valid_lens) or None, got {type(mask).__name__}."
    )


def _fits_last_axis(arr, shape) -> bool:
    """Whether `arr` is `(T,)` or broadcasts to `shape` = `(..., T)` with its
    last axis `T` (the shape rule of segment ids and key masks)."""
    try:
        return bool(
            arr.ndim >= 1
            and arr.shape[-1] == shape[-1]
            and np.broadcast_shapes(arr.shape, tuple(shape)) == tuple(shape)
        )
    except ValueError:
        return False


def check_segment_ids(owner: str, ids, shape) -> Array:
    """Segment ids checked (integers; shape `(T,)` or broadcasting to
    `shape` = `(..., T)` with last axis `T`), broadcast to `shape`, and
    renumbered by runs: a segment is a maximal run of equal ids, so an id
    used again after another (`[0, 0, 1, 1, 0, 0]`) starts a new segment,
    as its positions restart (`functional.segment_positions`); the runs are
    numbered 0, 1, 2, ... along the last axis."""
    if (
        isinstance(ids, (bool, np.bool_))
        or not hasattr(ids, "dtype")
        and not isinstance(ids, (list, tuple, int, np.integer))
    ):
        raise ConfigError(
            f"{owner}: segment_ids must be an integer array of shape (T,) or "
            f"x.shape[:-1] = {tuple(shape)}, got {type(ids).__name__}."
        )
    seg = ids if hasattr(ids, "dtype") else np.asarray(ids)
    if not jnp.issubdtype(seg.dtype, jnp.integer):
        raise ConfigError(
            f"{owner}: segment_ids must have an integer dtype, got dtype "
            f"{seg.dtype}; convert it with .astype(int)."
        )
    if not _fits_last_axis(seg, shape):
        raise ConfigError(
            f"{owner}: segment_ids must have shape (T,) = ({shape[-1]},) or "
            f"x.shape[:-1] = {tuple(shape)}, got shape {tuple(seg.shape)}."
        )
    seg = jnp.broadcast_to(jnp.asarray(seg), tuple(shape))
    change = seg[..., 1:] != seg[..., :-1]
    starts = jnp.concatenate([jnp.zeros_like(change[..., :1]), change], axis=-1)
    return jnp.cumsum(starts, axis=-1, dtype=jnp.int32)


def check_key_mask(owner: str, name: str, mask, shape) -> Array:
    """A boolean key mask checked (bool dtype; shape `(T,)` or broadcasting
    to `shape` = `(..., T)` with last axis `T`) and broadcast to `shape`."""
    arr = mask if hasattr(mask, "dtype") else np.asarray(mask)
    if arr.dtype != np.bool_:
        raise ConfigError(
            f"{owner}: {name} must be a boolean array (True = visible key) of "
            f"shape (T,) = ({shape[-1]},) or {tuple(shape)}, got dtype {arr.dtype}."
        )
    if not _fits_last_axis(arr, shape):
        raise ConfigError(
            f"{owner}: {name} must have shape (T,) = ({shape[-1]},) or a shape "
            f"broadcasting to {tuple(shape)}, got shape {tuple(arr.shape)}."
        )
    return jnp.broadcast_to(jnp.asarray(arr), tuple(shape))
