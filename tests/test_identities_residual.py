"""Exercise 3: the unrolled residual stream, pre-LN and post-LN, in float64.

The Jacobian of the whole stack is also checked against NumPy central
differences, and the post-LN product against the chapter's closed form with
RMSNorm scalings computed in NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab import Stack, TransformerBlock
from blocklab.diagnostics import identities as ids
from blocklab.diagnostics import theory
from blocklab.nn import init

TOL = 1e-10


def _blocks(n, d=16, h=2, seed=0, **kw):
    return [
        TransformerBlock(d, h, key=k, **kw)
        for k in jax.random.split(jax.random.key(seed), n)
    ]


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_pre_ln_stream_is_input_plus_branch_outputs(n, act):
    assert ids.pre_ln_stream_sum(_blocks(n, act=act), _x(n, (4, 16))).holds(TOL)


@pytest.mark.parametrize("n", [1, 2])
def test_pre_ln_jacobian_is_the_expanded_product(n):
    assert ids.pre_ln_jacobian_expansion(_blocks(n, seed=n), _x(10 + n, (3, 16))).holds(
        TOL
    )


@pytest.mark.float64
def test_pre_ln_jacobian_against_central_differences():
    blocks, x = _blocks(2, seed=4), np.asarray(_x(4, (3, 16)))
    r = ids.pre_ln_jacobian_expansion(blocks, jnp.asarray(x))
    blocks64 = jax.tree_util.tree_map(
        lambda a: (
            a.astype(jnp.float64)
            if hasattr(a, "dtype") and a.dtype == jnp.float32
            else a
        ),
        blocks,
    )

    def stack(v):
        h = jnp.asarray(v.reshape(x.shape))
        for b in blocks64:
            h = b(h)
        return np.asarray(h).ravel()

    h, v = 1e-6, x.ravel()
    for col in (0, 17, 47):
        e = np.zeros_like(v)
        e[col] = h
        fd = (stack(v + e) - stack(v - e)) / (2 * h)
        np.testing.assert_allclose(r.rhs[:, col], fd, atol=1e-7)


def test_identity_term_passes_gradient_unchanged():
    # the sum of the non-identity terms is the Jacobian minus I: what the stack
    # adds to a gradient on top of passing it through unchanged
    r = ids.pre_ln_jacobian_expansion(_blocks(2, seed=5), _x(5, (3, 16)))
    branch_part = r.rhs - np.eye(r.rhs.shape[0])
    assert np.linalg.norm(branch_part) > 1e-3
    np.testing.assert_allclose(r.lhs - branch_part, np.eye(48), atol=1e-12)


def test_stack_module_is_accepted():
    stack = Stack(lambda k: TransformerBlock(16, 2, key=k), 2, key=jax.random.key(6))
    assert ids.pre_ln_stream_sum(stack, _x(6, (4, 16))).holds(TOL)


def _post(n, d=32, seed=0):
    return _blocks(n, d=d, h=4, seed=seed, placement="post", act="gelu")


@pytest.mark.parametrize("n", [1, 3, 6])
@pytest.mark.parametrize("token", [0, 5])
def test_post_ln_norm_jacobians_scale_orthogonal_vector(n, token):
    r = ids.post_ln_norm_product(_post(n, seed=n), _x(n, (8, 32)), token=token)
    assert r.holds(TOL)
    # and the scaling is the chapter's prod_j r(u_j)^-1 (not 1): the vector shrinks
    assert np.linalg.norm(r.lhs) < 1.0


def test_post_ln_factors_closed_form_is_product_over_c():
    f = ids.post_ln_norm_factors(_post(3), _x(0, (8, 32)))
    for t in range(8):
        expected = theory.post_ln_identity_factor(f["c"][:, t])
        assert f["closed_form"][t] == pytest.approx(expected, rel=1e-12)


def test_post_ln_factor_matches_c_closed_form_on_average():
    # at d = 128 the cross terms 2<x, F>/d are small next to the c_j
    keys = jax.random.split(jax.random.key(7), 5)
    blocks = [
        TransformerBlock(128, 4, placement="post", act="gelu", key=k) for k in keys[:4]
    ]
    blocks = init.xavier_uniform(blocks, key=keys[4])
    f = ids.post_ln_norm_factors(blocks, _x(7, (64, 128)))
    diff = np.log(f["measured"]) - np.log(f["closed_form"])
    # for one weight draw each of the 2N cross terms keeps a mean of order 1/d
    assert abs(diff.mean()) <= 8 / 128
    assert diff.std() > 1e-3  # token by token they differ: it is not an identity


def test_placement_and_size_are_enforced():
    x = _x(0, (4, 16))
    with pytest.raises(ValueError, match="placement='pre'"):
        ids.pre_ln_stream_sum(_blocks(1, placement="post"), x)
    with pytest.raises(ValueError, match="at most 5 blocks"):
        ids.pre_ln_jacobian_expansion(_blocks(6), x)
    with pytest.raises(ValueError, match="norm='rms'"):
        ids.post_ln_norm_product(_blocks(1, placement="post", norm="layer"), x)
    with pytest.raises(ValueError, match="need d > 2N"):
        ids.post_ln_norm_product(_blocks(8, d=16, placement="post"), x)
