"""Initialization-time signal statistics against independent loops and closed forms."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab import ConfigError
from blocklab.diagnostics import propagation as sg

D, H, N, B, T = 16, 2, 4, 2, 8
PLACEMENTS = ("post", "pre", "output", "sandwich")


def _in_default_float(tree):
    """float64 under a `float64` test, float32 (JAX's default) otherwise."""
    dtype = jnp.result_type(float)
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree
    )


def _small(placement, qk_norm=False, seed=0, **kw):
    stack = sg.chapter_stack(
        placement,
        num_blks=N,
        num_hiddens=D,
        num_heads=H,
        qk_norm=qk_norm,
        key=jax.random.key(seed),
        **kw,
    )
    dtype = jnp.result_type(float)  # float64 under a `float64` test
    X = jax.random.normal(jax.random.key(seed + 100), (B, T, D), dtype)
    R = jax.random.normal(jax.random.key(seed + 200), (B, T, D), dtype)
    return _in_default_float(stack), X, R


@eqx.filter_jit
def _trace(blk, h):
    return blk.trace(h)


def _loop_stats(stack, X):
    """Per-block statistics of a plain loop over `stack.block(i)`, NumPy float64."""
    hs = [np.asarray(x) for x in X]
    out = {k: [] for k in ("rms", "spread", "c_attn", "c_ffn", "entropy", "max_logit")}
    for i in range(len(stack)):
        blk = stack.block(i)
        traces = [_trace(blk, jnp.asarray(h)) for h in hs]
        hs = [np.asarray(tr.output, np.float64) for tr in traces]
        Hb = np.stack(hs)
        out["rms"].append(np.sqrt(np.mean(Hb**2)))
        centred = Hb - Hb.mean(axis=1, keepdims=True)
        out["spread"].append(np.sqrt(np.sum(centred**2) / np.sum(Hb**2)))
        out["c_attn"].append(
            np.mean([np.mean(np.asarray(t.attn_out) ** 2) for t in traces])
        )
        out["c_ffn"].append(
            np.mean([np.mean(np.asarray(t.ffn_out) ** 2) for t in traces])
        )
        ent = []
        for t in traces:
            p = np.asarray(t.attention.weights, np.float64)
            ent.append(np.mean(-np.sum(p * np.log(p), axis=-1)))
        out["entropy"].append(np.mean(ent))
        out["max_logit"].append(
            max(np.abs(np.asarray(t.attention.logits)).max() for t in traces)
        )
    return {k: np.asarray(v) for k, v in out.items()}, np.stack(hs)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "placement, qk_norm",
    [
        ("post", False),
        ("output", True),
        pytest.param("pre", False, marks=SLOW),
        pytest.param("output", False, marks=SLOW),
        pytest.param("sandwich", False, marks=SLOW),
        pytest.param("post", True, marks=SLOW),
    ],
)
@pytest.mark.float64
def test_forward_statistics_match_a_block_by_block_loop(placement, qk_norm):
    stack, X, R = _small(placement, qk_norm)
    got = sg.signal_stats(stack, X, R)
    want, _ = _loop_stats(stack, X)
    pairs = dict(
        rms=got.stream_rms,
        spread=got.token_spread,
        c_attn=got.c_attn,
        c_ffn=got.c_ffn,
        entropy=got.attn_entropy,
        max_logit=got.max_logit,
    )
    for name, value in pairs.items():
        assert value.shape == (N,)
        np.testing.assert_allclose(
            np.asarray(value), want[name], rtol=1e-9, atol=1e-12, err_msg=name
        )


@eqx.filter_jit
def _explicit_loss(stack, X, R):
    """mean(R * H_N) through a Python loop over the blocks (no scan, no collect)."""
    H = X
    for i in range(len(stack)):
        H = jax.vmap(stack.block(i))(H)
    return jnp.mean(R * H)


