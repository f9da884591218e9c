"""Multi-head attention (with and without QK-norm) against the NumPy reference."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import blocklab as bl

D, H, T = 16, 4, 6
CAUSAL = np.arange(1, T + 1)
LENS = [None, 4, CAUSAL, np.array([6, 0, 3, 1, 6, 2])]


def _attention_dict(rng, *, bias, qk_norm):
    sd = {}
    for w in ("W_q", "W_k", "W_v", "W_o"):
        sd[f"{w}.weight"] = rng.normal(0, 1 / math.sqrt(D), (D, D))
        if bias:
            sd[f"{w}.bias"] = rng.normal(0, 0.3, D)
    if qk_norm:
        for n in ("q_norm", "k_norm"):
            sd[f"{n}.weight"] = 1 + rng.normal(0, 0.3, D // H)
    return sd


def _build(sd, *, bias, qk_norm, dtype):
    mha = bl.MultiHeadAttention(D, H, bias=bias, qk_norm=qk_norm, key=jax.random.key(0))
    return bl.load_state_dict(mha, sd, dtype=dtype)


def _prefixed(sd):
    return {f"attention.{k}": v for k, v in sd.items()}


@pytest.mark.parametrize("valid_lens", LENS, ids=["none", "scalar", "causal", "ragged"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.float64
def test_trace_matches_reference(valid_lens, bias, qk_norm):
    rng = np.random.default_rng(0)
    sd = _attention_dict(rng, bias=bias, qk_norm=qk_norm)
    x = rng.normal(size=(T, D))
    mha = _build(sd, bias=bias, qk_norm=qk_norm, dtype=jnp.float64)
    out, weights, logits = mha.trace(jnp.asarray(x), valid_lens)
    r_out, r_weights, r_logits = ref.attention(_prefixed(sd), x, H, valid_lens)
    np.testing.assert_allclose(logits, r_logits, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(weights, r_weights, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(out, r_out, rtol=1e-11, atol=1e-12)


def test_call_returns_the_trace_output_and_weights_rows_sum_to_one():
    rng = np.random.default_rng(1)
    sd = _attention_dict(rng, bias=True, qk_norm=False)
    mha = _build(sd, bias=True, qk_norm=False, dtype=jnp.float32)
    x = jnp.asarray(rng.normal(size=(T, D)))
    tr = mha.trace(x, CAUSAL)
    np.testing.assert_array_equal(mha(x, CAUSAL), tr.output)
    assert tr.weights.shape == tr.logits.shape == (H, T, T)
    assert tr.weights.dtype == jnp.float32  # the suite's default precision
    # float32: a sum of T = 6 rounded weights, each within 2^-24 relative
    np.testing.assert_allclose(np.asarray(tr.weights).sum(-1), 1.0, atol=1e-6)
    # causal: no weight above the diagonal
    assert np.all(
        np.asarray(tr.weights)[:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]]
        == 0
    )


def test_head_split_follows_contiguous_feature_blocks():
    # Zero every query/key feature except head 1's block: the logits of the
    # other heads vanish and their weights are uniform over the valid keys.
    rng = np.random.default_rng(2)
    sd = _attention_dict(rng, bias=False, qk_norm=False)
    p = D // H
    for w in ("W_q.weight", "W_k.weight"):
        keep = np.zeros((D, 1))
        keep[p : 2 * p] = 1
        sd[w] = sd[w] * keep
    tr = _build(sd, bias=False, qk_norm=False, dtype=jnp.float32).trace(
        jnp.asarray(rng.normal(size=(T, D)))
    )
    assert tr.weights.dtype == jnp.float32  # the rounding bound below is float32's
    logits = np.asarray(tr.logits)
    assert np.all(logits[[0, 2, 3]] == 0) and np.abs(logits[1]).max() > 0.1
    # exp(0) / 6 exactly, then one float32 rounding: within 2^-24 ~ 6e-8
    np.testing.assert_allclose(np.asarray(tr.weights)[0], 1 / T, rtol=1e-7)


def test_qk_norm_bounds_logits_by_sqrt_head_dim():
    # Unit gains and eps -> 0: |q . k| / sqrt(p) <= ||q|| ||k|| / sqrt(p) = sqrt(p),
    # whatever the scale of W_q, W_k (here x 1000).
    mha = bl.MultiHeadAttention(D, H, qk_norm=True, norm_eps=0.0, key=jax.random.key(3))
    mha = bl.nn.init.scale(mha, 1000.0)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(T, D)), jnp.float32)
    logits = np.asarray(mha.trace(x).logits)
    p = D // H
    assert np.abs(logits).max() <= math.sqrt(p) * (1 + 1e-5)
    # The bound is attained for q = k (identical query and key weights):
    same = eqx.tree_at(lambda m: m.W_k.weight, mha, mha.W_q.weight)
    diag = np.asarray(same.trace(x).logits)[:, np.arange(T), np.arange(T)]
    np.testing.assert_allclose(diag, math.sqrt(p), rtol=1e-5)


@pytest.mark.float64
def test_qk_norm_logits_invariant_to_query_weight_scale():
    # Chapter exercise: with eps = 0 and no query bias, scaling W_q leaves the
    # logits unchanged.
    # Exact in exact arithmetic: in float64 (weights too) it holds to a few
    # float64 ulps; float32 weights would already miss by ~5e-8.
    mha = bl.MultiHeadAttention(D, H, qk_norm=True, norm_eps=0.0, key=jax.random.key(4))
    mha = bl.load_state_dict(mha, bl.state_dict(mha), dtype=jnp.float64)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(T, D)))
    scaled = eqx.tree_at(lambda m: m.W_q.weight, mha, 37.0 * mha.W_q.weight)
    logits = mha.trace(x).logits
    assert logits.dtype == jnp.float64
    np.testing.assert_allclose(scaled.trace(x).logits, logits, rtol=1e-14, atol=1e-14)


def test_qk_norm_parameters_are_per_head_gains():
    mha = bl.MultiHeadAttention(D, H, qk_norm=True, key=jax.random.key(0))
    assert mha.q_norm.weight.shape == mha.k_norm.weight.shape == (D // H,)
    assert bl.count_params(mha) == 4 * D * D + 2 * (D // H)


def test_dropout_needs_a_key_and_then_changes_the_output():
    mha = bl.MultiHeadAttention(D, H, dropout=0.5, key=jax.random.key(5))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(T, D)))
    no_dropout = bl.MultiHeadAttention(D, H, key=jax.random.key(5))
    np.testing.assert_array_equal(mha(x), no_dropout(x))  # key=None: inference
    a, b = mha(x, key=jax.random.key(1)), mha(x, key=jax.random.key(2))
    assert np.abs(np.asarray(a - b)).max() > 1e-3
    assert np.abs(np.asarray(a - mha(x))).max() > 1e-3
