r"""The attention kernels behind `MultiHeadAttention(attention_impl=...)`.

All of them compute, for queries $q_i$ and keys/values $k_j, v_j$,
$$\mathrm{out}_i = \sum_j \mathrm{softmax}_j\big(\tilde s_{ij}\big)\, v_j,\qquad
\tilde s_{ij} = \begin{cases} c \tanh(s_{ij}/c) + b_{ij} & \text{visible}(i, j)\\
-10^6 & \text{otherwise}\end{cases},\qquad s_{ij} = \sigma\, q_i^\top k_j$$
($c$ the optional soft-cap, without it $c \tanh(s/c)$ reads $s$; $b$ the
optional additive score bias, e.g. T5's relative positions), with one rule of
visibility (`MaskRule`) instead of a `(Tq, Tk)` matrix:
$$\text{visible}(i, j) = [j < L_i] \wedge [w \le 0 \vee (n_i - w < j \le n_i + r)]
\wedge [\mathrm{seg}^q_i = \mathrm{seg}^k_j] \wedge m_j$$
where $L_i$ are the `valid_lens`, $n_i$ the query's index on the key axis,
$w$ the window, $r$ its reach to the right ($0$: the causal window;
$w - 1$: the bidirectional one, $|n_i - j| < w$), $m_j$ a boolean key
mask, and, with a chunk $C$ (chunked attention),
$\lfloor n_i / C \rfloor = \lfloor j / C \rfloor$; each factor is left out
when its data is `None`. A query with no visible key attends uniformly to
every key (the reference's `MASK_VALUE` semantics), i.e. returns the mean of
the values.

- `"reference"` is `MultiHeadAttention.trace` itself (full logits and weights).
- `"fused"`: `jax.nn.dot_product_attention` with the rule as a boolean mask
  (on a GPU with bfloat16/float16 input it asks for cuDNN and falls back to
  XLA when cuDNN refuses the shapes). No soft-cap (refused by name).
- `"chunked"` (`chunked_attention`): an online softmax over key blocks inside
  a loop over query blocks (Rabe & Staats, 2021; Dao et al., 2022), with a
  `jax.custom_vjp` whose backward pass recomputes each block's weights from
  the saved row log-sum-exps: forward plus backward memory is
  $O(T \cdot \text{block})$, not $O(T^2)$. Blocks in which no query sees any
  key (the future of a causal mask, outside a window or a segment) are
  skipped (`lax.cond`), so a causal mask costs about half the products.
- `"auto"`: see `resolve_impl`.

Dropout on the attention weights exists only in the reference path; the
others refuse it by name (and `"auto"` picks the reference path when it is on).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._validate import ConfigError, check_choice
from .config import ATTENTION_IMPLS
from .functional import MASK_VALUE

__all__ = [
    "ATTENTION_IMPLS",
    "MaskRule",
    "chunked_attention",
    "fused_attention",
    "resolve_impl",
    "check_impl",
    "BLOCK_SIZE",
    "AUTO_MIN_CHUNKED_LEN",
]

#: Query and key block length of `"chunked"` (read when a call is traced).
BLOCK_SIZE = 512
#: `"auto"` switches from `"reference"` to `"chunked"` at this key length (CPU).
AUTO_MIN_CHUNKED_LEN = 1024


def check_impl(owner: str, impl) -> str:
    """Return `impl` if it is one of `ATTENTION_IMPLS`, else `ConfigError`."""
    return check_choice(owner, "attention_impl", impl, ATTENTION_IMPLS)


def resolve_impl(impl: str, *, num_keys: int, dtype, softcap, dropout_on: bool) -> str:
    r"""The implementation `"auto"` stands for (others are returned as they are).

    The rule, for a call with `num_keys` keys:

    1. dropout on (a key and a rate > 0) $\to$ `"reference"` (the only one
       with dropout);
    2. on a GPU with bfloat16/float16 input and no soft-cap $\to$ `"fused"`
       (cuDNN's flash attention);
    3. `num_keys` $\ge$ `AUTO_MIN_CHUNKED_LEN` (1024) $\to$ `"chunked"`
       (linear memory; on a CPU about as fast as the full logits there);
    4. otherwise `"reference"` (short sequences: one product is fastest).
    """
    if impl != "auto":
        return impl
    if dropout_on:
        return "reference"
    platform = jax.devices()[0].platform
    if (
        platform == "gpu"
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        and softcap is None
    ):
        return "fused"
    if num_keys >= AUTO_MIN_CHUNKED_LEN:
        return "chunked"
    return "reference"


class MaskRule(NamedTuple):
    r"""Which keys each query sees, as data per query and key (no `(Tq, Tk)` matrix).

    Attributes (leading axes `B` the flattened batch; `None` leaves a factor out):
        q_index: `(B, Tq)` int, the query's index $n_i$ on the key axis
            (`arange(T)` for self-attention, `start + i` in a cache).
        lens: `(B, Tq)` int, key $j$ visible iff $j < L_i$.
        window: int scalar $w$: $n_i - w < j \le n_i$ when $w \ge 1$.
        q_seg: `(B, Tq)` int segment of each query; with `k_seg` `(B, Tk)`:
            visible iff equal.
        k_seg: `(B, Tk)`.
        window_right: int scalar $r$, the window's reach past the query
            (`None`: 0, the causal window); `window - 1` is the
            bidirectional window $|n_i - j| < w$.
        k_valid: `(B, Tk)` bool, a key mask (padding): visible only where True.
        chunk: int scalar $C$ (chunked attention, Llama 4): visible iff
            $\lfloor n_i / C \rfloor = \lfloor j / C \rfloor$.
    """

    q_index: Array
    lens: Array | None = None
    window: Array | None = None
    q_seg: Array | None = None
    k_seg: Array | None = None
    window_right: Array | None = None
    k_valid: Array | None = None
    chunk: Array | None = None

    def block(self, q_sl, kj, num_keys, k_sl=(None, None)):
        """`(B, bq, bk)` visibility of the queries `q_sl` (a slice of this
        rule's query arrays: `(q_index, lens, q_seg)`) and keys `kj` (with
        `k_sl = (k_seg, k_valid)` sliced alike); keys at or past `num_keys`
        (padding) are never visible."""
        qi, lens, qseg = q_sl
        kseg, kval = k_sl
        k = kj[None, None, :]
        vis = jnp.broadcast_to(k < num_keys, (qi.shape[0], qi.shape[1], kj.shape[0]))
        if lens is not None:
            vis = vis & (k < lens[..., None])
        if self.window is not None:
            n, w = qi[..., None], self.window
            right = n if self.window_right is None else n + self.window_right
            vis = vis & (((k <= right) & (k > n - w)) | (w <= 0))
        if qseg is not None:
            vis = vis & (qseg[..., None] == kseg[:, None, :])
        if kval is not None:
            vis = vis & kval[:, None, :]
        if self.chunk is not None:
            vis = vis & (qi[..., None] // self.chunk == k // self.chunk)
        return vis

    def full(self, num_keys):
        """The whole `(B, Tq, Tk)` boolean mask (for `"fused"`)."""
        return self.block(
            (self.q_index, self.lens, self.q_seg),
            jnp.arange(num_keys),
            num_keys,
            (self.k_seg, self.k_valid),
        )

    def key_slices(self, j, bk):
        """`(k_seg, k_valid)` of key block `j` (length `bk`)."""
        return tuple(
            None if a is None else _key_slice(a, j, bk, 1)
            for a in (self.k_seg, self.k_valid)
        )


class _Cfg(NamedTuple):
    """Static settings of one chunked call (hashable)."""

    bq: int
    bk: int
    num_keys: int
    scale: float
    divide: float | None  # logits = raw / divide (the reference's default)
    softcap: float | None
    has_window: bool
    has_lens: bool
    has_seg: bool


def _logits(cfg: _Cfg, qb, kb, stat, bias=None):
    raw = jnp.einsum("bhgqp,bhkp->bhgqk", qb, kb, preferred_element_type=stat)
    z = raw / cfg.divide if cfg.divide is not None else raw * cfg.scale
    t = None
    if cfg.softcap is not None:
        t = jnp.tanh(z / cfg.softcap)
        z = cfg.softcap * t
    if bias is not None:
        z = z + bias.astype(stat)
    return z, t


#: Skip the blocks in which no query sees a key (`lax.cond`); `False` computes
#: every block (the masked entries then contribute exactly zero).
SKIP_BLOCKS = True


def _maybe(pred, go, carry):
    """`go(carry)` where `pred` (a block with a visible key), else `carry`."""
    if not SKIP_BLOCKS:
        return go(carry)
    return jax.lax.cond(pred, go, lambda c: c, carry)


def _pad(x, axis, n, value=0):
    extra = n - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _q_blocks(a, nq, bq):
    """(B, Tqp, ...) -> (nq, B, bq, ...)."""
    return jnp.moveaxis(a.reshape(a.shape[0], nq, bq, *a.shape[2:]), 1, 0)


def _key_slice(a, j, bk, axis):
    return jax.lax.dynamic_slice_in_dim(a, j * bk, bk, axis=axis)


def _rule_slices(rule: MaskRule, nq, bq):
    """Per-query-block slices (stacked on a leading axis) of the query data."""
    qi = _q_blocks(rule.q_index, nq, bq)
    lens = None if rule.lens is None else _q_blocks(rule.lens, nq, bq)
    qseg = None if rule.q_seg is None else _q_blocks(rule.q_seg, nq, bq)
    return qi, lens, qseg


def _forward_block(cfg, rule, k, v, qb, qi, lens, qseg, bb, stat):
    """One query block against every key block: (out, lse), both float `stat`.
    `bb`: the block's score bias `(Bb, KV, G, bq, Tk)` or `None`."""
    B, KV, G, bq, p = qb.shape
    nk = k.shape[2] // cfg.bk
    m0 = jnp.full((B, KV, G, bq), -jnp.inf, stat)
    init = (m0, jnp.zeros_like(m0), jnp.zeros((B, KV, G, bq, p), stat))
    # carry: running max m, normalizer z (sum of exp(s - m)), weighted values

    def body(carry, j):
        kj = j * cfg.bk + jnp.arange(cfg.bk)
        vis = rule.block((qi, lens, qseg), kj, cfg.num_keys, rule.key_slices(j, cfg.bk))

        def go(c):
            m, z, acc = c
            ks, vs = _key_slice(k, j, cfg.bk, 2), _key_slice(v, j, cfg.bk, 2)
            bias = None if bb is None else _key_slice(bb, j, cfg.bk, 4)
            s, _ = _logits(cfg, qb, ks, stat, bias)
            s = jnp.where(vis[:, None, None], s, MASK_VALUE)
            s = jnp.where(kj < cfg.num_keys, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            w = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            z = z * corr + jnp.sum(w, axis=-1)
            acc = acc * corr[..., None] + jnp.einsum(
                "bhgqk,bhkp->bhgqp", w, vs.astype(stat)
            )
            return m_new, z, acc

        return _maybe(jnp.any(vis), go, carry), None

    (m, z, acc), _ = jax.lax.scan(body, init, jnp.arange(nk))
    safe = jnp.where(z > 0, z, 1.0)
    return acc / safe[..., None], m + jnp.log(safe)


def _mean_v(cfg, v, stat):
    """Mean of the real (unpadded) values per kv head: (B, KV, 1, 1, p)."""
    real = (jnp.arange(v.shape[2]) < cfg.num_keys)[:, None]
    total = jnp.sum(jnp.where(real, v.astype(stat), 0), axis=2)
    return (total / cfg.num_keys)[:, :, None, None, :]


def _bias_blocks(bias, nq, bq):
    """(Bb, KV, G, Tqp, Tkp) -> (nq, Bb, KV, G, bq, Tkp), or None."""
    if bias is None:
        return None
    Bb, KV, G, _, Tk = bias.shape
    return jnp.moveaxis(bias.reshape(Bb, KV, G, nq, bq, Tk), 3, 0)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(cfg, q, k, v, rule, has_vis, bias):
    return _chunked_fwd(cfg, q, k, v, rule, has_vis, bias)[0]


def _chunked_fwd(cfg, q, k, v, rule, has_vis, bias):
    stat = jnp.promote_types(q.dtype, jnp.float32)
    B, KV, G, Tqp, p = q.shape
    nq = Tqp // cfg.bq
    qs = jnp.moveaxis(q.reshape(B, KV, G, nq, cfg.bq, p), 3, 0)
    qi, lens, qseg = _rule_slices(rule, nq, cfg.bq)
    bbs = _bias_blocks(bias, nq, cfg.bq)

    # Checkpointed: where a transformation differentiates this primal code
    # instead of using the custom backward (seen under jax.grad of a scanned
    # Stack), each query block's forward is recomputed rather than its (bq, Tk)
    # weights saved for every block, so memory stays O(T * block).
    @jax.checkpoint
    def one(args):
        qb, qi_b, lens_b, qseg_b, bb = args
        return _forward_block(cfg, rule, k, v, qb, qi_b, lens_b, qseg_b, bb, stat)

    out, lse = jax.lax.map(one, (qs, qi, lens, qseg, bbs))
    out = jnp.moveaxis(out, 0, 3).reshape(B, KV, G, Tqp, p)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, KV, G, Tqp)
    ok = has_vis[:, None, None, :]
    out = jnp.where(ok[..., None], out, _mean_v(cfg, v, stat)).astype(v.dtype)
    return out, (q, k, v, rule, has_vis, bias, out, lse)


def _chunked_bwd(cfg, res, dout):
    q, k, v, rule, has_vis, bias, out, lse = res
    stat = jnp.promote_types(q.dtype, jnp.float32)
    B, KV, G, Tqp, p = q.shape
    nq, nk = Tqp // cfg.bq, k.shape[2] // cfg.bk
    dout = dout.astype(stat)
    ok = has_vis[:, None, None, :]
    D = jnp.sum(dout * out.astype(stat), axis=-1)
    lse = jnp.where(ok, lse, jnp.inf)  # rows without a visible key: P = 0

    def blocks(a):
        return jnp.moveaxis(a.reshape(B, KV, G, nq, cfg.bq, *a.shape[4:]), 3, 0)

    qs, dos, Ds, lses = blocks(q), blocks(dout), blocks(D), blocks(lse)
    qi, lens, qseg = _rule_slices(rule, nq, cfg.bq)
    bbs = _bias_blocks(bias, nq, cfg.bq)
    zeros_kv = jnp.zeros(k.shape, stat)

    def q_body(carry, xs):
        dk, dv = carry
        qb, dob, Db, lseb, qi_b, lens_b, qseg_b, bb = xs

        def k_body(c, j):
            kj = j * cfg.bk + jnp.arange(cfg.bk)
            vis = rule.block(
                (qi_b, lens_b, qseg_b), kj, cfg.num_keys, rule.key_slices(j, cfg.bk)
            )

            def go(c):
                dq_b, dk, dv, db_b = c
                ks, vs = _key_slice(k, j, cfg.bk, 2), _key_slice(v, j, cfg.bk, 2)
                bias_j = None if bb is None else _key_slice(bb, j, cfg.bk, 4)
                s, t = _logits(cfg, qb, ks, stat, bias_j)
                vis5 = vis[:, None, None]
                s = jnp.where(vis5, s, MASK_VALUE)
                s = jnp.where(kj < cfg.num_keys, s, -jnp.inf)
                P = jnp.exp(s - lseb[..., None])
                dv_j = jnp.einsum("bhgqk,bhgqp->bhkp", P, dob)
                dP = jnp.einsum("bhgqp,bhkp->bhgqk", dob, vs.astype(stat))
                dS = jnp.where(vis5, P * (dP - Db[..., None]), 0)
                if db_b is not None:  # the bias adds to the capped logits
                    u = (
                        dS
                        if db_b.shape[0] == dS.shape[0]
                        else jnp.sum(dS, axis=0, keepdims=True)
                    )
                    db_b = jax.lax.dynamic_update_slice_in_dim(
                        db_b, u.astype(db_b.dtype), j * cfg.bk, axis=4
                    )
                if t is not None:
                    dS = dS * (1 - t * t)
                dz = dS / cfg.divide if cfg.divide is not None else dS * cfg.scale
                dq_b = dq_b + jnp.einsum("bhgqk,bhkp->bhgqp", dz, ks.astype(stat))
                dk_j = jnp.einsum("bhgqk,bhgqp->bhkp", dz, qb.astype(stat))

                def add(a, u):
                    return jax.lax.dynamic_update_slice_in_dim(
                        a, _key_slice(a, j, cfg.bk, 2) + u, j * cfg.bk, axis=2
                    )

                return dq_b, add(dk, dk_j), add(dv, dv_j), db_b

            return _maybe(jnp.any(vis), go, c), None

        dq0 = jnp.zeros(qb.shape, stat)
        db0 = None if bb is None else jnp.zeros(bb.shape, stat)
        (dq_b, dk, dv, db_b), _ = jax.lax.scan(
            k_body, (dq0, dk, dv, db0), jnp.arange(nk)
        )
        return (dk, dv), (dq_b, db_b)

    (dk, dv), (dq, dbias) = jax.lax.scan(
        q_body, (zeros_kv, zeros_kv), (qs, dos, Ds, lses, qi, lens, qseg, bbs)
    )
    dq = jnp.moveaxis(dq, 0, 3).reshape(q.shape)
    if dbias is not None:
        dbias = jnp.moveaxis(dbias, 0, 3).reshape(bias.shape).astype(bias.dtype)
    # rows without a visible key returned mean(v): d v_j = sum of their dout / Tk
    none = jnp.sum(jnp.where(ok[..., None], 0, dout), axis=(2, 3))  # (B, KV, p)
    real = (jnp.arange(k.shape[2]) < cfg.num_keys)[:, None]
    dv = dv + jnp.where(real, none[:, :, None, :] / cfg.num_keys, 0)
    return (
        dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None,
        dbias,
    )  # fmt: skip


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _visible_stats(rule: MaskRule, num_queries, num_keys, k_bad, bk):
    """`(has_visible, sees_bad)`, each `(B, Tq)`, scanning key blocks of `bk`."""
    nk = -(-num_keys // bk)
    Tkp = nk * bk
    kseg = None if rule.k_seg is None else _pad(rule.k_seg, 1, Tkp, -1)
    kval = None if rule.k_valid is None else _pad(rule.k_valid, 1, Tkp, False)
    bad = None if k_bad is None else _pad(k_bad, 1, Tkp, False)
    B = rule.q_index.shape[0]
    init = (jnp.zeros((B, num_queries), bool), jnp.zeros((B, num_queries), bool))

    def body(carry, j):
        has, sb = carry
        kj = j * bk + jnp.arange(bk)
        k_sl = tuple(
            None if a is None else _key_slice(a, j, bk, 1) for a in (kseg, kval)
        )
        vis = rule.block((rule.q_index, rule.lens, rule.q_seg), kj, num_keys, k_sl)
        has = has | jnp.any(vis, axis=-1)
        if bad is not None:
            sb = sb | jnp.any(vis & _key_slice(bad, j, bk, 1)[:, None, :], axis=-1)
        return (has, sb), None

    (has, sb), _ = jax.lax.scan(body, init, jnp.arange(nk))
    return has, sb


def chunked_attention(
    q: Array,
    k: Array,
    v: Array,
    rule: MaskRule,
    *,
    scale: float,
    divide: float | None = None,
    softcap: float | None = None,
    k_bad: Array | None = None,
    bias: Array | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Array, Array]:
    r"""Memory-efficient attention (see the module docstring for the maths).

    Args:
        q: `(B, KV, G, Tq, p)` queries (query head $i$ = group $(i // G, i \% G)$).
        k, v: `(B, KV, Tk, p)`.
        rule: the `MaskRule` (its arrays with leading axis `B`).
        scale: $\sigma$; `divide` instead divides by it (bit-for-bit the
            reference's default $1/\sqrt p$).
        softcap: $c$ of $c \tanh(s/c)$, or `None`.
        k_bad: `(B, Tk)` bool, keys whose input row was non-finite.
        bias: the additive score bias $b$, `(Bb, KV, G, Tq, Tk)` with `Bb`
            1 or `B` (query head $i$ at `(i // G, i % G)`), or `None`;
            differentiable (its gradient is summed over `B` when `Bb` is 1).
        block_q, block_k: block lengths (default `BLOCK_SIZE`, at most the lengths).

    Returns:
        `(out, sees_bad)`: `out` `(B, KV, G, Tq, p)` in `v`'s dtype; `sees_bad`
        `(B, Tq)` whether the query sees a `k_bad` key (all False without it).
        Differentiable in `q`, `k`, `v` (flash-attention backward).
    """
    B, KV, G, Tq, p = q.shape
    Tk = k.shape[2]
    bq = min(block_q or BLOCK_SIZE, Tq)
    bk = min(block_k or BLOCK_SIZE, Tk)
    Tqp, Tkp = -(-Tq // bq) * bq, -(-Tk // bk) * bk
    # checkpointed for the same reason as the query blocks in `_chunked_fwd`
    stats = jax.checkpoint(_visible_stats, static_argnums=(1, 2, 4))
    has_vis, sees_bad = stats(rule, Tq, Tk, k_bad, bk)
    cfg = _Cfg(
        bq, bk, Tk, float(scale), divide, softcap,
        rule.window is not None, rule.lens is not None, rule.q_seg is not None,
    )  # fmt: skip
    padded = MaskRule(
        _pad(rule.q_index, 1, Tqp),
        None if rule.lens is None else _pad(rule.lens, 1, Tqp),
        rule.window,
        None if rule.q_seg is None else _pad(rule.q_seg, 1, Tqp, -1),
        None if rule.k_seg is None else _pad(rule.k_seg, 1, Tkp, -2),
        rule.window_right,
        None if rule.k_valid is None else _pad(rule.k_valid, 1, Tkp, False),
        rule.chunk,
    )
    if bias is not None:
        bias = _pad(_pad(bias, 3, Tqp), 4, Tkp)
    out = _chunked(
        cfg,
        _pad(q, 3, Tqp),
        _pad(k, 2, Tkp),
        _pad(v, 2, Tkp),
        padded,
        _pad(has_vis, 1, Tqp, False),
        bias,
    )
    return out[:, :, :, :Tq], sees_bad


def fused_attention(
    q: Array,
    k: Array,
    v: Array,
    rule: MaskRule,
    *,
    scale: float,
    k_bad: Array | None = None,
    bias: Array | None = None,
) -> tuple[Array, Array]:
    """`jax.nn.dot_product_attention` with the rule as a boolean mask.

    Shapes (`bias` too) and returns as `chunked_attention`. On a GPU with
    bfloat16/float16 input cuDNN is asked for (`implementation="cudnn"`),
    and XLA's path is used when cuDNN refuses; elsewhere XLA's path (full
    logits).
    """
    B, KV, G, Tq, p = q.shape
    Tk = k.shape[2]
    mask = rule.full(Tk)  # (B, Tq, Tk)
    sees_bad = (
        jnp.zeros((B, Tq), bool)
        if k_bad is None
        else jnp.any(mask & k_bad[:, None, :], axis=-1)
    )
    qt = jnp.transpose(q, (0, 3, 1, 2, 4)).reshape(B, Tq, KV * G, p)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    qt, kt, vt = qt.astype(dtype), kt.astype(dtype), vt.astype(dtype)
    args = dict(mask=mask[:, None], scale=float(scale))
    if bias is not None:
        args["bias"] = bias.reshape(bias.shape[0], KV * G, Tq, Tk).astype(dtype)
    out = None
    if jax.devices()[0].platform == "gpu" and dtype in (jnp.bfloat16, jnp.float16):
        try:
            out = jax.nn.dot_product_attention(
                qt, kt, vt, implementation="cudnn", **args
            )
        except (ValueError, RuntimeError, NotImplementedError, TypeError):
            out = None
    if out is None:
        out = jax.nn.dot_product_attention(qt, kt, vt, implementation="xla", **args)
    out = jnp.transpose(out.reshape(B, Tq, KV, G, p), (0, 2, 3, 1, 4))
    return out, sees_bad


def refuse(owner: str, impl: str, option: str, why: str) -> None:
    """Raise the `ConfigError` for an option an implementation does not support."""
    raise ConfigError(
        f"{owner}: {option} is not supported by attention_impl={impl!r} ({why}); "
        f"use attention_impl='reference'"
        + ("" if option == "dropout" or impl == "chunked" else " or 'chunked'")
        + "."
    )


def sqrt_divisor(scale: float, head_dim: int) -> float | None:
    """`sqrt(p)` when `scale` is the default $1/\\sqrt p$ (divide, as the
    reference does), else `None` (multiply)."""
    return math.sqrt(head_dim) if scale == 1.0 / math.sqrt(head_dim) else None


def as_rows(a, lead, n):
    """Broadcast `a` to `(*lead, n)` and flatten the leading axes: `(B, n)`."""
    a = jnp.broadcast_to(a, (*lead, n))
    return a.reshape(int(np.prod(lead)) if lead else 1, n)
