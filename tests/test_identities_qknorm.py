"""Exercise 2: weights that QK-norm makes scale invariant, in float64.

The gradients of the identities come from `jax.grad`; here they are also
checked against NumPy central differences of the loss, and the invariance is
shown to break where its hypotheses (eps = 0, no bias) do not hold.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocklab import MultiHeadAttention
from blocklab.diagnostics import identities as ids

TOL = 1e-10


def _layer(d=32, h=4, seed=0, **kw):
    kw.setdefault("qk_norm", True)
    kw.setdefault("norm_eps", 0.0)
    return MultiHeadAttention(d, h, key=jax.random.key(seed), **kw)


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    tokens=st.sampled_from([3, 8]),
    alpha=st.floats(1e-2, 1e2),
    seed=st.integers(0, 1000),
    projection=st.sampled_from(["W_q", "W_k"]),
)
@settings(max_examples=10, deadline=None)
def test_output_invariant_to_one_heads_scale(heads, tokens, alpha, seed, projection):
    attn = _layer(h=heads, seed=seed)
    x = _x(seed, (tokens, 32))
    head = seed % heads
    assert ids.qk_norm_scale_invariance(
        attn, x, alpha, projection=projection, head=head
    ).holds(TOL)


@pytest.mark.parametrize("projection", ["W_q", "W_k"])
@pytest.mark.parametrize("head", [0, 3])
def test_weight_orthogonal_to_gradient(projection, head):
    r = ids.qk_norm_weight_orthogonality(
        _layer(), _x(1, (6, 32)), projection=projection, head=head
    )
    assert r.holds(TOL)


@pytest.mark.parametrize("alpha", [0.1, 0.5, 3.0, 40.0])
def test_gradient_scales_as_inverse_alpha(alpha):
    assert ids.qk_norm_gradient_scaling(_layer(), _x(2, (6, 32)), alpha, head=1).holds(
        TOL
    )


@pytest.mark.float64
def test_gradient_against_central_differences():
    # the gradient inside the identities is jax.grad; check a few entries by hand
    attn, x = _layer(seed=3), _x(3, (5, 32))
    R = _x(4, (5, 32))
    r = ids.qk_norm_gradient_scaling(attn, x, 1.0, head=2, readout=R)
    g = r.rhs  # gradient at W (alpha = 1)
    W = np.asarray(attn.W_q.weight, np.float64)

    attn64 = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, attn
    )

    def loss(Wq):
        new = eqx.tree_at(lambda a: a.W_q.weight, attn64, jnp.asarray(Wq))
        return float(jnp.mean(R * new(x)))

    h = 1e-6
    for i, j in [(0, 0), (3, 7), (7, 31)]:
        Wp, Wm = W.copy(), W.copy()
        Wp[16 + i, j] += h  # head 2 owns rows 16..23 (p = 8)
        Wm[16 + i, j] -= h
        assert (loss(Wp) - loss(Wm)) / (2 * h) == pytest.approx(g[i, j], abs=1e-8)


@pytest.mark.parametrize("lr", [None, 1.0, 30.0])
def test_step_grows_norm_by_eta_squared_g_squared(lr):
    r = ids.qk_norm_step_growth(_layer(), _x(5, (6, 32)), lr, head=0)
    # with a large enough step the float64 subtraction keeps all digits
    assert r.discrepancy <= (TOL if lr is None or lr >= 30 else 1e-6)
    assert r.lhs[0] > 0  # the norm never decreases


@pytest.mark.parametrize("alpha", [0.5, 2.0, 8.0])
def test_step_angle_falls_as_inverse_alpha_squared(alpha):
    r = ids.qk_norm_step_angle(_layer(), _x(6, (6, 32)), alpha, lr=0.3, head=2)
    assert r.holds(TOL)


def test_invariance_breaks_with_eps_or_without_qk_norm():
    # direct check that the hypotheses matter: with eps > 0 the output moves
    x = _x(7, (6, 32))
    for attn in (_layer(norm_eps=1e-1), _layer(qk_norm=False)):
        p = attn.head_dim
        scaled = eqx.tree_at(
            lambda a: a.W_q.weight, attn, attn.W_q.weight.at[:p].multiply(3.0)
        )
        assert float(jnp.max(jnp.abs(scaled(x) - attn(x)))) > 1e-4


def test_hypotheses_are_enforced():
    x = _x(8, (4, 32))
    with pytest.raises(ValueError, match="needs QK-norm with eps = 0"):
        ids.qk_norm_weight_orthogonality(_layer(norm_eps=1e-6), x)
    with pytest.raises(ValueError, match="needs QK-norm with eps = 0"):
        ids.qk_norm_weight_orthogonality(_layer(qk_norm=False), x)
    with pytest.raises(ValueError, match="W_q has a bias"):
        ids.qk_norm_weight_orthogonality(_layer(bias=True), x)
    with pytest.raises(ValueError, match="projection must be one of"):
        ids.qk_norm_weight_orthogonality(_layer(), x, projection="W_v")
    with pytest.raises(ValueError, match=r"head must be in \[0, 4\), got head=4"):
        ids.qk_norm_weight_orthogonality(_layer(), x, head=4)
