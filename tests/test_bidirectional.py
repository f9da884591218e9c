"""Bidirectional attention (no causal mask): padding masks, the bidirectional
window, segments and an additive score bias, in every implementation, against
a NumPy loop with the mask written out; the block identities and the signal
statistics without the causal mask."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab._validate import ConfigError
from blocklab.diagnostics import identities
from blocklab.diagnostics.propagation import signal_stats
from blocklab.models.encoder import EncoderModel
from blocklab.models.encoder_config import EncoderConfig
from blocklab.nn import attention_impls as impls_mod
from blocklab.nn.block import TransformerBlock
from blocklab.nn.mask import Mask
from blocklab.nn.stack import Stack

IMPLS = ("reference", "fused", "chunked")


def _impls(default):
    """Every implementation; all but `default` marked slow (CI time)."""
    return [
        i if i == default else pytest.param(i, marks=pytest.mark.slow) for i in IMPLS
    ]


def numpy_attention(mha, x, visible, bias=None):
    """Multi-head attention in float64 with an explicit `(B, H?, Tq, Tk)`
    boolean mask (a row with no visible key: uniform over all keys)."""
    W = {
        n: np.asarray(getattr(mha, n).weight, np.float64)
        for n in ("W_q", "W_k", "W_v", "W_o")
    }
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    H, KV, p = mha.num_heads, mha.num_kv_heads, mha.head_dim
    q = (x @ W["W_q"].T).reshape(B, T, H, p)
    k = (x @ W["W_k"].T).reshape(B, T, KV, p)
    v = (x @ W["W_v"].T).reshape(B, T, KV, p)
    out = np.zeros((B, T, H, p))
    for b in range(B):
        for h in range(H):
            g = h // (H // KV)
            for i in range(T):
                s = np.array([q[b, i, h] @ k[b, j, g] * mha.scale for j in range(T)])
                if bias is not None:
                    s = s + np.asarray(bias, np.float64)[h, i]
                vis = np.asarray(visible[b, i])
                if vis.any():
                    s = np.where(vis, s, -np.inf)
                    w = np.exp(s - s[vis].max())
                else:
                    w = np.ones(T)
                w = w / w.sum()
                out[b, i, h] = w @ v[b, :, g]
    return out.reshape(B, T, H * p) @ W["W_o"].T


def bidirectional_window(half, T):
    """ModernBERT's local layers as `transformers` masks them
    (`masking_utils.sliding_window_bidirectional_overlay`): key k is visible
    from query q iff |q - k| <= half, with half = local_attention // 2."""
    return np.array([[abs(q - k) <= half for k in range(T)] for q in range(T)])


@pytest.mark.slow  # imports torch
def test_the_written_window_is_transformers_own_rule():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    for half in (1, 2, 5):
        rule = masking_utils.sliding_window_bidirectional_overlay(half)
        hf = [[bool(rule(0, 0, q, k)) for k in range(12)] for q in range(12)]
        np.testing.assert_array_equal(bidirectional_window(half, 12), hf)


@pytest.fixture
def small_blocks(monkeypatch):
    # chunked: several query and key blocks (padding, skipped blocks) at T = 9
    monkeypatch.setattr(impls_mod, "BLOCK_SIZE", 4)


def _case(T=9):
    B = 2
    key_mask = np.ones((B, T), bool)
    key_mask[0, 6:] = False  # sequence 0 padded after 6 tokens
    seg = np.zeros((B, T), np.int32)
    seg[1, 4:] = 1  # sequence 1 packs two documents
    x = jax.random.normal(jax.random.key(1), (B, T, 16))
    bias = 0.5 * jax.random.normal(jax.random.key(2), (4, T, T))
    return x, key_mask, seg, bias


@pytest.mark.parametrize("impl", _impls("chunked"))
def test_bidirectional_window_mask_segments_bias_equal_numpy(impl, small_blocks):
    T, half = 9, 2  # ModernBERT local_attention = 4: |q - k| <= 2
    mha = bl.MultiHeadAttention(
        16, 4, num_kv_heads=2, window=half + 1, window_mode="bidirectional",
        key=jax.random.key(0),
    )  # fmt: skip
    x, key_mask, seg, bias = _case(T)
    local = bidirectional_window(half, T)
    visible = local[None] & key_mask[:, None, :] & (seg[:, :, None] == seg[:, None, :])
    want = numpy_attention(mha, x, visible, bias)
    got = mha(
        x, Mask.padding(key_mask) & Mask.segments(seg), score_bias=bias, impl=impl
    )
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_no_causal_mask_by_default_with_lengths_per_sequence(impl, small_blocks):
    T = 9
    mha = bl.MultiHeadAttention(16, 4, key=jax.random.key(3))
    x, _, _, _ = _case(T)
    lens = np.array([[5], [9]])  # one length per sequence
    visible = np.broadcast_to(np.arange(T)[None, None, :] < lens[:, :, None], (2, T, T))
    want = numpy_attention(mha, x, visible)
    np.testing.assert_allclose(mha(x, lens, impl=impl), want, atol=2e-5, rtol=1e-5)
    # the first token sees the whole (unpadded) sequence, not only itself
    assert visible[1, 0].sum() == T


