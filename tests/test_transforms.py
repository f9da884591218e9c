"""jit, vmap and grad agree with eager; vmap over a batch equals a Python loop."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl

D, H, T, B = 16, 4, 6, 3
CAUSAL = jnp.arange(1, T + 1)


def _block(placement="pre", dtype=jnp.float32, **kw):
    blk = bl.TransformerBlock(D, H, placement=placement, key=jax.random.key(0), **kw)
    return bl.load_state_dict(blk, bl.state_dict(blk), dtype=dtype)


def _xs(dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(0).normal(size=(B, T, D)), dtype)


MODULES = {
    "rmsnorm": lambda: bl.RMSNorm(D),
    "layernorm": lambda: bl.LayerNorm(D),
    "attention": lambda: bl.MultiHeadAttention(D, H, bias=True, key=jax.random.key(1)),
    "ffn": lambda: bl.FeedForward(D, "geglu", key=jax.random.key(2)),
    "block-post": lambda: _block("post", norm="layer"),
    "block-sandwich": lambda: _block("sandwich", qk_norm=True),
}


@pytest.mark.parametrize("name", MODULES)
def test_jit_equals_eager(name):
    module = MODULES[name]()
    x = _xs()[0]
    eager = module(x)
    jitted = eqx.filter_jit(lambda m, x: m(x))(module, x)
    assert jitted.dtype == eager.dtype == jnp.float32  # the suite's default
    # float32: jit fuses and orders the sums differently from eager, so the
    # O(1) outputs agree to a few ulp (2^-24 ~ 6e-8), ~1e-6 through a block;
    # 1e-5 leaves a 10x margin and is still far below any real discrepancy
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MODULES)
def test_vmap_over_a_batch_equals_a_python_loop(name):
    module = MODULES[name]()
    xs = _xs()
    batched = jax.vmap(module)(xs)
    looped = jnp.stack([module(x) for x in xs])
    assert batched.dtype == jnp.float32  # float32, equal to the last bit
    np.testing.assert_allclose(batched, looped, rtol=1e-12, atol=1e-12)


def test_vmap_with_per_sequence_valid_lengths_equals_a_loop():
    blk = _block("output")
    xs = _xs()
    lens = jnp.array([1, 3, 5])  # one scalar length per sequence (padding masks)
    batched = jax.vmap(blk)(xs, lens)
    looped = jnp.stack([blk(x, n) for x, n in zip(xs, lens, strict=True)])
    assert batched.dtype == jnp.float32  # float32, equal to the last bit
    np.testing.assert_allclose(batched, looped, rtol=1e-12, atol=1e-12)
    causal = jax.vmap(blk, in_axes=(0, None))(xs, CAUSAL)
    np.testing.assert_allclose(causal[1], blk(xs[1], CAUSAL), rtol=1e-12, atol=1e-12)


def test_vmap_over_seeds_equals_a_loop_over_seeds():
    x = _xs()[0].astype(jnp.float32)

    @eqx.filter_jit
    def build_and_run(k):
        return bl.TransformerBlock(D, H, key=k)(x, CAUSAL)

    keys = jax.random.split(jax.random.key(5), 3)
    batched = jax.vmap(build_and_run)(keys)
    looped = jnp.stack([build_and_run(k) for k in keys])
    np.testing.assert_allclose(batched, looped, rtol=1e-5, atol=1e-5)


# post normalizes the stream; sandwich has both a branch-input and a branch-output
# norm, so the two cover the norm positions of every placement.
@pytest.mark.parametrize("placement", ["post", "sandwich"])
def test_grad_equals_central_finite_difference(placement):
    """Run in a fresh interpreter (float64 there): in a long-lived xdist worker,
    XLA:CPU twice segfaulted compiling the post-norm float64 forward late in
    the suite (never alone, never in 100 compiles in one process), which took
    the whole worker down. The check itself is `_grad_vs_finite_difference`."""
    import subprocess
    import sys

    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    run = subprocess.run(
        [sys.executable, __file__, placement],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.strip().endswith(f"{placement}: ok"), run.stdout[-2000:]


def _grad_vs_finite_difference(placement):
    assert jax.config.jax_enable_x64
    blk = _block(placement, jnp.float64, bias=True)
    x = _xs(jnp.float64)[0]
    r = jnp.asarray(np.random.default_rng(1).normal(size=(T, D)))

    @eqx.filter_jit
    def loss(m, x):
        return jnp.sum(r * m(x, CAUSAL))

    g_model, g_x = eqx.filter_grad(loss)(blk, x), jax.grad(lambda x: loss(blk, x))(x)
    jitted = eqx.filter_jit(eqx.filter_grad(loss))(blk, x)
    np.testing.assert_allclose(
        jitted.attention.W_q.weight,
        g_model.attention.W_q.weight,
        rtol=1e-10,
        atol=1e-12,
    )
    h = 1e-6
    # input direction
    v = jnp.asarray(np.random.default_rng(2).normal(size=(T, D)))
    fd = (loss(blk, x + h * v) - loss(blk, x - h * v)) / (2 * h)
    np.testing.assert_allclose(jnp.vdot(g_x, v), fd, rtol=1e-6, atol=1e-8)
    # a weight direction (W_q) and a bias direction (W_1.bias)
    for where, grad in (
        (lambda m: m.attention.W_q.weight, g_model.attention.W_q.weight),
        (lambda m: m.ffn.W_1.bias, g_model.ffn.W_1.bias),
    ):
        w = where(blk)
        u = jnp.asarray(np.random.default_rng(3).normal(size=w.shape))
        plus = eqx.tree_at(where, blk, w + h * u)
        minus = eqx.tree_at(where, blk, w - h * u)
        fd = (loss(plus, x) - loss(minus, x)) / (2 * h)
        np.testing.assert_allclose(jnp.vdot(grad, u), fd, rtol=1e-6, atol=1e-8)
    print(f"{placement}: ok")


def test_grad_under_vmap_equals_loop_of_grads():
    blk = _block("pre")
    xs = _xs()
    assert blk(xs[0], CAUSAL).dtype == jnp.float32  # the tolerance is float32's

    def loss(x):
        return jnp.sum(jnp.sin(blk(x, CAUSAL)))

    grad = jax.jit(jax.grad(loss))
    batched = jax.vmap(grad)(xs)
    looped = jnp.stack([grad(x) for x in xs])
    # float32, differently batched sums: as in test_jit_equals_eager
    np.testing.assert_allclose(batched, looped, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":  # the finite-difference check, in its own interpreter
    import sys

    _grad_vs_finite_difference(sys.argv[1])
