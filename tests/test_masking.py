"""Masked keys and values contribute nothing: not to the output, not to the gradient,
not even when they hold NaN or inf (issue 13, item 1)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blocklab as bl

T, D, H = 6, 16, 4
RAGGED = np.array([1, 2, 2, 5, 3, 6])  # query i sees keys j < RAGGED[i]


def _visible(lens, window=None):
    """(T, T) visibility: key j visible from query i (the documented rule)."""
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    vis = k < np.broadcast_to(lens, (T,))[:, None]
    if window:
        vis &= (k <= q) & (k > q - window)
    return vis


MODULES = {
    "mha": lambda: bl.MultiHeadAttention(D, H, key=jax.random.key(0)),
    "mha_all": lambda: bl.MultiHeadAttention(
        D,
        H,
        num_kv_heads=2,
        qk_norm="full",
        rope_theta=1e4,
        window=3,
        key=jax.random.key(0),
    ),  # fmt: skip
    "block_pre": lambda: bl.TransformerBlock(
        D, H, qk_norm=True, num_kv_heads=1, rope_theta=100.0, key=jax.random.key(0)
    ),
    "block_post": lambda: bl.TransformerBlock(
        D,
        H,
        norm="layer",
        act="gelu",
        placement="post",
        bias=True,
        key=jax.random.key(0),
    ),  # fmt: skip
    "block_sandwich": lambda: bl.TransformerBlock(
        D,
        H,
        norm="gemma_rms",
        act="geglu",
        placement="sandwich",
        qk_norm=True,
        window=2,
        key=jax.random.key(0),
    ),  # fmt: skip
}


def _window(module):
    att = module.attention if isinstance(module, bl.TransformerBlock) else module
    return None if att.window is None else int(att.window)


def _x(seed=0):
    return jax.random.normal(jax.random.key(seed), (T, D))


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize(
    "lens", [RAGGED, np.arange(1, T + 1)], ids=["ragged", "causal"]
)
def test_gradient_of_a_row_to_positions_it_cannot_see_is_exactly_zero(name, lens):
    module = MODULES[name]()
    vis = _visible(lens, _window(module))
    jac = jax.jacrev(lambda x: module(x, jnp.asarray(lens)))(_x())  # (T, D, T, D)
    for i in range(T):
        if not vis[i].any():
            continue  # a row that sees nothing attends uniformly (chapter)
        reach = np.abs(np.asarray(jac[i])).sum(axis=(0, 2))  # per input position
        for j in range(T):
            if j != i and not vis[i, j]:
                assert reach[j] == 0.0, (i, j)
            elif vis[i, j]:
                assert reach[j] > 0.0, (i, j)  # the check is not vacuous


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_non_finite_masked_positions_leave_other_rows_exact(name, bad):
    module = MODULES[name]()
    lens = jnp.arange(1, T + 1)  # causal: position 4 is a future token for 0..3
    vis = _visible(np.asarray(lens), _window(module))
    j = 4
    x = _x()
    clean = module(x, lens)
    dirty = module(x.at[j, ::3].set(bad), lens)
    for i in range(T):
        if i == j or vis[i, j]:
            assert np.isnan(dirty[i]).any() or np.isinf(dirty[i]).any(), i
        else:
            np.testing.assert_allclose(dirty[i], clean[i], rtol=1e-6, atol=1e-7)
    # The gradient of the rows that cannot see j: equal to the clean one.
    rows = np.flatnonzero(~vis[:, j] & (np.arange(T) != j))

    def loss(x):
        return jnp.sum(module(x, lens)[rows] ** 2)

    g_clean, g_dirty = jax.grad(loss)(x), jax.grad(loss)(x.at[j].set(bad))
    np.testing.assert_array_equal(g_clean[j], 0.0)
    # At those rows: finite and as in the clean run. (Rows whose forward value
    # is NaN, j and those that see it, may get 0 * NaN from a norm's or an
    # activation's backward at their own position; they reach nothing else.)
    assert np.isfinite(g_dirty[rows]).all()
    np.testing.assert_allclose(g_dirty[rows], g_clean[rows], rtol=1e-6, atol=1e-7)


def test_padding_nan_does_not_spread_through_a_stack():
    stack = bl.Stack(
        lambda k: bl.TransformerBlock(D, H, qk_norm=True, key=k),
        3,
        key=jax.random.key(0),
    )
    x = _x().at[4:].set(jnp.nan)  # two padding tokens full of NaN
    y = stack(x, 4)  # every query sees keys 0..3 only
    assert np.isfinite(y[:4]).all()
    np.testing.assert_allclose(y[:4], stack(_x().at[4:].set(7.0), 4)[:4], rtol=1e-6)
    # causal, batched, per-sequence lengths of shape (B, 1)
    xb = jnp.stack([_x(1), _x(2).at[3:].set(jnp.inf)])
    yb = stack(xb, jnp.array([[6], [3]]))
    assert np.isfinite(yb[0]).all() and np.isfinite(yb[1, :3]).all()


def test_visible_nan_propagates():
    mha = MODULES["mha"]()
    x = _x().at[2, 0].set(jnp.nan)
    y = mha(x, jnp.arange(1, T + 1))
    assert np.isfinite(y[:2]).all() and np.isnan(y[2:]).all(axis=-1).all()
    assert np.isnan(mha(x)).all()  # no mask: every row sees position 2


def test_qk_norm_eps_zero_with_an_all_zero_padding_token():
    """The issue's example: eps=0 and a zero token made the whole sequence NaN."""

    def make(key):
        return bl.TransformerBlock(
            D,
            H,
            qk_norm=True,
            attn_factory=lambda key: bl.MultiHeadAttention(
                D, H, qk_norm=True, norm_eps=0.0, bias=False, key=key
            ),
            key=key,
        )

    stack = bl.Stack(make, 2, key=jax.random.key(0))
    x = _x().at[4:].set(0.0)  # zero padding
    y = stack(x, 4)
    assert np.isfinite(y).all()
    params, static = eqx.partition(stack, eqx.is_inexact_array)

    def loss(p):
        return jnp.sum(eqx.combine(p, static)(x, 4)[:4] ** 2)

    grads = jax.grad(loss)(params)
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
    # also when the zero token is itself a query that is kept
    assert np.isfinite(jax.grad(lambda x: jnp.sum(stack(x, 4) ** 2))(x)).all()