_explicit_grad = eqx.filter_jit(eqx.filter_grad(_explicit_loss))


@pytest.mark.parametrize(
    "placement",
    ["post", "output", *(pytest.param(p, marks=SLOW) for p in ("pre", "sandwich"))],
)
@pytest.mark.float64
def test_gradient_norms_match_jax_grad_of_the_explicit_loss(placement):
    stack, X, R = _small(placement)
    got = sg.signal_stats(stack, X, R).grad_norms
    grads = _explicit_grad(stack, X, R)
    for name in sg.PROJECTIONS:
        g = np.asarray(getattr(grads.blocks.attention, name).weight, np.float64)
        want = np.sqrt(np.sum(g**2, axis=(1, 2)))
        np.testing.assert_allclose(np.asarray(got[name]), want, rtol=1e-9, err_msg=name)


@pytest.mark.float64
def test_query_gradient_norm_is_the_slope_along_the_unit_gradient():
    """Central finite difference of the loss along G/|G| equals |G| (float64)."""
    stack, X, R = _small("post")
    norms = sg.signal_stats(stack, X, R).grad_norms["W_q"]
    G = _explicit_grad(stack, X, R).blocks.attention.W_q.weight
    k, eps = 2, 1e-5
    direction = jnp.zeros_like(G).at[k].set(G[k] / jnp.linalg.norm(G[k]))

    def shifted(t):
        w = stack.blocks.attention.W_q.weight + t * direction
        return _explicit_loss(
            eqx.tree_at(lambda s: s.blocks.attention.W_q.weight, stack, w), X, R
        )

    slope = (shifted(eps) - shifted(-eps)) / (2 * eps)
    np.testing.assert_allclose(float(slope), float(norms[k]), rtol=1e-6)


def test_readout_key_draws_a_standard_normal_readout():
    stack, X, _ = _small("post")
    key = jax.random.key(7)
    R = jax.random.normal(key, X.shape, X.dtype)
    a = sg.signal_stats(stack, X, key).grad_norms["W_v"]
    b = sg.signal_stats(stack, X, R).grad_norms["W_v"]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12)


def test_readout_of_the_wrong_shape_is_rejected():
    stack, X, _ = _small("post")
    with pytest.raises(ValueError, match=r"readout must be a PRNG key or an array"):
        sg.signal_stats(stack, X, jnp.ones((B, T + 1, D)))


def test_sweep_over_seeds_equals_a_loop_over_runs():
    opts = dict(num_blks=N, num_hiddens=D, num_heads=H, seq_len=T)
    swept = sg.signal_sweep("post", [0, 1, 2], **opts)
    for i, seed in enumerate([0, 1, 2]):
        single = sg.signal_run(jax.random.key(seed), "post", **opts)
        for name, value in single.as_dict().items():
            np.testing.assert_allclose(
                np.asarray(swept.as_dict()[name][i]),
                np.asarray(value),
                rtol=2e-5,
                atol=1e-9,
                err_msg=name,
            )
    count = sg.signal_sweep("post", num_seeds=3, **opts)
    np.testing.assert_array_equal(
        np.asarray(count.stream_rms), np.asarray(swept.stream_rms)
    )
    # one seed per compiled call (memory-bounded): the same values
    chunked = sg.signal_sweep("post", [0, 1, 2], chunk=1, **opts)
    np.testing.assert_allclose(
        np.asarray(chunked.stream_rms), np.asarray(swept.stream_rms), rtol=1e-6
    )


def test_sweep_rejects_a_non_positive_seed_count_and_ambiguous_seeds():
    with pytest.raises(ConfigError, match=r"num_seeds must lie in \[1, inf\], got 0"):
        sg.signal_sweep("pre", num_seeds=0)
    with pytest.raises(ConfigError, match="exactly one"):
        sg.signal_sweep("pre", [0, 1], num_seeds=2)
    with pytest.raises(ConfigError, match="exactly one"):
        sg.signal_sweep("pre")


