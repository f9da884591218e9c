"""Dropout keeps a fraction 1 - p and rescales what it keeps by 1 / (1 - p).

Checked on `functional.dropout` and inside the modules that use it (the
attention weights of `MultiHeadAttention`, the branch outputs of
`TransformerBlock`), where each dropped/kept entry is read off the output of
a layer built so that the output *is* the dropped quantity. Keep fractions
are compared with 1 - p within five binomial standard deviations; kept
entries must equal the undropped ones times 1 / (1 - p).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
import blocklab.nn.functional as F

RATES = [0.1, 0.3, 0.75]


def assert_inverted_dropout(ratio, p):
    """`ratio` = dropped / undropped, entrywise: each 0 or 1/(1-p); kept share ~ 1-p."""
    ratio = np.asarray(ratio, np.float64).ravel()
    kept = ratio != 0
    n = ratio.size
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(kept.mean() - (1 - p)) <= 5 * sigma, (kept.mean(), 1 - p, sigma)
    np.testing.assert_allclose(ratio[kept], 1 / (1 - p), rtol=1e-4)


@pytest.mark.parametrize("p", RATES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_functional_dropout_keeps_1_minus_p_and_rescales(p, dtype):
    x = jnp.asarray(np.random.default_rng(0).uniform(1, 2, (100, 200)), dtype)
    y = F.dropout(x, p, jax.random.key(1))
    assert y.dtype == dtype
    # bf16: 1 - p and the quotient are each rounded (two bf16 roundings)
    ratio = np.asarray(y, np.float64) / np.asarray(x, np.float64)
    rtol = 1e-6 if dtype == jnp.float32 else 2 * 2.0**-8
    kept = ratio != 0
    assert abs(kept.mean() - (1 - p)) <= 5 * np.sqrt(p * (1 - p) / kept.size)
    np.testing.assert_allclose(ratio[kept], 1 / (1 - p), rtol=rtol)
    # unbiased: the mean is kept (20000 draws)
    assert np.asarray(y, np.float64).mean() == pytest.approx(
        np.asarray(x, np.float64).mean(), rel=6 * np.sqrt(p / (1 - p) / x.size)
    )


def test_functional_dropout_is_the_identity_without_key_or_rate():
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(F.dropout(x, 0.5, None), x)
    np.testing.assert_array_equal(F.dropout(x, 0.0, jax.random.key(0)), x)
    a, b = (F.dropout(jnp.ones(1000), 0.5, jax.random.key(k)) for k in (0, 1))
    assert not np.array_equal(a, b)  # the mask comes from the key


def _keys(n=32):
    return jax.random.split(jax.random.key(7), n)


@pytest.mark.parametrize("p", [0.3, 0.75])
def test_attention_weights_dropout(p):
    """With x = I (T = d tokens), W_v = W_o = I and one head, the output row i
    is row i of the (dropped) attention weights, so output / weights is the
    dropout factor of each weight."""
    T = d = 16
    mha = bl.MultiHeadAttention(d, 1, dropout=p, key=jax.random.key(0))
    eye = jnp.eye(d, dtype=jnp.float32)
    mha = eqx.tree_at(lambda m: (m.W_v.weight, m.W_o.weight), mha, (eye, eye))
    x = jnp.eye(T, dtype=jnp.float32)
    weights = np.asarray(mha.trace(x).weights[0], np.float64)  # before dropout
    np.testing.assert_allclose(mha(x), weights, rtol=1e-6)  # key=None: no dropout
    out = eqx.filter_jit(jax.vmap(lambda k: mha(x, key=k)))(_keys())
    assert_inverted_dropout(np.asarray(out, np.float64) / weights, p)


@pytest.mark.parametrize("branch", ["attention", "ffn"])
@pytest.mark.parametrize("p", [0.3])
def test_block_branch_dropout(branch, p):
    """Pre-LN block whose other branch writes zero (and whose attention has no
    dropout of its own): (output - x) / (undropped branch) is the dropout
    factor of each entry the branch writes."""
    d, T = 16, 8
    blk = bl.TransformerBlock(
        d,
        2,
        dropout=p,
        act="gelu",
        bias=True,
        attn_factory=lambda key: bl.MultiHeadAttention(d, 2, key=key),
        key=jax.random.key(3),
    )
    silence = (
        (lambda b: b.ffn.W_2.weight)
        if branch == "attention"
        else (lambda b: b.attention.W_o.weight)
    )
    blk = eqx.tree_at(silence, blk, jnp.zeros_like(silence(blk)))
    if branch == "attention":  # the FFN's output bias must not write either
        blk = eqx.tree_at(lambda b: b.ffn.W_2.bias, blk, jnp.zeros(d))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(T, d)), jnp.float32)
    assert blk(x).dtype == jnp.float32  # (the ratio's rtol 1e-4 is float32's)
    undropped = np.asarray(blk(x), np.float64) - np.asarray(x)
    assert np.abs(undropped).min() > 1e-6
    out = eqx.filter_jit(jax.vmap(lambda k: blk(x, key=k)))(_keys())
    ratio = (np.asarray(out, np.float64) - np.asarray(x)) / undropped
    assert_inverted_dropout(ratio, p)