@pytest.fixture(scope="module")
def _jitted():
    mha = bl.MultiHeadAttention(8, 2, num_kv_heads=1, window=0, key=jax.random.key(3))

    @eqx.filter_jit
    def run(module, x, lens):
        return module(x, lens)

    return mha, run


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(0, T), min_size=T, max_size=T),
    window=st.integers(0, T),
    bad_rows=st.lists(st.integers(0, T - 1), min_size=1, max_size=3, unique=True),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_random_masks_and_windows_with_non_finite_masked_positions(
    _jitted, lens, window, bad_rows, value
):
    mha, run = _jitted
    mha = eqx.tree_at(lambda m: m.window, mha, jnp.asarray(window, jnp.int32))
    lens = np.asarray(lens)
    vis = _visible(lens, window)
    x = jax.random.normal(jax.random.key(4), (T, 8))
    dirty_x = x.at[np.asarray(bad_rows), 1].set(value)
    clean, dirty = run(mha, x, jnp.asarray(lens)), run(mha, dirty_x, jnp.asarray(lens))
    for i in range(T):
        sees_bad = vis[i, bad_rows].any()
        if i in bad_rows:
            assert np.isnan(dirty[i]).all()  # its own query is not finite
        elif not vis[i].any():
            assert np.isfinite(dirty[i]).all()  # uniform over finite values
        elif sees_bad:
            assert np.isnan(dirty[i]).all()
        else:
            np.testing.assert_allclose(dirty[i], clean[i], rtol=1e-6, atol=1e-7)
