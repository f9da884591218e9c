"""Multi-head self-attention: grouped-query heads, RoPE, local windows, QK-norm."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_int, check_key
from . import attention_impls as impls
from . import init
from .attention_impls import ATTENTION_IMPLS, check_impl
from .config import QK_NORMS, BlockConfig, as_config, replace_static
from .functional import (
    _check_int_array,
    _softmax_clamped,
    dense,
    dense_weight_first,
    dropout,
    rope,
    rope_theta_bits,
)
from .hooks import Hooks, at
from .kv_cache import AttentionCache, check_start, write_cache
from .mask import Mask, as_mask
from .normalization import RMSNorm, check_float_input

__all__ = [
    "MultiHeadAttention",
    "AttentionTrace",
    "QK_NORMS",
    "ATTENTION_IMPLS",
    "with_attention_impl",
    "holds_attention",
]


class AttentionTrace(NamedTuple):
    """Everything one attention call computes, for diagnostics.

    Attributes:
        output: `(T, d)`, what the layer returns.
        weights: `(heads, Tq, Tk)` softmax weights (float32, before dropout).
        logits: `(heads, Tq, Tk)` scaled logits $s\\, q^\\top k$ (float32,
            before masking; $s = 1/\\sqrt{p}$ unless `attn_scale` is given).

    For a batch `(..., T, d)` every field gains the same leading axes.
    """

    output: Array
    weights: Array
    logits: Array


class MultiHeadAttention(eqx.Module):
    r"""Multi-head scaled dot-product self-attention (Vaswani et al., 2017),
    with the options of current open-weights models.

    For one sequence $X \in \mathbb R^{T\times d}$, $H$ query heads of width
    $p$ and $K$ key/value heads ($K$ divides $H$; grouped-query attention,
    Ainslie et al., 2023; $K = 1$ is multi-query), query head $i$ reads
    key/value head $g(i) = \lfloor i / (H/K) \rfloor$:
    $$Q_i = X W_q^{(i)\top},\; K_j = X W_k^{(j)\top},\; V_j = X W_v^{(j)\top},\quad
    A_i = \mathrm{softmax}_{\text{mask}}\big(s\, Q_i K_{g(i)}^\top\big),\quad
    \mathrm{out} = [A_1 V_{g(1)}, \ldots, A_H V_{g(H)}]\, W_o^\top,$$
    with $s = 1/\sqrt p$ unless `attn_scale` is given (Gemma: `query_pre_attn_scalar`
    $^{-1/2}$). The queries of a group are computed together against their
    shared keys (no copies of $K$, $V$).

    Options, in the order they act:

    - QK-norm (Henry et al., 2020): `qk_norm="head"` (or `True`; Gemma 3,
      Qwen3) RMS-normalizes each query and key row over its $p$ features with
      one gain per norm shared by all heads (`q_norm.weight` has $p$ entries);
      `"full"` (OLMo 2) normalizes the whole projection, $Hp$ (queries) and
      $Kp$ (keys) features, before the split into heads.
      With `norm="gemma_rms"` the QK-norms use Gemma's gain $1 + w$.
    - RoPE (`rope_theta`; Su et al., 2021): queries and keys are rotated at
      their positions (`functional.rope`, half-split convention) after the
      QK-norm, as Llama, OLMo 2 and Gemma 3 do.
    - Soft-capping (`attn_softcap` $c$, Gemma 2): the scaled logits become
      $c \tanh(s/c)$ before the mask.
    - Masks: one value, `blocklab.nn.mask.Mask`, built once by the model
      and passed to every layer (the second positional argument): causal,
      lengths $k < L_q$ (a plain integer array there is the chapter's
      `valid_lens`), key padding $m_k$, segments (packed sequences,
      $\mathrm{seg}_q = \mathrm{seg}_k$), chunks (Llama 4) and an offset
      (the cache), combined with `&`. The layer's own window $w \ge 1$
      joins it: $q - w < k \le q$ (local, causal sliding window attention
      as Gemma 3's local layers: the last $w$ positions, itself included;
      with `window_mode="bidirectional"` instead $|q - k| < w$, the $w - 1$
      positions on each side and itself, which is ModernBERT's local layers
      with $w$ = `local_attention // 2 + 1`). Without a mask there is no
      causal mask: every query sees every key (an encoder). Positions here
      are indices in the sequence. The reference path materializes the mask
      (`Mask.visible`), the kernels take it as a rule (`Mask.rule`, an
      `attention_impls.MaskRule`) evaluated per block.
    - Score bias: an additive `score_bias` $b$ `(H, Tq, Tk)` joins the
      logits after the scale and the soft-cap, $c\tanh(s\,q^\top k/c) + b$
      (T5's relative position bias; T5 also has `attn_scale=1`).
    - Cross-attention (`cross`): the queries come from `x`, the keys and
      values from a second sequence (an encoder's output) with its own
      mask (the encoder's padding); no RoPE and no window there.

    Implementations (`attention_impl`, `attention_impls`): `"reference"`
    (this docstring's maths with the full logits; `trace`, and so every
    diagnostic, always uses it), `"fused"` (`jax.nn.dot_product_attention`),
    `"chunked"` (online softmax over key blocks, linear memory, a
    flash-attention backward) and `"auto"` (the default; the rule is
    `attention_impls.resolve_impl`: reference for short sequences, chunked
    from 1024 keys, fused on a GPU in bfloat16/float16). They agree to
    float32 rounding; dropout exists only in the reference path (the others
    refuse it by name, `"auto"` then picks the reference), soft-capping is
    refused by `"fused"`, and `"fused"` computes its softmax in float32 even
    for float64 input (jax's kernel).

    `rope_theta` and `window` are *data*, not structure: when given they are
    stored as int32 0-d array leaves (the theta as the bit pattern of its
    float32 value, decoded with `jax.lax.bitcast_convert_type`), so that the
    layers of one `Stack` (a single `lax.scan` over stacked leaves) can carry
    different values, e.g. Gemma 3's local layers (window 512, theta 1e4) and
    global ones (`window` 0 = no window, theta 1e6), set per layer with
    `eqx.tree_at`. Being integer arrays, `eqx.is_inexact_array` filters
    (optimizers, `count_params`, `state_dict`) skip them. `None` (the
    default) means no RoPE / no window.

    Masked keys and values never contribute: their scores are replaced (not
    added to) before the float32 softmax, and non-finite input rows are
    zeroed before the projections, so a NaN or inf in a padding or future
    token cannot reach a row that does not see it, neither its output nor
    any gradient of the attention. A row that sees a non-finite position, or
    is one, is NaN. A query with no visible key attends uniformly (the
    `masked_softmax`). (Inside a block, the norms and the FFN still
    act on such a row: their weight gradients get 0 * NaN from it, so pad
    with finite values when training.)

    Logits and softmax are computed in float32; the output has the input's
    dtype. Dropout acts on the attention weights when a `key` is passed.
    """

    W_q: eqx.nn.Linear
    W_k: eqx.nn.Linear
    W_v: eqx.nn.Linear
    W_o: eqx.nn.Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    rope_theta: Int[Array, ""] | None
    window: Int[Array, ""] | None
    num_hiddens: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    qk_norm: str | None = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True, default=None)
    attention_impl: str = eqx.field(static=True, default="auto")
    window_mode: str = eqx.field(static=True, default="causal")

    def __init__(
        self,
        num_hiddens: int | BlockConfig,
        num_heads: int | None = None,
        *,
        key: PRNGKeyArray,
        **options: Any,
    ):
        """Build the attention of a `BlockConfig`, or of its options.

        `MultiHeadAttention(d, H, **options, key=key)` is
        `MultiHeadAttention(BlockConfig(d, H, **options), key=key)`: the
        options are `BlockConfig`'s fields, declared, checked and documented
        there once. The attention reads `num_kv_heads`, `head_dim`,
        `attn_scale`, `rope_theta`, `window`, `attn_bias`, `attn_out_bias`,
        `qk_norm` (with the config's `norm_eps`, and Gemma's gain $1 + w$ when
        `norm="gemma_rms"`), `dropout`, `attn_softcap` and `attention_impl`.

        Args:
            num_hiddens: model width $d$, or a `BlockConfig` (then alone).
            num_heads: query heads $H$.
            key: PRNG key for the weights.
            **options: the other fields of `BlockConfig`.
        """
        owner = "MultiHeadAttention"
        cfg = as_config(owner, num_hiddens, num_heads, options)
        d, H, KV, p = cfg.num_hiddens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        scale, rope_theta, window = cfg.attn_scale, cfg.rope_theta, cfg.window
        bias, qk_norm, qk_norm_eps = cfg.attn_bias, cfg.qk_norm, cfg.norm_eps
        out_bias = cfg.attn_out_bias
        unit, dropout = cfg.norm == "gemma_rms", cfg.dropout
        softcap, attention_impl = cfg.attn_softcap, cfg.attention_impl
        self.window_mode = cfg.window_mode
        key = check_key(owner, "key", key)
        self.num_hiddens, self.num_heads, self.num_kv_heads = d, H, KV
        self.head_dim, self.dropout = p, dropout
        self.softcap, self.attention_impl = softcap, attention_impl
        self.scale = 1.0 / math.sqrt(p) if scale is None else scale
        self.qk_norm = qk_norm or None
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.W_q = init.linear(d, H * p, bias=bias, key=kq)
        self.W_k = init.linear(d, KV * p, bias=bias, key=kk)
        self.W_v = init.linear(d, KV * p, bias=bias, key=kv)
        self.W_o = init.linear(H * p, d, bias=out_bias, key=ko)
        if self.qk_norm is None:
            self.q_norm = self.k_norm = None
        else:
            q_width, k_width = (p, p) if self.qk_norm == "head" else (H * p, KV * p)
            self.q_norm = RMSNorm(q_width, qk_norm_eps, unit_offset=unit)
            self.k_norm = RMSNorm(k_width, qk_norm_eps, unit_offset=unit)
        self.rope_theta = None if rope_theta is None else rope_theta_bits(rope_theta)
        self.window = None if window is None else jnp.asarray(window, jnp.int32)

    def _check_x(
        self, owner: str, x: Any, what: str = "a sequence x", T: str = "T"
    ) -> tuple[tuple[int, ...], int, int, int, int, int]:
        """Check that `x` is a float array `(..., T, num_hiddens)`; return its
        batch shape and length with the head sizes: `(lead, T, H, KV, p, G)`
        ($G = H / KV$ query heads per key-value head)."""
        if x.ndim < 2 or x.shape[-1] != self.num_hiddens:
            raise ConfigError(
                f"{owner} acts on {what} of shape ({T}, num_hiddens="
                f"{self.num_hiddens}) (or a batch (..., {T}, num_hiddens)), got "
                f"x.shape={tuple(x.shape)}."
            )
        check_float_input(x, owner)
        *lead, length, _ = x.shape
        H, KV, p = self.num_heads, self.num_kv_heads, self.head_dim
        return tuple(lead), length, H, KV, p, H // KV

    def _mask(self, mask, owner="MultiHeadAttention") -> Mask | None:
        """The call's mask (`as_mask`) with the layer's own window joined."""
        mask = as_mask(mask, owner)
        if self.window is None:
            return mask
        return Mask.sliding(self.window, self.window_mode) & mask

    def _bias_like(self, score_bias, logits_shape, grouped):
        """`score_bias` `(..., H, Tq, Tk)` in the layout of the reference
        logits (`(..., KV, G, Tq, Tk)` when grouped), float32 or wider."""
        if score_bias is None:
            return None
        b = score_bias
        if grouped:
            KV, G = self.num_kv_heads, self.num_heads // self.num_kv_heads
            b = b.reshape(*b.shape[:-3], KV, G, *b.shape[-2:])
        return b.astype(jnp.promote_types(b.dtype, jnp.float32))

    def _kernel_bias(self, score_bias, lead, Tq, Tk):
        """`score_bias` as the kernels take it: `(Bb, KV, G, Tq, Tk)`."""
        if score_bias is None:
            return None
        KV, G = self.num_kv_heads, self.num_heads // self.num_kv_heads
        b = score_bias
        if b.ndim > 3:
            b = jnp.broadcast_to(b, (*lead, *b.shape[-3:]))
        return b.reshape(-1, KV, G, Tq, Tk)

    def _capped(self, logits: Array) -> Array:
        """$c \\tanh(s / c)$ with the soft-cap $c$ (identity without one)."""
        if self.softcap is None:
            return logits
        return self.softcap * jnp.tanh(logits / self.softcap)

    def _impl(self, impl, num_keys, dtype, dropout_on, owner):
        """The implementation a call uses (`impl` overrides the layer's own)."""
        impl = self.attention_impl if impl is None else check_impl(owner, impl)
        if dropout_on and impl in ("fused", "chunked"):
            impls.refuse(owner, impl, "dropout", "only the reference path has it")
        if self.softcap is not None and impl == "fused":
            impls.refuse(
                owner, impl, "softcap",
                "jax.nn.dot_product_attention has no soft-capping",
            )  # fmt: skip
        return impls.resolve_impl(
            impl, num_keys=num_keys, dtype=dtype, softcap=self.softcap,
            dropout_on=dropout_on,
        )  # fmt: skip

    def _kernel(self, impl, q, k, v, rule, k_bad, bias=None):
        """Run the fused or chunked kernel on flattened `(B, ...)` arrays."""
        if impl == "fused":
            return impls.fused_attention(
                q, k, v, rule, scale=self.scale, k_bad=k_bad, bias=bias
            )
        return impls.chunked_attention(
            q, k, v, rule, scale=self.scale,
            divide=impls.sqrt_divisor(self.scale, self.head_dim),
            softcap=self.softcap, k_bad=k_bad, bias=bias,
        )  # fmt: skip

    def _project(self, x, positions, hooks=None):
        """Queries, keys and values of `x` (..., T, d), after QK-norm and RoPE.

        Sites (`hooks`): `hook_q`, `hook_k`, `hook_v` the projections per
        head `(..., T, heads, p)` before QK-norm and RoPE; `hook_rot_q`,
        `hook_rot_k` the queries and keys the scores use (after QK-norm and
        RoPE).

        Heads-major layouts (~10% faster on CPU): k and v (..., KV, T, p);
        q (..., KV, G, T, p), query head i = (i // G, i % G), or without
        groups (G = 1) q (..., H, T, p) like k: the plain multi-head
        products, ~10-15% faster on CPU than a group axis of size 1.
        """
        *lead, T, _ = x.shape
        H, KV, p = self.num_heads, self.num_kv_heads, self.head_dim
        G = H // KV
        q, k, v = dense(self.W_q, x), dense(self.W_k, x), dense(self.W_v, x)
        if hooks is not None:
            q, k, v = (
                hooks.sites(
                    name,
                    a,
                    lambda a, n=n: a.reshape(*lead, T, n, p),
                    lambda a: a.reshape(*lead, T, a.shape[-2] * p),
                )  # fmt: skip
                for name, a, n in (
                    ("hook_q", q, H),
                    ("hook_k", k, KV),
                    ("hook_v", v, KV),
                )
            )
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        grouped = G > 1
        if grouped:
            q = jnp.moveaxis(q.reshape(*lead, T, KV, G, p), -4, -2)
        else:
            q = jnp.swapaxes(q.reshape(*lead, T, H, p), -3, -2)
        k = jnp.swapaxes(k.reshape(*lead, T, KV, p), -3, -2)
        v = jnp.swapaxes(v.reshape(*lead, T, KV, p), -3, -2)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            theta = jax.lax.bitcast_convert_type(self.rope_theta, jnp.float32)
            pos = jnp.arange(T) if positions is None else positions
            pos = _positions(pos, (*lead, T))  # not broadcast: a small table
            q_pos = pos[..., None, None, :] if grouped else pos[..., None, :]
            q = rope(q, q_pos, theta=theta)
            k = rope(k, pos[..., None, :], theta=theta)
        if hooks is not None:
            q = hooks.sites("hook_rot_q", q, *_head_rows(q.shape, grouped))
            k = hooks.sites("hook_rot_k", k, *_head_rows(k.shape, False))
        return q, k, v

    def _scaled(self, raw: Array) -> Array:
        """The logits $s\\, q^\\top k$ from the raw products."""
        p = self.head_dim
        if self.scale == 1.0 / math.sqrt(p):
            return raw / math.sqrt(p)  # bit-identical to dividing by sqrt(p)
        return raw * self.scale

    def _heads_out(self, mixed, dtype, hooks=None):
        """`step`'s output from the mixed values `(*lead, KV, G, Tq, p)`:
        heads back to rows (site `hook_z`), then $W_O$ (weight first for one
        token)."""
        *lead, _, _, Tq, p = mixed.shape
        H = self.num_heads
        mixed = jnp.moveaxis(mixed.reshape(*lead, H, Tq, p), -2, -3)
        mixed = at(hooks, "hook_z", mixed)
        mixed = mixed.reshape(*lead, Tq, H * p).astype(dtype)
        project = dense_weight_first if Tq == 1 else dense
        return project(self.W_o, mixed).astype(dtype)

    def _attend_deferred(self, x, q, cache, rows, start, pos, hooks=None, bias=None):
        """`step`'s output without writing: the new tokens see the cache
        indices before `start` and each other (causal, windowed), one softmax
        over both. `q` `(*lead, KV, G, Tq, p)`; `rows` the new keys/values."""
        *lead, KV, G, Tq, p = q.shape
        L = cache.v.shape[-2]
        stat = jnp.promote_types(q.dtype, jnp.float32)
        j, i = jnp.arange(L), jnp.arange(Tq)
        qpos = pos[..., :, None]  # (*lead, Tq, 1)
        old = j < start[..., None, None]  # (*lead, 1, L): written before
        new = i[None, :] <= i[:, None]  # (Tq, Tq): causal among the new
        if self.window is not None:
            w = self.window
            old = old & ((j > qpos - w) | (w <= 0))
            new = new & ((i[None, :] > i[:, None] - w) | (w <= 0))
        visible = jnp.concatenate(
            [
                jnp.broadcast_to(old, (*lead, Tq, L)),
                jnp.broadcast_to(new, (*lead, Tq, Tq)),
            ],
            axis=-1,
        )
        spec = "...gqp,...kp->...gqk"
        raw = jnp.concatenate(
            [
                jnp.einsum(
                    "...gqp,...pk->...gqk", q, cache.k, preferred_element_type=stat
                ),
                jnp.einsum(spec, q, rows.k, preferred_element_type=stat),
            ],
            axis=-1,
        )
        logits = self._capped(self._scaled(raw))
        if bias is not None:
            # the new tokens' own keys sit at cache indices pos
            b = jnp.broadcast_to(bias, (*lead, *bias.shape[-3:]))
            idx = jnp.broadcast_to(pos[..., None, None, :], (*b.shape[:-1], Tq))
            both = jnp.concatenate([b, jnp.take_along_axis(b, idx, axis=-1)], -1)
            logits = logits + self._bias_like(both, logits.shape, True)
        weights = _softmax_clamped(logits, visible[..., None, None, :, :])
        spec = "...gqk,...kp->...gqp"
        mixed = jnp.einsum(
            spec, weights[..., :L].astype(cache.v.dtype), cache.v
        ) + jnp.einsum(spec, weights[..., L:].astype(rows.v.dtype), rows.v)
        return self._heads_out(mixed, x.dtype, hooks)

    def init_cache(
        self, batch_shape: tuple[int, ...] = (), max_len: int = 0, dtype=jnp.float32
    ) -> AttentionCache:
        """An empty (zero) key/value cache for `step`.

        Args:
            batch_shape: the leading axes of the `x` that `step` will see
                (`()` for one sequence, `(B,)` for a batch).
            max_len: the number of positions it holds (>= 1). Local (window)
                layers keep the full length too, so that every layer of a
                scanned `Stack` has one cache shape; their mask hides what
                lies outside the window.
            dtype: the dtype of the stored keys and values.

        Returns:
            An `AttentionCache` with `v` of shape `(*batch_shape, num_kv_heads,
            max_len, head_dim)` and `k` of shape `(*batch_shape, num_kv_heads,
            head_dim, max_len)` (see `AttentionCache`).
        """
        owner = "MultiHeadAttention.init_cache"
        if not isinstance(batch_shape, (tuple, list)):
            raise ConfigError(
                f"{owner}: batch_shape must be a tuple of ints (e.g. () or (B,)), "
                f"got {batch_shape!r}."
            )
        batch_shape = tuple(
            check_int(owner, "batch_shape", b, min=1) for b in batch_shape
        )
        max_len = check_int(owner, "max_len", max_len, min=1)
        lead = (*batch_shape, self.num_kv_heads)
        return AttentionCache(
            jnp.zeros((*lead, self.head_dim, max_len), dtype),
            jnp.zeros((*lead, max_len, self.head_dim), dtype),
        )

    def step(
        self,
        x: Float[Array, "*batch Tq d"],
        cache: AttentionCache,
        start: Int[ArrayLike, ""] | Int[ArrayLike, "*batch"],
        *,
        impl: str | None = None,
        defer_write: bool = False,
        hooks: Hooks | None = None,
        score_bias: ArrayLike | None = None,
    ) -> tuple[Float[Array, "*batch Tq d"], AttentionCache]:
        r"""Attend from new tokens to a key/value cache, and write theirs into it.

        `x` holds $T_q$ new tokens per sequence; the first sits at cache index
        $s$ = `start` (one int, or one per sequence: shape `x.shape[:-2]`,
        traced values allowed). Their keys and values (after QK-norm and RoPE
        at positions $s + i$, $i = 0..T_q-1$) are written into
        `cache[s : s + T_q]`, then new token $i$ attends to the cache indices
        $j$ with
        $$j \le s + i \quad	ext{and, with a window } w \ge 1,\quad j > s + i - w,$$
        exactly the causal (windowed) attention of `__call__` with
        `valid_lens = arange(1, T + 1)`. Prefill is `step(x, cache, 0)` with
        the whole prompt; decoding is `step(x_t[..., None, :], cache, t)`.

        Ragged right-padded prompts: prefill them all with `start=0`, then
        decode row $b$ from `start[b] = lengths[b]`. A row only sees indices up
        to its own position, and the padding written beyond its length is
        overwritten by its later tokens before it becomes visible.

        Needs $s + T_q \le$ `max_len` (checked when `start` is concrete; a
        traced `start` past the end is clamped by `dynamic_update_slice`).
        Local layers keep the full-length cache (one shape for all layers of a
        scanned stack); only the mask limits them to the window. There is no
        non-finite guard here (tokens come from an embedding), and no dropout.
        The soft-cap applies as in `__call__`.

        Args:
            x: `(*batch, Tq, num_hiddens)` new tokens.
            cache: from `init_cache(batch, max_len)` or a previous `step`.
            start: the cache index of the first new token, scalar or `(*batch,)`.
            impl: the attention implementation (`None`: the layer's own).
                A single new token (`Tq = 1`, decoding) always takes the
                reference maths (its logits are one row per head); a longer
                `Tq` (prefill) the chosen one, `"auto"` resolved on `max_len`.
            defer_write: leave `cache` unread past `start` and unwritten: the
                new tokens attend to the cache indices $j <$ `start` (with the
                window rule) and to each other, and the second value returned
                holds only their keys and values, `(*batch, KV, Tq, p)`, for
                `write_cache`. The same numbers; what a scanned `Stack` uses
                to decode, so that the stacked cache is read in the layer loop
                and written once after it (XLA copies a cache that is updated
                inside the layer loop: about 2x the step time at 2000 cached
                positions on a CPU). Reference maths.
            hooks: the sites of `__call__` but for the scores and the pattern
                (whose key axis is the cache's here): `hook_q`, `hook_k`,
                `hook_v`, `hook_rot_q`, `hook_rot_k`, `hook_z`, for the new
                tokens.
            score_bias: an additive bias `(H, Tq, max_len)` (or with the
                batch's axes) on the scores against the cache's indices
                (T5's relative positions of the positions `start + i`).

        Returns:
            `(out, new_cache)`: `out` of the shape and dtype of `x`, and the
            cache with the new keys and values written (with `defer_write`:
            the new keys and values alone).
        """
        owner = "MultiHeadAttention.step"
        lead, Tq, H, KV, p, G = self._check_x(owner, x, "x", "Tq")
        L = cache.v.shape[-2] if cache.v.ndim >= 2 else 0
        want = {"k": (*lead, KV, p, L), "v": (*lead, KV, L, p)}
        for name, shape in want.items():
            if getattr(cache, name).shape != shape:
                raise ConfigError(
                    f"{owner}: cache.{name} has shape "
                    f"{tuple(getattr(cache, name).shape)}, expected {shape} "
                    f"(batch {lead}, num_kv_heads={KV}, head_dim={p}, max_len={L}); "
                    f"build it with init_cache(batch_shape={lead}, max_len)."
                )
        start = check_start(owner, start, lead, Tq, L)
        pos = start[..., None] + jnp.arange(Tq)  # (*lead, Tq) absolute positions
        score_bias = check_score_bias(owner, score_bias, lead, H, Tq, L)
        if self.window is not None and self.window_mode != "causal":
            raise ConfigError(
                f"{owner}: cached decoding is causal, got a layer with "
                f"window_mode={self.window_mode!r}."
            )
        if hooks is not None and hooks.wants_any(_REFERENCE_SITES):
            raise ConfigError(
                f"{owner}: the sites {_REFERENCE_SITES} are not available while "
                "decoding (their key axis is the cache's); capture them on the "
                "whole sequence at once."
            )
        q, k, v = self._project(x, pos, hooks)
        if G == 1:  # one layout below: q (*lead, KV, G, Tq, p)
            q = q[..., None, :, :]
        rows = AttentionCache(k.astype(cache.k.dtype), v.astype(cache.v.dtype))
        if check_bool(owner, "defer_write", defer_write):
            out = self._attend_deferred(
                x, q, cache, rows, start, pos, hooks, score_bias
            )
            return out, rows
        new = write_cache(cache, rows, start)
        mask = self._mask(Mask.causal() & Mask.offset(start), owner)
        stat = jnp.promote_types(q.dtype, jnp.float32)
        impl = self._impl(impl, L, x.dtype, False, owner)
        if impl != "reference" and Tq > 1:
            B = int(np.prod(lead)) if lead else 1
            rule = mask.rule(lead, Tq, L, owner)
            mixed, _ = self._kernel(
                impl, q.reshape(B, KV, G, Tq, p),
                jnp.swapaxes(new.k, -1, -2).reshape(B, KV, L, p),
                new.v.reshape(B, KV, L, p), rule, None,
                self._kernel_bias(score_bias, lead, Tq, L),
            )  # fmt: skip
            mixed = jnp.transpose(mixed, (0, 3, 1, 2, 4)).reshape(*lead, Tq, H, p)
            mixed = at(hooks, "hook_z", mixed).reshape(*lead, Tq, H * p)
            out = dense(self.W_o, mixed.astype(x.dtype))
            return out.astype(x.dtype), new
        raw = jnp.einsum("...gqp,...pk->...gqk", q, new.k, preferred_element_type=stat)
        logits = self._capped(self._scaled(raw))
        if score_bias is not None:
            logits = logits + self._bias_like(score_bias, logits.shape, True)
        visible = mask.visible(lead, Tq, L, owner)[..., None, None, :, :]
        weights = _softmax_clamped(logits, visible)
        mixed = jnp.einsum("...gqk,...kp->...gqp", weights.astype(new.v.dtype), new.v)
        return self._heads_out(mixed, x.dtype, hooks), new

    def trace(
        self,
        x: Float[Array, "*batch T d"],
        mask: Mask | Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
        *,
        positions: Int[ArrayLike, "*#batch #T"] | None = None,
        score_bias: ArrayLike | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> AttentionTrace:
        """Attend, returning the output together with its weights and logits.

        Always the reference implementation (whatever `attention_impl` is),
        so that every diagnostic sees the same numbers; `__call__` with
        `"reference"` returns its `.output`, so under `jit` the unused
        diagnostics cost nothing. Arguments as for `__call__`; `logits` are
        after the soft-cap. `weights` are the pattern after any edit of
        `hook_pattern` (or `hook_attn_scores`).
        """
        lead, T, H, KV, p, G = self._check_x("MultiHeadAttention", x)
        mask = self._mask(mask)
        visible = (
            None if mask is None else mask.visible(lead, T, T, "MultiHeadAttention")
        )
        score_bias = check_score_bias(
            "MultiHeadAttention", score_bias, tuple(lead), H, T, T
        )

        # Non-finite input rows are zeroed before the projections, so that the
        # zero weights of masked keys multiply finite values (0 * NaN would
        # leak into every row, and into the gradients). Rows that see such a
        # position, or sit at one, are set to NaN at the end instead.
        row_ok = jnp.all(jnp.isfinite(x), axis=-1)  # (..., T)
        x = jnp.where(row_ok[..., None], x, jnp.zeros((), x.dtype))
        grouped = G > 1
        q, k, v = self._project(x, positions, hooks)

        # float32 logits for low-precision input; float64 input stays float64.
        stat = jnp.promote_types(q.dtype, jnp.float32)
        spec_s, spec_o = (
            ("...gqp,...kp->...gqk", "...gqk,...kp->...gqp")
            if grouped
            else ("...hqp,...hkp->...hqk", "...hqk,...hkp->...hqp")
        )
        raw = jnp.einsum(spec_s, q, k, preferred_element_type=stat)
        logits = self._capped(self._scaled(raw))
        if score_bias is not None:
            logits = logits + self._bias_like(score_bias, logits.shape, grouped)
        head_axes = (-3, -4) if grouped else (-3,)
        mask = None if visible is None else jnp.expand_dims(visible, head_axes)
        scores = logits
        if hooks is not None and hooks.wants("hook_attn_scores"):
            heads = (*lead, H, T, T)
            masked = logits if mask is None else jnp.where(mask, logits, -jnp.inf)
            site = masked.reshape(heads)
            edited = hooks("hook_attn_scores", site)
            if edited is not site:
                scores = edited.reshape(logits.shape)
        weights = _softmax_clamped(scores, mask)
        if hooks is not None:
            weights = hooks.sites(
                "hook_pattern", weights, lambda w: w.reshape(*lead, H, T, T),
                lambda w: w.reshape(weights.shape),
            )  # fmt: skip
        mixed = jnp.einsum(
            spec_o,
            dropout(weights, self.dropout, key).astype(v.dtype),
            v,
        )
        mixed = jnp.moveaxis(mixed, -2, -4) if grouped else jnp.swapaxes(mixed, -3, -2)
        mixed = at(hooks, "hook_z", mixed.reshape(*lead, T, H, p))
        mixed = mixed.reshape(*lead, T, H * p)
        out = dense(self.W_o, mixed)
        bad = ~row_ok
        if visible is None:
            sees_bad = jnp.any(bad, axis=-1, keepdims=True)
        else:
            sees_bad = jnp.any(visible & bad[..., None, :], axis=-1)
        out = jnp.where((sees_bad | bad)[..., None], jnp.nan, out)
        heads = (*lead, H, T, T)
        return AttentionTrace(
            out.astype(x.dtype), weights.reshape(heads), logits.reshape(heads)
        )

    def __call__(
        self,
        x: Float[Array, "*batch T d"],
        mask: Mask | Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
        *,
        positions: Int[ArrayLike, "*#batch #T"] | None = None,
        score_bias: ArrayLike | None = None,
        key: PRNGKeyArray | None = None,
        impl: str | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch T d"]:
        """Self-attention over one sequence, or over each of a batch.

        Args:
            x: `(T, num_hiddens)`, or a batch `(..., T, num_hiddens)`; a
                floating dtype (integer input is refused).
            mask: a `blocklab.nn.mask.Mask` (causal, lengths, key
                padding, segments, window, chunks, combined with `&`; the
                layer's own `window` joins it), `None` (every key visible),
                or the chapter's `valid_lens`: integer lengths broadcastable
                to `x.shape[:-1]` = `(..., T)`, key $k$ visible from query
                $q$ iff $k < L_q$ (`Mask.lengths`). A scalar (the same for
                every query); `(T,)` one per query (`jnp.arange(1, T + 1)`
                is causal); `(B, 1)` one per sequence of a batch; `(1, T)`
                or `(B, T)` per query. Float, bool and negative lengths are
                refused, and so is a 1-D array on a batch with `B == T`
                (per query or per sequence? write `(1, T)` or `(B, 1)`;
                `functional._lengths`).
            positions: integer positions for RoPE, broadcastable to
                `(..., T)`; default `arange(T)` (ignored without RoPE).
            score_bias: an additive bias on the scores, `(H, T, T)` or
                `(..., H, T, T)` broadcasting to the batch (T5's relative
                positions), added after the scale and the soft-cap.
            key: enables attention dropout; `None` is deterministic.
            impl: overrides the layer's `attention_impl` for this call.
            hooks: records and edits the sites (`blocklab.nn.hooks`; names
                in the layer's scope, TransformerLens's): `hook_q`, `hook_k`,
                `hook_v` `(..., T, heads, p)` (the projections, before
                QK-norm and RoPE; `heads` is `num_kv_heads` for k and v);
                `hook_rot_q`, `hook_rot_k` (what the scores use: after
                QK-norm and RoPE); `hook_attn_scores` `(..., H, T, T)` (the
                scaled, soft-capped logits with $-\\infty$ where masked);
                `hook_pattern` `(..., H, T, T)` (the softmax weights);
                `hook_z` `(..., T, H, p)` (the mixed values, before $W_O$).
                The scores and the pattern exist only in the reference
                maths: a call that wants them runs it.

        Returns:
            The shape and dtype of `x`.
        """
        owner = "MultiHeadAttention"
        lead, T, H, KV, p, G = self._check_x(owner, x)
        dropout_on = key is not None and self.dropout > 0
        impl = self._impl(impl, x.shape[-2], x.dtype, dropout_on, owner)
        if impl == "reference" or (
            hooks is not None and hooks.wants_any(_REFERENCE_SITES)
        ):
            return self.trace(
                x, mask, positions=positions, score_bias=score_bias, key=key,
                hooks=hooks,
            ).output  # fmt: skip
        bias = self._kernel_bias(
            check_score_bias(owner, score_bias, lead, H, T, T), lead, T, T
        )
        mask = self._mask(mask, owner)
        rule = (Mask() if mask is None else mask).rule(lead, T, T, owner)
        # the reference path's non-finite guard (see the class docstring)
        row_ok = jnp.all(jnp.isfinite(x), axis=-1)
        x = jnp.where(row_ok[..., None], x, jnp.zeros((), x.dtype))
        q, k, v = self._project(x, positions, hooks)
        B = rule.q_index.shape[0]
        q = q.reshape(B, KV, G, T, p)
        k, v = k.reshape(B, KV, T, p), v.reshape(B, KV, T, p)
        k_bad = ~impls.as_rows(row_ok, lead, T)
        mixed, sees_bad = self._kernel(impl, q, k, v, rule, k_bad, bias)
        mixed = jnp.transpose(mixed, (0, 3, 1, 2, 4)).reshape(*lead, T, H, p)
        mixed = at(hooks, "hook_z", mixed).reshape(*lead, T, H * p)
        out = dense(self.W_o, mixed.astype(v.dtype))
        bad = sees_bad.reshape(*lead, T) | ~row_ok
        return jnp.where(bad[..., None], jnp.nan, out).astype(x.dtype)

    def cross_kv(
        self,
        context: Float[Array, "*cbatch Tk dc"],
        *,
        hooks: Hooks | None = None,
    ) -> AttentionCache:
        """The keys and values of `context` for `cross`, in the cache layout.

        Computed once per encoder output and reused by every decoding step
        (the cross-attention cache). No RoPE (cross-attention has none); the
        key norm of `qk_norm` applies. Sites: `hook_k`, `hook_v`
        `(..., Tk, heads, p)`.

        Returns:
            An `AttentionCache`: `k` `(..., KV, p, Tk)`, `v` `(..., KV, Tk, p)`.
        """
        owner = "MultiHeadAttention.cross"
        context = self._check_context(owner, context)
        *lead, Tk, _ = context.shape
        KV, p = self.num_kv_heads, self.head_dim
        k, v = dense(self.W_k, context), dense(self.W_v, context)
        if hooks is not None:
            k, v = (
                hooks.sites(
                    name,
                    a,
                    lambda a: a.reshape(*lead, Tk, KV, p),
                    lambda a: a.reshape(*lead, Tk, KV * p),
                )  # fmt: skip
                for name, a in (("hook_k", k), ("hook_v", v))
            )
        if self.qk_norm == "full":
            k = self.k_norm(k)
        k = jnp.swapaxes(k.reshape(*lead, Tk, KV, p), -3, -2)
        v = jnp.swapaxes(v.reshape(*lead, Tk, KV, p), -3, -2)
        if self.qk_norm == "head":
            k = self.k_norm(k)
        return AttentionCache(jnp.swapaxes(k, -1, -2), v)

    def _check_context(self, owner, context):
        if context is None:
            raise ConfigError(
                f"{owner}: cross-attention needs the encoder states, got "
                "context=None; pass context (..., Tk, num_hiddens) or its kv."
            )
        check_float_input(context, owner)
        if context.ndim < 2 or context.shape[-1] != self.num_hiddens:
            raise ConfigError(
                f"{owner}: context (the encoder states) must have shape (Tk, "
                f"num_hiddens={self.num_hiddens}) (or a batch (..., Tk, "
                f"num_hiddens)), got context.shape={tuple(context.shape)}."
            )
        return context

    def cross(
        self,
        x: Float[Array, "*batch Tq d"],
        context: Float[Array, "*cbatch Tk dc"] | None = None,
        mask: Mask | None = None,
        *,
        score_bias: ArrayLike | None = None,
        kv: AttentionCache | None = None,
        key: PRNGKeyArray | None = None,
        impl: str | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch Tq d"]:
        r"""Cross-attention: queries from `x`, keys and values from `context`.

        $$\mathrm{out} = [A_1 V_{g(1)}, \ldots]\, W_o^\top,\quad
        A_i = \mathrm{softmax}_{\text{mask}}\big(s\, Q_i K_{g(i)}^\top +
        b_i\big),\quad Q = x W_q^\top,\; K = c\, W_k^\top,\; V = c\,
        W_v^\top$$
        for the encoder states $c$ `(Tk, d)`. Key $j$ is visible from query
        $i$ as `mask` says (an encoder's padding: `Mask.padding(m)` with
        `m` `(..., Tk)`); no causal mask, no window, no RoPE. A query with
        no visible key attends uniformly. Every `attention_impl` computes
        it (the reference maths when a site of the scores or the pattern is
        wanted).

        Args:
            x: `(Tq, num_hiddens)` queries' stream, or a batch `(..., Tq, d)`.
            context: `(Tk, num_hiddens)` encoder states (`(..., Tk, d)` with
                the batch of `x`); not needed with `kv`.
            mask: a `Mask` over the encoder's keys (`Mask.padding`), or
                `None` (every key visible).
            score_bias: additive `(H, Tq, Tk)` (or with the batch's axes).
            kv: `cross_kv(context)` computed before (decoding reuses it).
            key: attention dropout (reference path only).
            impl: overrides the layer's `attention_impl`.
            hooks: sites `hook_q` `(..., Tq, H, p)`, `hook_k`, `hook_v`
                `(..., Tk, KV, p)` (when `kv` is computed here),
                `hook_attn_scores`, `hook_pattern` `(..., H, Tq, Tk)`,
                `hook_z` `(..., Tq, H, p)`.

        Returns:
            The shape and dtype of `x`.
        """
        owner = "MultiHeadAttention.cross"
        lead, Tq, H, KV, p, G = self._check_x(owner, x, "x", "Tq")
        if kv is None:
            context = self._check_context(owner, context)
            if tuple(context.shape[:-2]) != lead:
                raise ConfigError(
                    f"{owner}: context must have the batch shape of x, {lead}, "
                    f"got context.shape={tuple(context.shape)}."
                )
            kv = self.cross_kv(context, hooks=hooks)
        if not isinstance(kv, AttentionCache) or kv.v.shape[:-2] != (*lead, KV):
            raise ConfigError(
                f"{owner}: kv must be the AttentionCache of cross_kv(context) with "
                f"batch {lead} and num_kv_heads={KV}, got "
                f"{type(kv).__name__} {getattr(getattr(kv, 'v', None), 'shape', '')}."
            )
        Tk = kv.v.shape[-2]
        mask = as_mask(mask, owner)
        visible = None if mask is None else mask.visible(lead, Tq, Tk, owner)
        score_bias = check_score_bias(owner, score_bias, lead, H, Tq, Tk)
        dropout_on = key is not None and self.dropout > 0
        impl = self._impl(impl, Tk, x.dtype, dropout_on, owner)
        q = dense(self.W_q, x)
        if hooks is not None:
            q = hooks.sites(
                "hook_q", q, lambda a: a.reshape(*lead, Tq, H, p),
                lambda a: a.reshape(*lead, Tq, H * p),
            )  # fmt: skip
        if self.qk_norm == "full":
            q = self.q_norm(q)
        q = jnp.moveaxis(q.reshape(*lead, Tq, KV, G, p), -4, -2)  # (*, KV, G, Tq, p)
        if self.qk_norm == "head":
            q = self.q_norm(q)
        reference = impl == "reference" or (
            hooks is not None and hooks.wants_any(_REFERENCE_SITES)
        )
        if not reference:
            B = int(np.prod(lead)) if lead else 1
            rule = (Mask() if mask is None else mask).rule(lead, Tq, Tk, owner)
            mixed, _ = self._kernel(
                impl, q.reshape(B, KV, G, Tq, p),
                jnp.swapaxes(kv.k, -1, -2).reshape(B, KV, Tk, p),
                kv.v.reshape(B, KV, Tk, p), rule, None,
                self._kernel_bias(score_bias, lead, Tq, Tk),
            )  # fmt: skip
            mixed = jnp.transpose(mixed, (0, 3, 1, 2, 4)).reshape(*lead, Tq, H, p)
            mixed = at(hooks, "hook_z", mixed).reshape(*lead, Tq, H * p)
            return dense(self.W_o, mixed.astype(x.dtype)).astype(x.dtype)
        stat = jnp.promote_types(q.dtype, jnp.float32)
        raw = jnp.einsum("...gqp,...pk->...gqk", q, kv.k, preferred_element_type=stat)
        logits = self._capped(self._scaled(raw))
        if score_bias is not None:
            logits = logits + self._bias_like(score_bias, logits.shape, True)
        mask = None if visible is None else visible[..., None, None, :, :]
        scores = logits
        heads = (*lead, H, Tq, Tk)
        if hooks is not None and hooks.wants("hook_attn_scores"):
            masked = logits if mask is None else jnp.where(mask, logits, -jnp.inf)
            site = masked.reshape(heads)
            edited = hooks("hook_attn_scores", site)
            if edited is not site:
                scores = edited.reshape(logits.shape)
        weights = _softmax_clamped(scores, mask)
        if hooks is not None:
            weights = hooks.sites(
                "hook_pattern", weights, lambda w: w.reshape(heads),
                lambda w: w.reshape(weights.shape),
            )  # fmt: skip
        weights = dropout(weights, self.dropout, key)
        mixed = jnp.einsum("...gqk,...kp->...gqp", weights.astype(kv.v.dtype), kv.v)
        return self._heads_out(mixed, x.dtype, hooks)


def holds_attention(tree: Any) -> bool:
    """Whether the pytree `tree` holds a `MultiHeadAttention` anywhere."""
    found = jax.tree_util.tree_leaves(
        tree, is_leaf=lambda n: isinstance(n, MultiHeadAttention)
    )
    return any(isinstance(n, MultiHeadAttention) for n in found)


def with_attention_impl(model: Any, impl: str) -> Any:
    """`model` with every `MultiHeadAttention` switched to `impl`.

    The same weights (the arrays are shared, not copied), the same structure;
    only the static `attention_impl` of each attention layer changes, and the
    `attention_impl` of the configs that carry one (`BlockConfig` of each
    block, `DecoderConfig` of a `DecoderLM`), so that a saved config rebuilds
    the switched model. Works on any pytree of Equinox modules (a layer, a
    block, a `Stack`, a `DecoderLM`, a `CharLM`, a list of them).

    Args:
        model: the model.
        impl: one of `ATTENTION_IMPLS` (`ConfigError` lists them otherwise).
    """
    impl = check_impl("with_attention_impl", impl)
    if not holds_attention(model):
        raise ConfigError(
            "with_attention_impl: model holds no MultiHeadAttention to switch, got "
            f"a {type(model).__name__}; pass a layer, a block, a stack or a model."
        )

    out, _ = replace_static(
        model, "attention_impl", impl, lambda n: isinstance(n, MultiHeadAttention)
    )
    return out


#: The sites only the reference maths has (`trace`).
_REFERENCE_SITES = ("hook_attn_scores", "hook_pattern")


def _head_rows(shape, grouped):
    """`(to_site, from_site)` between a heads-major layout, `(..., KV, G,
    T, p)` (grouped) or `(..., heads, T, p)`, and a site's `(..., T, heads, p)`."""
    if grouped:
        *lead, KV, G, T, p = shape
        return (
            lambda a: jnp.swapaxes(a.reshape(*lead, KV * G, T, p), -3, -2),
            lambda a: jnp.swapaxes(a, -3, -2).reshape(*lead, KV, G, T, p),
        )
    return (lambda a: jnp.swapaxes(a, -3, -2), lambda a: jnp.swapaxes(a, -3, -2))


def _positions(positions, shape) -> Array:
    pos = _check_int_array("MultiHeadAttention", "positions", positions)
    try:
        ok = np.broadcast_shapes(pos.shape, shape) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"MultiHeadAttention: positions must broadcast to x.shape[:-1] = "
            f"{tuple(shape)} (e.g. shape (T,) = ({shape[-1]},)), got shape "
            f"{tuple(pos.shape)}."
        )
    return pos


def check_score_bias(owner: str, bias, lead, H: int, Tq: int, Tk: int):
    """`score_bias` checked: floating, shape `(H, Tq, Tk)` or `(..., H, Tq,
    Tk)` whose leading axes broadcast to the batch `lead`; `None` passes."""
    if bias is None:
        return None
    arr = bias if hasattr(bias, "dtype") else np.asarray(bias)
    want = (H, Tq, Tk)
    try:
        ok = (
            jnp.issubdtype(arr.dtype, jnp.floating)
            and arr.ndim >= 3
            and tuple(arr.shape[-3:]) == want
            and np.broadcast_shapes(tuple(arr.shape[:-3]), tuple(lead)) == tuple(lead)
        )
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"{owner}: score_bias must be a float array of shape (heads, Tq, Tk) "
            f"= {want} (or with the batch's leading axes {tuple(lead)}), got "
            f"shape {tuple(arr.shape)} and dtype {arr.dtype}."
        )
    return jnp.asarray(arr)