# ------------------------------------------------------------------ chapter_stack
def test_chapter_stack_is_xavier_uniform_with_ffn_biases_only():
    stack = sg.chapter_stack(
        "post", num_blks=N, num_hiddens=D, num_heads=H, key=jax.random.key(0)
    )
    blk = stack.blocks
    assert isinstance(blk.norm1, bl.LayerNorm) and blk.ffn.act == "gelu"
    for name in sg.PROJECTIONS:
        assert getattr(blk.attention, name).bias is None
    np.testing.assert_array_equal(np.asarray(blk.ffn.W_1.bias), np.zeros((N, 4 * D)))
    np.testing.assert_array_equal(np.asarray(blk.ffn.W_2.bias), np.zeros((N, D)))
    assert blk.ffn.W_1.weight.shape == (N, 4 * D, D)
    for w in bl.nn.init.weights(stack):
        fan_out, fan_in = w.shape[-2:]
        limit = math.sqrt(6 / (fan_in + fan_out))
        assert float(jnp.max(jnp.abs(w))) <= limit
        # Var U(-a, a) = a^2 / 3 = 2 / (fan_in + fan_out); >= 1024 draws each, so
        # the sample variance is within 12% (four standard errors).
        np.testing.assert_allclose(float(jnp.var(w)), 2 / (fan_in + fan_out), rtol=0.12)


def test_alpha_scales_every_weight_and_nothing_else():
    key = jax.random.key(0)
    one = sg.chapter_stack("post", num_blks=N, num_hiddens=D, num_heads=H, key=key)
    half = sg.chapter_stack(
        "post", num_blks=N, num_hiddens=D, num_heads=H, alpha=0.5, key=key
    )
    for a, b in zip(bl.nn.init.weights(one), bl.nn.init.weights(half), strict=True):
        np.testing.assert_allclose(np.asarray(b), 0.5 * np.asarray(a), rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(half.blocks.norm1.weight), 1.0)
    np.testing.assert_array_equal(np.asarray(half.blocks.ffn.W_1.bias), 0.0)


@pytest.mark.parametrize("placement", ["post", pytest.param("output", marks=SLOW)])
def test_without_ffn_the_ffn_branch_writes_nothing(placement):
    stack, X, R = _small(placement, ffn=False)
    stats = sg.signal_stats(stack, X, R)
    np.testing.assert_array_equal(np.asarray(stats.c_ffn), 0.0)


def test_chapter_stack_rejects_an_unknown_placement():
    with pytest.raises(
        ValueError, match=r"placement must be one of .*got placement='mid'"
    ):
        sg.chapter_stack("mid", key=jax.random.key(0))


# ------------------------------------------------------------------ exercise helpers
def test_power_law_fit_recovers_exponent_and_prefactor():
    k = np.arange(1, 33)
    y = 3.0 * k**0.5
    y[:7] = 100.0  # only the 8..32 fit ignores these
    b, a = sg.fit_power_law(y, first=8)
    assert b == pytest.approx(0.5, abs=1e-12) and a == pytest.approx(3.0, rel=1e-12)
    with pytest.raises(ValueError, match=r"need 1 <= first < last <= 32"):
        sg.fit_power_law(y, first=32)


def test_variance_budget_on_hand_worked_values():
    ones = jnp.ones(2)
    stats = sg.SignalStats(
        stream_rms=jnp.array([1.5, 2.0]),
        token_spread=ones,
        c_attn=jnp.array([0.5, 0.25]),
        c_ffn=jnp.array([0.5, 0.25]),
        attn_entropy=ones,
        max_logit=ones,
        grad_norms={n: ones for n in sg.PROJECTIONS},
    )
    budget, measured = sg.variance_budget(stats)
    np.testing.assert_allclose(np.asarray(budget), [2.0, 2.5])
    np.testing.assert_allclose(np.asarray(measured), [2.25, 4.0])