@pytest.mark.parametrize(
    "impl", ["chunked", pytest.param("fused", marks=pytest.mark.slow)]
)
def test_score_bias_and_input_gradients_equal_the_reference(impl, small_blocks):
    mha = bl.MultiHeadAttention(
        16, 4, num_kv_heads=2, window=3, window_mode="bidirectional",
        key=jax.random.key(0),
    )  # fmt: skip
    x, key_mask, seg, bias = _case()
    R = jax.random.normal(jax.random.key(5), x.shape)

    def loss(impl):
        def f(x, b):
            mask = Mask.padding(key_mask) & Mask.segments(seg)
            out = mha(x, mask, score_bias=b, impl=impl)
            return jnp.sum(R * out)

        return jax.grad(f, argnums=(0, 1))(x, bias)

    (gx, gb), (rx, rb) = loss(impl), loss("reference")
    np.testing.assert_allclose(gb, rb, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(gx, rx, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_chunked_bias_gradient_equals_a_finite_difference(small_blocks):
    mha = bl.MultiHeadAttention(8, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 6, 8), jnp.float32)
    b = 0.3 * jax.random.normal(jax.random.key(2), (2, 6, 6))
    R = jax.random.normal(jax.random.key(3), (1, 6, 8))

    def f(b):
        return jnp.sum(R * mha(x, score_bias=b, impl="chunked"))

    g = jax.grad(f)(b)
    eps, (h, i, j) = 1e-2, (1, 4, 2)
    e = jnp.zeros_like(b).at[h, i, j].set(eps)
    fd = (f(b + e) - f(b - e)) / (2 * eps)
    np.testing.assert_allclose(g[h, i, j], fd, rtol=2e-2, atol=1e-4)


def test_bad_masks_and_biases_are_refused_by_name():
    mha = bl.MultiHeadAttention(8, 2, key=jax.random.key(0))
    x = jnp.ones((2, 5, 8))
    with pytest.raises(ConfigError, match="key_mask"):
        mha(x, Mask.padding(np.ones((2, 4), bool)))
    with pytest.raises(ConfigError, match="key_mask"):
        mha(x, Mask.padding(np.ones((2, 5), np.int32)))
    with pytest.raises(ConfigError, match="score_bias"):
        mha(x, score_bias=jnp.zeros((3, 5, 5)))
    with pytest.raises(ConfigError, match="window_mode"):
        bl.MultiHeadAttention(8, 2, window=2, window_mode="both", key=jax.random.key(0))
    local = bl.MultiHeadAttention(
        8, 2, window=2, window_mode="bidirectional", key=jax.random.key(0)
    )
    with pytest.raises(ConfigError, match="window_mode"):
        local.step(x[:, :1], local.init_cache((2,), 4), 0)


def _bidirectional_blocks(n=2):
    blks = []
    for i in range(n):
        b = TransformerBlock(
            8, 2, window=2, window_mode="bidirectional", key=jax.random.key(i)
        )
        blks.append(b)
    return blks


@pytest.mark.slow
@pytest.mark.float64
def test_pre_ln_identities_hold_without_the_causal_mask():
    blks = _bidirectional_blocks()
    x = jax.random.normal(jax.random.key(7), (4, 8))
    assert identities.pre_ln_stream_sum(blks, x).holds()
    ident = identities.pre_ln_jacobian_expansion(blks, x)
    assert ident.holds(), ident.discrepancy
    # what changes without the causal mask: the first token's output depends
    # on the tokens after it (within the window), the last on those before
    J = jax.jacfwd(lambda v: blks[0](v))(x)  # (T, d, T, d)
    assert float(jnp.max(jnp.abs(J[0, :, 1]))) > 1e-3
    assert float(jnp.max(jnp.abs(J[0, :, 3]))) < 1e-12  # |0 - 3| >= window 2...
    # ... reached through the second block's window: two hops of 1
    J2 = jax.jacfwd(lambda v: blks[1](blks[0](v)))(x)
    assert float(jnp.max(jnp.abs(J2[0, :, 2]))) > 1e-4
    causal = jax.jacfwd(lambda v: blks[0](v, jnp.arange(1, 5)))(x)
    assert float(jnp.max(jnp.abs(causal[0, :, 1]))) == 0.0


@pytest.mark.slow
def test_signal_stats_runs_on_an_encoder_stack_entropy_closed_form():
    # W_q = 0: every logit is 0, so each query attends uniformly to the keys it
    # sees: entropy log T without the causal mask (mean_i log(i + 1) with it)
    T, N = 6, 2
    enc = EncoderModel(
        EncoderConfig(32, 8, 2, N, positions="none"), key=jax.random.key(0)
    )
    stack = eqx.tree_at(
        lambda s: s.blocks.attention.W_q.weight,
        enc.stack,
        replace_fn=jnp.zeros_like,
    )
    X = jax.random.normal(jax.random.key(1), (2, T, 8))
    stats = signal_stats(stack, X)
    np.testing.assert_allclose(stats.attn_entropy, np.full(N, np.log(T)), rtol=1e-5)
    assert np.all(np.isfinite(stats.stream_rms))
    assert isinstance(stack, Stack)
