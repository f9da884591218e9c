"""Every identity checker reports a false claim as not holding.

The identities are theorems, so no input makes them false; what can be wrong
is the library code one side runs. Each test below breaks that code the way
a bug would (a norm that is no longer scale invariant, a LayerNorm that does
not centre, a QK norm that normalizes nothing, a branch that reads the wrong
norm) and checks that the checker notices: `holds()` is False and the
discrepancy is far above the tolerance. `Identity`'s own discrepancy is
checked against hand-worked values.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab import MultiHeadAttention, TransformerBlock
from blocklab.diagnostics import identities as ids
from blocklab.nn import functional as F

FALSE = 1e-4  # every broken claim below misses by far more than this


@pytest.fixture
def broken(monkeypatch):
    """`broken(name, fn)` replaces `identities.<name>`; compiled copies of the
    checkers are dropped before and after, so the replacement is traced."""

    def patch(name, fn):
        jax.clear_caches()
        monkeypatch.setattr(ids, name, fn)

    yield patch
    monkeypatch.undo()
    jax.clear_caches()


def _x(seed, shape, offset=0.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) + offset)


def assert_false(identity):
    assert not identity.holds()
    assert identity.discrepancy > FALSE
    assert np.max(np.abs(identity.lhs - identity.rhs)) > 0


# -------------------------------------------------------------- Identity
def test_discrepancy_is_relative_to_the_right_side():
    r = ids._identity("claim", [1.0, 2.5, -3.0], [1.0, 2.0, -4.0])
    assert r.discrepancy == pytest.approx(1.0 / 4.0, rel=1e-15)  # max|diff| / max|rhs|
    assert not r.holds() and r.holds(0.25) and not r.holds(0.2499)


def test_discrepancy_is_absolute_when_the_right_side_is_zero():
    r = ids._identity("cosine = 0", [3e-3], [0.0])
    assert r.discrepancy == pytest.approx(3e-3, rel=1e-15)
    assert not r.holds() and r.holds(3e-3)
    assert ids._identity("exact", [0.5, 2.0], [0.5, 2.0]).discrepancy == 0.0


# ------------------------------------------------------------- norms (ex. 1)
def _rms_with_eps(x, weight=None, eps=0.0):
    return F.rms_norm(x, weight, eps=1.0)  # eps forced to 1: not scale invariant


def test_scale_invariance_of_a_norm_with_eps(broken):
    broken("rms_norm", _rms_with_eps)
    assert_false(ids.rms_norm_scale_invariance(_x(0, (2, 11)), 3.0))


def test_shift_invariance_of_a_norm_that_does_not_centre(broken):
    broken("layer_norm", lambda x, w=None, b=None, eps=0.0: F.rms_norm(x, w, eps=eps))
    assert_false(ids.layer_norm_shift_invariance(_x(1, (2, 11)), 0.7))


def test_rms_jacobian_of_a_different_function(broken):
    broken("rms_norm", _rms_with_eps)
    assert_false(ids.rms_norm_jacobian(_x(2, (11,))))


def test_layer_norm_jacobian_of_a_different_function(broken):
    broken("layer_norm", lambda x, w=None, b=None, eps=0.0: F.rms_norm(x, w, eps=eps))
    assert_false(ids.layer_norm_jacobian(_x(3, (11,), offset=0.5)))


def test_gradient_orthogonality_without_scale_invariance(broken):
    broken("rms_norm", _rms_with_eps)
    assert_false(ids.rms_norm_gradient_orthogonality(_x(4, (11,))))


# ----------------------------------------------------- QK-norm weights (ex. 2)
class _Gain(eqx.Module):
    """Claims eps = 0 like a QK RMSNorm, but only multiplies by a gain: the
    logits then scale with W, and nothing about them is scale invariant."""

    weight: jax.Array
    eps: float = eqx.field(static=True, default=0.0)

    def __call__(self, x):
        return x * self.weight


def _unnormalized_qk_layer():
    attn = MultiHeadAttention(16, 2, qk_norm=True, norm_eps=0.0, key=jax.random.key(0))
    return eqx.tree_at(
        lambda a: (a.q_norm, a.k_norm),
        attn,
        (
            _Gain(jnp.ones_like(attn.q_norm.weight)),
            _Gain(jnp.ones_like(attn.k_norm.weight)),
        ),
    )


@pytest.mark.parametrize(
    "check",
    [
        lambda a, x: ids.qk_norm_scale_invariance(a, x, 3.0),
        lambda a, x: ids.qk_norm_weight_orthogonality(a, x, projection="W_k"),
        lambda a, x: ids.qk_norm_gradient_scaling(a, x, 3.0),
        lambda a, x: ids.qk_norm_step_growth(a, x, 0.5),
        lambda a, x: ids.qk_norm_step_angle(a, x, 3.0),
    ],
    ids=[
        "scale_invariance",
        "orthogonality",
        "gradient_scaling",
        "step_growth",
        "step_angle",
    ],
)
def test_qk_identities_without_normalization(check):
    assert_false(check(_unnormalized_qk_layer(), 2.0 * _x(5, (5, 16))))


# --------------------------------------------- unrolled residual stream (ex. 3)
def _wrong_branches(blks):
    """The attention branch reads norm2 instead of norm1 (a wrong expansion)."""
    out = []
    for b in blks:
        out.append(lambda h, b=b: b.attention(b.norm2(h)))
        out.append(lambda h, b=b: b.ffn(b.norm2(h)))
    return out


def _pre_blocks(n=2):
    keys = jax.random.split(jax.random.key(1), n)
    blks = [TransformerBlock(8, 2, act="gelu", key=k) for k in keys]
    # distinct norm gains, so that reading the wrong norm matters
    return [
        eqx.tree_at(lambda b: b.norm2.weight, b, 0.5 + jnp.arange(8.0) / 8)
        for b in blks
    ]


def test_pre_ln_stream_sum_of_a_wrong_expansion(broken):
    broken("_pre_branches", _wrong_branches)
    assert_false(ids.pre_ln_stream_sum(_pre_blocks(), _x(6, (3, 8))))


def test_pre_ln_jacobian_expansion_of_a_wrong_expansion(broken):
    broken("_pre_branches", _wrong_branches)
    assert_false(ids.pre_ln_jacobian_expansion(_pre_blocks(1), _x(7, (2, 8))))


def test_post_ln_norm_product_with_norms_that_are_not_rms(broken):
    broken("rms_norm", _rms_with_eps)  # the norm Jacobians of an eps = 1 norm
    blks = [
        TransformerBlock(8, 2, placement="post", act="relu", key=k)
        for k in jax.random.split(jax.random.key(2), 2)
    ]
    assert_false(ids.post_ln_norm_product(blks, _x(8, (3, 8))))