def test_logit_growth_scales_logits_by_lambda_squared_without_qk_norm():
    lambdas = jnp.array([1.0, 2.0, 4.0, 8.0])
    key = jax.random.key(0)
    plain = sg.logit_growth(lambdas, qk_norm=False, num_hiddens=32, seq_len=16, key=key)
    normed = sg.logit_growth(lambdas, qk_norm=True, num_hiddens=32, seq_len=16, key=key)
    std = np.asarray(plain["logit_std"])
    np.testing.assert_allclose(std, std[0] * np.asarray(lambdas) ** 2, rtol=1e-5)
    # QK-norm: invariant up to the norm's epsilon (1e-6 against unit mean squares).
    np.testing.assert_allclose(
        np.asarray(normed["logit_std"]), float(normed["logit_std"][0]), rtol=1e-4
    )
    ent = np.asarray(plain["entropy"])
    assert np.all(ent <= math.log(16) + 1e-6) and np.all(np.diff(ent) < 0)


# ------------------------------------------------------------ the chapter's figures
@pytest.fixture(scope="module")
def chapter():
    return {p: sg.signal_sweep(p, num_seeds=3) for p in ("post", "pre")}


@SLOW
def test_pre_ln_stream_grows_and_tokens_stay_spread(chapter):
    pre = chapter["pre"]
    rms32 = np.asarray(pre.stream_rms[:, 31])
    spread = np.asarray(pre.token_spread[:, [7, 15, 31]]).mean(0)
    # The chapter: RMS 5.22-5.25, spreads 0.72 / 0.53 / 0.37 (one seed each).
    assert np.all(np.abs(rms32 - 5.2) < 0.35), rms32
    np.testing.assert_allclose(spread, [0.72, 0.53, 0.37], atol=0.07)


@SLOW
def test_post_ln_collapses_tokens_and_starves_query_key_gradients(chapter):
    post, pre = chapter["post"], chapter["pre"]
    np.testing.assert_allclose(np.asarray(post.stream_rms[:, 31]), 1.0, atol=2e-3)
    assert np.all(np.asarray(post.token_spread[:, 31]) < 1e-3)
    for name in ("W_q", "W_k"):
        ratio = np.asarray(pre.grad_norms[name][:, 31] / post.grad_norms[name][:, 31])
        assert np.all(ratio > 1e4), ratio
    # W_v, W_o keep gradients of order 0.06 in both (the chapter: 0.058-0.084).
    for name in ("W_v", "W_o"):
        for stats in (post, pre):
            g = np.asarray(stats.grad_norms[name][:, 31])
            assert np.all((g > 0.03) & (g < 0.15)), (name, g)


def test_signal_stats_refuses_or_flags_a_non_finite_input():
    """One NaN in X gave NaN stream statistics but finite gradient norms,
    silently. Concrete X: refused, naming the position. Under vmap (traced):
    every statistic of that member is NaN, gradient norms included, and the
    other member's equal its own call."""
    stack = bl.chapter_stack("pre", num_blks=2, num_hiddens=16, num_heads=2,
                             key=jax.random.key(0))  # fmt: skip
    X = jax.random.normal(jax.random.key(1), (2, 5, 16))
    bad = X.at[1, 3, 7].set(jnp.nan)
    with pytest.raises(bl.ConfigError, match=r"X must be finite, got X\[1, 3, 7\]=nan"):
        bl.signal_stats(stack, bad)
    both = jax.vmap(lambda x: bl.signal_stats(stack, x))(jnp.stack([X, bad]))
    alone = bl.signal_stats(stack, X)
    for name, norm in both.grad_norms.items():
        assert np.isnan(norm[1]).all(), name
        np.testing.assert_allclose(norm[0], alone.grad_norms[name], rtol=1e-5)
    assert np.isnan(both.stream_rms[1]).all() and np.isfinite(both.stream_rms[0]).all()
