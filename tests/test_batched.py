"""A leading batch axis: each module's batched call equals a loop over sequences.

The batched call flattens the batch into the rows of every projection
(`blocklab.nn.functional.linear`); `jax.vmap` leaves the batch as a separate
axis. Both must give the NumPy float64 reference of each sequence, and the
same gradients (float64 throughout).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import blocklab as bl
from blocklab.nn.functional import linear

# every test compares with a NumPy float64 reference (or a float64 vmap) at 1e-10
pytestmark = pytest.mark.float64

D, H, T, B = 16, 4, 6, 3
CAUSAL = jnp.arange(1, T + 1)


def _float64(module):
    return bl.load_state_dict(module, bl.state_dict(module), dtype=jnp.float64)


def _batch(shape=(B, T, D), seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


# --------------------------------------------------------------------- linear
@pytest.mark.parametrize("lead", [(), (5,), (2, 3), (2, 1, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_numpy_over_any_leading_axes(lead, bias):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(*lead, 7))
    w, b = rng.normal(size=(5, 7)), rng.normal(size=5)
    got = linear(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b) if bias else None)
    expected = np.einsum("...i,oi->...o", x, w) + (b if bias else 0.0)
    assert got.shape == (*lead, 5)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-13)


def test_linear_weight_gradient_is_sum_of_row_outer_products():
    rng = np.random.default_rng(2)
    x, w, g = (
        rng.normal(size=(3, 4, 7)),
        rng.normal(size=(5, 7)),
        rng.normal(size=(3, 4, 5)),
    )
    dw, db = jax.grad(
        lambda w, b: jnp.sum(linear(jnp.asarray(x), w, b) * g), argnums=(0, 1)
    )(jnp.asarray(w), jnp.zeros(5))
    expected = sum(np.outer(g[i, t], x[i, t]) for i in range(3) for t in range(4))
    np.testing.assert_allclose(dw, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, g.sum((0, 1)), rtol=1e-12, atol=1e-12)


def test_linear_keeps_the_wider_dtype():
    x = jnp.ones((2, 3), jnp.bfloat16)
    assert linear(x, jnp.ones((4, 3), jnp.float32)).dtype == jnp.float32
    assert linear(x, jnp.ones((4, 3), jnp.bfloat16)).dtype == jnp.bfloat16


# ------------------------------------------------------ attention and block
def _attention(qk_norm):
    return _float64(
        bl.MultiHeadAttention(D, H, bias=True, qk_norm=qk_norm, key=jax.random.key(1))
    )


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("valid_lens", [None, 4, CAUSAL])
def test_batched_attention_trace_equals_the_reference_per_sequence(qk_norm, valid_lens):
    attn = _attention(qk_norm)
    sd = {f"attention.{k}": np.asarray(v) for k, v in bl.state_dict(attn).items()}
    xs = _batch()
    got = attn.trace(xs, valid_lens)
    lens = None if valid_lens is None else np.asarray(valid_lens)
    for i in range(B):
        out, weights, logits = ref.attention(sd, np.asarray(xs[i]), H, lens)
        np.testing.assert_allclose(got.output[i], out, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got.weights[i], weights, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got.logits[i], logits, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("placement", ref.ALL_PLACEMENTS)
def test_batched_block_equals_the_reference_per_sequence(placement):
    blk = _float64(
        bl.TransformerBlock(
            D, H, placement=placement, act="geglu", bias=True, key=jax.random.key(2)
        )
    )
    sd = {k: np.asarray(v) for k, v in bl.state_dict(blk).items()}
    xs = _batch((2, B, T, D))  # two leading axes
    got = blk(xs, CAUSAL)
    assert got.shape == xs.shape
    for i in range(2):
        for j in range(B):
            expected = ref.block(
                sd,
                np.asarray(xs[i, j]),
                H,
                norm_kind="rms",
                act="geglu",
                placement=placement,
                valid_lens=np.asarray(CAUSAL),
            )
            np.testing.assert_allclose(got[i, j], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_batched_block_gradients_equal_vmapped_ones():
    blk = _float64(
        bl.TransformerBlock(D, H, act="gelu", qk_norm=True, key=jax.random.key(3))
    )
    xs, r = _batch(), _batch(seed=1)

    def grads(batched):
        def loss(m, xs):
            y = m(xs, CAUSAL) if batched else jax.vmap(lambda x: m(x, CAUSAL))(xs)
            return jnp.sum(y * r)

        return eqx.filter_grad(loss)(blk, xs), jax.grad(loss, argnums=1)(blk, xs)

    for a, b in zip(
        jax.tree.leaves(grads(True)), jax.tree.leaves(grads(False)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------ stack and LM
@pytest.mark.slow
def test_batched_stack_equals_vmap_and_unroll_changes_nothing():
    stacks = {
        u: _float64(
            bl.Stack(
                lambda k: bl.TransformerBlock(D, H, key=k),
                5,
                unroll=u,
                key=jax.random.key(4),
            )
        )
        for u in (1, 2, True)  # 2 does not divide 5: a remainder iteration
    }
    xs = _batch()
    expected = jax.vmap(lambda x: stacks[1](x, CAUSAL))(xs)
    for s in stacks.values():
        np.testing.assert_allclose(s(xs, CAUSAL), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_charlm_batched_logits_and_loss_gradients_equal_vmapped_ones():
    model = _float64(bl.CharLM(28, D, H, 2, "swiglu", max_len=T, key=jax.random.key(5)))
    rng = np.random.default_rng(6)
    X = jnp.asarray(rng.integers(0, 28, (B, T)))
    Y = jnp.asarray(rng.integers(0, 28, (B, T)))
    np.testing.assert_allclose(
        model(X), jnp.stack([model(x) for x in X]), rtol=1e-10, atol=1e-12
    )
    # A model written for one sequence goes in as eqx.filter_vmap(model).
    np.testing.assert_allclose(
        bl.lm_loss(eqx.filter_vmap(model), X, Y), bl.lm_loss(model, X, Y), rtol=1e-12
    )
    g_batched = eqx.filter_grad(bl.lm_loss)(model, X, Y)
    g_vmapped = eqx.filter_grad(lambda m: bl.lm_loss(eqx.filter_vmap(m), X, Y))(model)
    for a, b in zip(
        jax.tree.leaves(g_batched), jax.tree.leaves(g_vmapped), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
