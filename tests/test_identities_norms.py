"""Exercise 1: norm invariances, Jacobians and gradient orthogonality, in float64.

The identities' own right sides are closed forms; here they are also checked
against independent references (NumPy central differences of the NumPy
reference norms), and shown to fail where the identity does not hold.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import layer_norm as np_layer_norm
from reference import rms_norm as np_rms_norm

from blocklab.diagnostics import identities as ids

TOL = 1e-10


def _x(seed, shape, offset=0.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) + offset)


def _central_jacobian(f, x, h=1e-6):
    """NumPy float64 central differences, one column per input coordinate."""
    cols = []
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = h
        cols.append((f(x + e) - f(x - e)) / (2 * h))
    return np.stack(cols, axis=-1)


@given(
    rows=st.sampled_from([1, 3]),
    d=st.sampled_from([2, 7, 96]),
    alpha=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=15, deadline=None)
def test_rms_norm_scale_invariance_over_shapes_and_scales(rows, d, alpha, seed):
    x = _x(seed, (rows, d))
    gain = _x(seed + 1, (d,))
    assert ids.rms_norm_scale_invariance(x, alpha, gain).holds(TOL)


@given(
    d=st.sampled_from([2, 7, 96]),
    shift=st.floats(-1e3, 1e3),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=15, deadline=None)
def test_layer_norm_shift_invariance_over_shapes_and_shifts(d, shift, seed):
    x = _x(seed, (3, d))
    result = ids.layer_norm_shift_invariance(
        x, shift, _x(seed + 1, (d,)), _x(seed + 2, (d,))
    )
    # a shift of 1e3 costs log10(1e3) digits to cancellation in the centring
    assert result.discrepancy <= TOL * max(1.0, abs(shift))


@pytest.mark.float64
def test_invariance_rhs_matches_numpy_reference():
    x = _x(0, (4, 32))
    gain = np.random.default_rng(1).uniform(0.5, 2, 32)
    r = ids.rms_norm_scale_invariance(x, 2.5, jnp.asarray(gain))
    np.testing.assert_allclose(
        r.rhs, np_rms_norm(np.asarray(x), gain, eps=0.0), rtol=1e-13
    )
    s = ids.layer_norm_shift_invariance(x, 1.5)
    np.testing.assert_allclose(
        s.rhs, np_layer_norm(np.asarray(x), eps=0.0), rtol=1e-12, atol=1e-13
    )


def test_a_closed_form_that_ignores_eps_would_fail():
    # the check is sharp: at eps = 0.5 jacfwd differs from the eps = 0 closed form
    x = _x(2, (16,))
    with_eps = ids.rms_norm_jacobian(x, eps=0.5)
    assert with_eps.holds(TOL)
    assert np.max(np.abs(with_eps.lhs - ids.rms_norm_jacobian(x).rhs)) > 1e-2


@pytest.mark.parametrize("eps", [0.0, 1e-3, 1.0])
@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.float64
def test_rms_norm_jacobian_closed_form_against_finite_differences(eps, with_gain):
    x = np.asarray(_x(3, (12,)))
    gain = np.random.default_rng(4).uniform(0.5, 2, 12) if with_gain else None
    r = ids.rms_norm_jacobian(
        jnp.asarray(x), None if gain is None else jnp.asarray(gain), eps
    )
    assert r.holds(TOL)
    fd = _central_jacobian(lambda z: np_rms_norm(z, gain, eps), x)
    np.testing.assert_allclose(r.rhs, fd, atol=1e-8)


@pytest.mark.parametrize("eps", [0.0, 1e-2])
@pytest.mark.float64
def test_layer_norm_jacobian_closed_form_against_finite_differences(eps):
    x = np.asarray(_x(5, (10,), offset=0.7))
    gain = np.random.default_rng(6).uniform(0.5, 2, 10)
    r = ids.layer_norm_jacobian(jnp.asarray(x), jnp.asarray(gain), eps)
    assert r.holds(TOL)
    fd = _central_jacobian(lambda z: np_layer_norm(z, gain, None, eps), x)
    np.testing.assert_allclose(r.rhs, fd, atol=1e-8)


@pytest.mark.float64
def test_rms_norm_jacobian_eps0_is_the_chapter_form():
    # r(x)^-1 (I - x_hat x_hat^T), written directly in NumPy
    x = np.asarray(_x(7, (9,)))
    r = np.sqrt(np.mean(x * x))
    xh = x / np.linalg.norm(x)
    expected = (np.eye(9) - np.outer(xh, xh)) / r
    np.testing.assert_allclose(
        ids.rms_norm_jacobian(jnp.asarray(x)).rhs, expected, atol=1e-14
    )


def _exp_loss(y):
    return jnp.sum(jnp.exp(0.3 * y) * jnp.cos(jnp.arange(y.shape[-1]) * y))


@given(
    d=st.sampled_from([2, 5, 64]),
    seed=st.integers(0, 2**16),
    scale=st.floats(1e-2, 1e2),
)
@settings(max_examples=30, deadline=None)
def test_gradient_orthogonal_to_x_for_any_loss(d, seed, scale):
    x = scale * _x(seed, (d,))
    w = _x(seed + 1, (d,))
    assert ids.rms_norm_gradient_orthogonality(x, weight=w).holds(TOL)
    assert ids.rms_norm_gradient_orthogonality(x, loss=_exp_loss).holds(TOL)


@pytest.mark.parametrize("eps", [0.0, 1.0])
def test_gradient_through_layer_norm_is_orthogonal_to_x_and_ones_only_at_eps0(eps):
    """blocklab's `layer_norm` is scale and shift invariant at eps = 0, so the
    gradient of any loss of it is orthogonal to x and to the all-ones vector;
    with eps = 1 it is no longer scale invariant and the cosine with x is not 0.
    (The cosine with 1 stays 0: the shift invariance does not need eps = 0.)"""
    from blocklab.nn.functional import layer_norm

    with jax.enable_x64(True):
        x = _x(8, (16,), offset=1.0)
        gain = jnp.asarray(np.random.default_rng(10).uniform(0.5, 2, 16))
        g = jax.grad(lambda z: _exp_loss(layer_norm(z, gain, None, eps=eps)))(x)
        g = np.asarray(g, np.float64)
    x = np.asarray(x, np.float64)
    cos_x = np.dot(x, g) / (np.linalg.norm(x) * np.linalg.norm(g))
    cos_1 = np.sum(g) / (np.sqrt(16) * np.linalg.norm(g))
    assert abs(cos_1) < 1e-12
    if eps == 0.0:
        assert abs(cos_x) < 1e-12
    else:
        assert abs(cos_x) > 1e-2


def test_gradient_of_a_loss_of_x_itself_is_not_orthogonal_to_x():
    # the orthogonality is special to scale invariance: a loss of x itself is not
    x = _x(8, (16,), offset=1.0)
    g = jax.grad(lambda z: jnp.sum(jnp.sin(z)))(x)
    cos = float(jnp.vdot(x, g) / (jnp.linalg.norm(x) * jnp.linalg.norm(g)))
    assert abs(cos) > 1e-3


@pytest.mark.float64
def test_float64_whatever_the_global_setting():
    x = np.random.default_rng(9).standard_normal((3, 8))
    with jax.enable_x64(False):
        r = ids.rms_norm_jacobian(x[0])
        s = ids.rms_norm_scale_invariance(x, 3.0)
    assert r.lhs.dtype == np.float64 and r.discrepancy <= TOL
    assert s.discrepancy <= TOL
    assert jax.config.jax_enable_x64  # the float64 marker's setting is restored


def test_scale_must_be_positive():
    with pytest.raises(ValueError, match="alpha must be > 0, got alpha=-1.0"):
        ids.rms_norm_scale_invariance(_x(0, (4,)), -1.0)
