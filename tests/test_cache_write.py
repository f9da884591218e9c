"""Decoding with a deferred cache write (`defer_write`, `write_cache`): the same
outputs as writing first and attending to the whole cache, and the same cache,
for batches with one start per sequence, windows, grouped heads and Tq > 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab.nn.kv_cache import AttentionCache, write_cache


def _layer(window, kv, seed):
    return bl.MultiHeadAttention(
        16, 4, num_kv_heads=kv, rope_theta=1e4, window=window, key=jax.random.key(seed)
    )


def _dirty_cache(att, batch, L, seed):
    """A cache full of random values: entries at or after each sequence's start
    are stale (a ragged prefill's padding) and must stay invisible."""
    c = att.init_cache(batch, L)
    k1, k2 = jax.random.split(jax.random.key(seed))
    return AttentionCache(
        jax.random.normal(k1, c.k.shape), jax.random.normal(k2, c.v.shape)
    )


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("Tq", [1, 3])
def test_deferred_step_equals_write_then_attend(window, kv, Tq):
    att = _layer(window, kv, seed=kv + Tq)
    L, start = 11, jnp.asarray([2, 5, 0])
    cache = _dirty_cache(att, (3,), L, seed=1)
    x = jax.random.normal(jax.random.key(2), (3, Tq, 16))
    out, written = att.step(x, cache, start)
    out2, rows = att.step(x, cache, start, defer_write=True)
    assert rows.k.shape == (3, kv, Tq, 4)
    np.testing.assert_allclose(out2, out, rtol=2e-6, atol=2e-6)
    again = write_cache(cache, rows, start)
    np.testing.assert_array_equal(again.k, written.k)
    np.testing.assert_array_equal(again.v, written.v)


def test_written_rows_land_where_a_numpy_loop_puts_them():
    rng = np.random.default_rng(0)
    N, B, KV, L, Tq, p = 3, 2, 2, 9, 2, 4
    cache = AttentionCache(  # keys stored (..., KV, p, L), values (..., KV, L, p)
        jnp.asarray(rng.normal(size=(N, B, KV, p, L))),
        jnp.asarray(rng.normal(size=(N, B, KV, L, p))),
    )
    rows = AttentionCache(
        *(jnp.asarray(rng.normal(size=(N, B, KV, Tq, p))) for _ in "kv")
    )
    start = np.array([4, 1])

    def numpy_write(cache, rows, start, B):
        k, v = np.array(cache.k), np.array(cache.v)
        for n in range(N):
            for b in range(B):
                s = start[b]
                v[n, b, :, s : s + Tq] = rows.v[n, b]
                k[n, b, :, :, s : s + Tq] = np.swapaxes(rows.k[n, b], -1, -2)
        return k, v

    got = write_cache(cache, rows, jnp.asarray(start), stacked=True)
    want_k, want_v = numpy_write(cache, rows, start, B)
    np.testing.assert_array_equal(got.k, want_k)
    np.testing.assert_array_equal(got.v, want_v)
    # one sequence (a plain slice update) and a scalar start
    one = write_cache(
        AttentionCache(cache.k[:, :1], cache.v[:, :1]),
        AttentionCache(rows.k[:, :1], rows.v[:, :1]),
        3,
        stacked=True,
    )
    want_k, want_v = numpy_write(
        AttentionCache(cache.k[:, :1], cache.v[:, :1]), rows, [3], 1
    )
    np.testing.assert_array_equal(one.k, want_k)
    np.testing.assert_array_equal(one.v, want_v)


def test_stack_decodes_with_the_deferred_write_and_keeps_the_cache():
    """A scanned Stack's one-token step (which defers the write) gives the
    outputs and the stacked cache of the blocks' own write-then-attend steps."""
    stack = bl.Stack(
        lambda k: bl.TransformerBlock(16, 4, num_kv_heads=2, rope_theta=100.0, key=k),
        3,
        key=jax.random.key(0),
    )
    att = stack.block(0).attention
    caches = jax.tree.map(
        lambda *c: jnp.stack(c),
        *[_dirty_cache(att, (2,), 8, seed=s) for s in range(3)],
    )
    start = jnp.asarray([3, 6])
    x = jax.random.normal(jax.random.key(5), (2, 1, 16))
    h, new = stack.step(x, caches, start)
    ref, layers = x, []
    for i in range(3):
        layer_cache = jax.tree.map(lambda c, i=i: c[i], caches)
        ref, written = stack.block(i).step(ref, layer_cache, start)
        layers.append(written)
    np.testing.assert_allclose(h, ref, rtol=2e-6, atol=2e-6)
    want = jax.tree.map(lambda *c: jnp.stack(c), *layers)
    # the rows written are equal up to float32 rounding (scanned vs eager)
    np.testing.assert_allclose(new.k, want.k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new.v, want.v, rtol=1e-6, atol=1e-6)
    untouched = np.ones(new.v.shape[:-1], bool)  # (N, B, KV, L)
    for b, s in enumerate([3, 6]):
        untouched[:, b, :, s] = False
    v_now, v_was = np.asarray(new.v), np.asarray(caches.v)
    np.testing.assert_array_equal(v_now[untouched], v_was[untouched])
    k_now, k_was = np.swapaxes(new.k, -1, -2), np.swapaxes(caches.k, -1, -2)
    np.testing.assert_array_equal(k_now[untouched], k_was[untouched])


def test_flags_must_be_booleans():
    att = _layer(None, 2, seed=0)
    cache = att.init_cache((), 4)
    x = jnp.ones((1, 16))
    with pytest.raises((bl.ConfigError, TypeError), match="defer_write"):
        att.step(x, cache, 0, defer_write="yes")
    rows = AttentionCache(jnp.ones((2, 1, 4)), jnp.ones((2, 1, 4)))
    with pytest.raises((bl.ConfigError, TypeError), match="stacked"):
        write_cache(cache, rows, 0, stacked=1)
