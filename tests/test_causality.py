"""Causality through jax.grad: with causal lengths, no output sees a later input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl

D, H, T = 16, 4, 6
CAUSAL = jnp.arange(1, T + 1)


def _x():
    return jnp.asarray(np.random.default_rng(0).normal(size=(T, D)))


def _dependence(fn, x):
    """dep[t, s] = max |d out[t] / d x[s]| from the full reverse-mode Jacobian."""
    jac = np.asarray(jax.jacrev(fn)(x))  # (T, D, T, D)
    return np.abs(jac).max(axis=(1, 3))


@pytest.mark.parametrize(
    ("placement", "norm"),
    [("post", "layer"), ("pre", "rms"), ("output", "layer"), ("sandwich", "rms")],
)
@pytest.mark.float64  # the weights are cast to float64, as the input is
def test_block_output_has_zero_gradient_wrt_later_inputs(placement, norm):
    blk = bl.TransformerBlock(
        D, H, placement=placement, norm=norm, bias=True, key=jax.random.key(1)
    )
    blk = bl.load_state_dict(blk, bl.state_dict(blk), dtype=jnp.float64)
    assert _x().dtype == jnp.float64
    dep = _dependence(lambda x: blk(x, CAUSAL), _x())
    later = np.triu(np.ones((T, T), bool), 1)
    assert np.all(dep[later] == 0.0)  # exactly zero, not merely small
    assert np.all(dep[~later] > 1e-6)  # every earlier position matters


def test_grad_of_one_position_is_zero_after_it():
    blk = bl.TransformerBlock(
        D, H, placement="pre", qk_norm=True, key=jax.random.key(2)
    )
    x = _x().astype(jnp.float32)
    grad = jax.jit(jax.grad(lambda x, t: blk(x, CAUSAL)[t].sum()))
    for t in (0, 3, T - 1):
        g = np.asarray(grad(x, t))
        assert np.all(g[t + 1 :] == 0.0)
        assert np.abs(g[: t + 1]).min(axis=1).max() > 0  # earlier rows are reached


def test_stack_is_causal_through_every_block():
    stack = bl.Stack(
        lambda k: bl.TransformerBlock(D, H, key=k),
        2,
        key=jax.random.key(3),
    )
    dep = _dependence(lambda x: stack(x, CAUSAL), _x().astype(jnp.float32))
    later = np.triu(np.ones((T, T), bool), 1)
    assert np.all(dep[later] == 0.0) and np.all(dep[~later] > 0)


def test_without_a_mask_every_position_sees_every_input():
    blk = bl.TransformerBlock(D, H, key=jax.random.key(4))
    dep = _dependence(lambda x: blk(x), _x().astype(jnp.float32))
    assert np.all(dep > 0)
