"""Initialization: default LeCun truncated normal and the re-initializers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import blocklab as bl
from blocklab.nn import init

# its standard deviation 0.87962566 so the variance is exactly 1/fan_in.
TRUNC_STD = 0.87962566103423978


def test_default_linear_is_lecun_truncated_normal():
    fan_in, fan_out = 256, 1024
    w = np.asarray(
        init.linear(fan_in, fan_out, bias=True, key=jax.random.key(0)).weight
    )
    assert w.shape == (fan_out, fan_in)
    var = w.var()
    # 262144 draws: the relative standard error of the variance is ~0.2 %.
    assert var == pytest.approx(1 / fan_in, rel=0.02)
    bound = 2 / math.sqrt(fan_in) / TRUNC_STD
    assert np.abs(w).max() <= bound * (1 + 1e-6)
    assert np.abs(w).max() >= 0.99 * bound  # truncated at 2 std, not elsewhere
    assert abs(w.mean()) < 3 * math.sqrt(var / w.size)


def test_default_biases_zero_and_gains_one():
    blk = bl.TransformerBlock(16, 4, norm="layer", bias=True, key=jax.random.key(0))
    for lin in (blk.attention.W_q, blk.attention.W_o, blk.ffn.W_1, blk.ffn.W_2):
        np.testing.assert_array_equal(lin.bias, 0.0)
    np.testing.assert_array_equal(blk.norm1.weight, 1.0)
    np.testing.assert_array_equal(blk.norm2.bias, 0.0)


def _random_block():
    """A block whose biases and gains differ from the defaults."""
    rng = np.random.default_rng(0)
    d = 16
    sd = ref.random_state_dict(rng, d, norm_kind="layer", act="geglu", bias=True)
    blk = bl.TransformerBlock(
        d, 4, norm="layer", act="geglu", bias=True, key=jax.random.key(0)
    )
    return bl.load_state_dict(blk, sd)


def _non_weights(model):
    sd = bl.state_dict(model)
    return {k: v for k, v in sd.items() if not (k.endswith(".weight") and v.ndim == 2)}


@pytest.mark.parametrize(
    "reinit",
    [
        lambda m: init.xavier_uniform(m, key=jax.random.key(1)),
        lambda m: init.normal(m, 0.02, key=jax.random.key(1)),
        lambda m: init.scale(m, 3.0),
    ],
    ids=["xavier", "normal", "scale"],
)
def test_reinit_leaves_biases_and_gains_untouched(reinit):
    blk = _random_block()
    new = reinit(blk)
    before, after = _non_weights(blk), _non_weights(new)
    assert before.keys() == after.keys() and len(before) == 11  # 4 gains, 7 biases
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    changed = [k for k, v in bl.state_dict(new).items() if v.ndim == 2]
    assert len(changed) == 7  # W_q, W_k, W_v, W_o, W_1, W_2, W_g
    for k in changed:
        assert not np.array_equal(bl.state_dict(new)[k], bl.state_dict(blk)[k])


def test_xavier_uniform_bounds_and_variance_use_both_fans():
    ffn = bl.FeedForward(256, "gelu", key=jax.random.key(0))  # W_1: (1024, 256)
    new = init.xavier_uniform(ffn, key=jax.random.key(2))
    for w in (np.asarray(new.W_1.weight), np.asarray(new.W_2.weight)):
        fan_out, fan_in = w.shape
        a = math.sqrt(6 / (fan_in + fan_out))
        assert np.abs(w).max() <= a and np.abs(w).max() >= 0.999 * a
        assert w.var() == pytest.approx(2 / (fan_in + fan_out), rel=0.02)
    assert not np.array_equal(new.W_1.weight[:256, :256], new.W_2.weight[:256, :256])


def test_normal_std():
    ffn = bl.FeedForward(256, "gelu", key=jax.random.key(0))
    new = init.normal(ffn, 0.02, key=jax.random.key(3))
    for w in init.weights(new):
        assert float(jnp.std(w)) == pytest.approx(0.02, rel=0.02)
        assert abs(float(jnp.mean(w))) < 1e-3
    zero = init.normal(ffn, 0.0, key=jax.random.key(3))
    assert all(float(jnp.abs(w).max()) == 0.0 for w in init.weights(zero))


def test_scale_multiplies_every_weight_exactly():
    blk = _random_block()
    new = init.scale(blk, 0.5)  # a power of two: exact in floating point
    for w_old, w_new in zip(init.weights(blk), init.weights(new), strict=True):
        np.testing.assert_array_equal(w_new, 0.5 * w_old)
        assert w_new.dtype == w_old.dtype


def test_reinit_of_a_stack_draws_every_block_independently():
    stack = bl.Stack(
        lambda k: bl.TransformerBlock(16, 4, key=k), 2, key=jax.random.key(0)
    )
    new = init.xavier_uniform(stack, key=jax.random.key(4))
    wq = np.asarray(new.blocks.attention.W_q.weight)
    assert wq.shape == (2, 16, 16)
    a = math.sqrt(6 / 32)
    assert np.abs(wq).max() <= a
    assert wq.var() == pytest.approx(1 / 16, rel=0.15)  # 512 draws
    assert not np.array_equal(wq[0], wq[1])
    np.testing.assert_array_equal(new.blocks.norm1.weight, stack.blocks.norm1.weight)
    scaled = init.scale(stack, 2.0)
    np.testing.assert_array_equal(
        scaled.blocks.ffn.W_2.weight, 2.0 * stack.blocks.ffn.W_2.weight
    )


def test_weights_lists_every_linear_weight():
    blk = bl.TransformerBlock(16, 4, act="swiglu", key=jax.random.key(0))
    shapes = [w.shape for w in init.weights(blk)]
    assert shapes.count((16, 16)) == 4 and len(shapes) == 7
