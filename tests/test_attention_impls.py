"""Attention implementations and the key/value cache, against the reference path."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab._validate import ConfigError
from blocklab.nn.attention import AttentionCache

# (num_hiddens, num_heads, options) drawn to cover the options together.
CACHE_CONFIGS = {
    "gqa_rope_window_qk": (16, 4, dict(num_kv_heads=2, rope_theta=100.0, window=3,
                                       qk_norm="head")),
    "mqa_full_qk_scale": (12, 3, dict(num_kv_heads=1, head_dim=6, rope_theta=1e4,
                                      qk_norm="full", scale=0.3)),
    "mha_global": (8, 2, dict()),
}  # fmt: skip


def _mha(d, H, opts, seed=0):
    return bl.MultiHeadAttention(d, H, key=jax.random.key(seed), **opts)


@pytest.mark.parametrize("name", sorted(CACHE_CONFIGS))
def test_cached_steps_equal_uncached_causal_attention(name):
    d, H, opts = CACHE_CONFIGS[name]
    mha = _mha(d, H, opts)
    T, P = 9, 4  # prefill 4 tokens, then decode 5 one at a time
    x = jax.random.normal(jax.random.key(1), (2, T, d))
    full = mha(x, jnp.arange(1, T + 1))  # uncached, causal
    cache = mha.init_cache((2,), max_len=12)
    assert isinstance(cache, AttentionCache)
    assert cache.k.shape == (2, mha.num_kv_heads, 12, mha.head_dim)
    step = eqx.filter_jit(lambda m, x, c, s: m.step(x, c, s))
    out, cache = step(mha, x[:, :P], cache, 0)
    outs = [out]
    for t in range(P, T):
        out, cache = step(mha, x[:, t : t + 1], cache, jnp.int32(t))
        outs.append(out)
    cached = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)
    # the cache holds the keys of every position written
    assert not np.allclose(cache.k[:, :, T - 1], 0)
    np.testing.assert_array_equal(cache.k[:, :, T:], 0)


def test_ragged_prompts_decode_from_their_own_lengths():
    d, H, opts = CACHE_CONFIGS["gqa_rope_window_qk"]
    mha = _mha(d, H, opts, seed=3)
    lengths = np.array([3, 6])
    T = 6
    x = jax.random.normal(jax.random.key(2), (2, T + 2, d))
    cache = mha.init_cache((2,), max_len=10)
    _, cache = mha.step(x[:, :T], cache, 0)  # padded prefill; row 0 pads 3..5
    # row b's next token is x[b, lengths[b]] (row 0 overwrites its padding)
    nxt = jnp.stack([x[0, 3], x[1, 6]])[:, None]
    out, cache = mha.step(nxt, cache, jnp.asarray(lengths))
    for b, n in enumerate(lengths):
        seq = jnp.concatenate([x[b, :n], nxt[b]], axis=0)
        alone = mha(seq, jnp.arange(1, n + 2))[-1]
        np.testing.assert_allclose(out[b, 0], alone, atol=1e-5, rtol=1e-5)


def test_single_sequence_and_bad_input(monkeypatch):
    import jaxtyping  # our own messages, not the annotation hook's

    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    mha = _mha(8, 2, dict(rope_theta=1e4))
    x = jax.random.normal(jax.random.key(0), (5, 8))
    cache = mha.init_cache((), 5)
    out, cache = mha.step(x, cache, 0)
    np.testing.assert_allclose(out, mha(x, jnp.arange(1, 6)), atol=1e-6)
    with pytest.raises(ConfigError, match="max_len"):
        mha.step(x[:1], cache, 5)
    with pytest.raises(ConfigError, match="start"):
        mha.step(x[:1], cache, 1.0)
    with pytest.raises(ConfigError, match="cache.k"):
        mha.step(x[None], cache, 0)
    with pytest.raises(ConfigError, match="max_len"):
        mha.init_cache((1,), 0)
