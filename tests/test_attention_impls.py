"""Attention implementations and the key/value cache, against the reference path."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab._validate import ConfigError
from blocklab.nn import attention_impls as impls_mod
from blocklab.nn.kv_cache import AttentionCache
from blocklab.nn.mask import Mask

# (num_hiddens, num_heads, options) drawn to cover the options together.
CACHE_CONFIGS = {
    "gqa_rope_window_qk": (16, 4, dict(num_kv_heads=2, rope_theta=100.0, window=3,
                                       qk_norm="head")),
    "mqa_full_qk_scale": (12, 3, dict(num_kv_heads=1, head_dim=6, rope_theta=1e4,
                                      qk_norm="full", attn_scale=0.3)),
    "mha_global": (8, 2, dict()),
}  # fmt: skip


def _mha(d, H, opts, seed=0):
    return bl.MultiHeadAttention(d, H, key=jax.random.key(seed), **opts)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n == "mqa_full_qk_scale" else n
        for n in sorted(CACHE_CONFIGS)
    ],
)
def test_cached_steps_equal_uncached_causal_attention(name):
    d, H, opts = CACHE_CONFIGS[name]
    mha = _mha(d, H, opts)
    T, P = 9, 4  # prefill 4 tokens, then decode 5 one at a time
    x = jax.random.normal(jax.random.key(1), (2, T, d))
    full = mha(x, jnp.arange(1, T + 1))  # uncached, causal
    cache = mha.init_cache((2,), max_len=12)
    assert isinstance(cache, AttentionCache)
    assert cache.k.shape == (2, mha.num_kv_heads, mha.head_dim, 12)  # keys transposed
    assert cache.v.shape == (2, mha.num_kv_heads, 12, mha.head_dim)
    step = eqx.filter_jit(lambda m, x, c, s: m.step(x, c, s))
    out, cache = step(mha, x[:, :P], cache, 0)
    outs = [out]
    for t in range(P, T):
        out, cache = step(mha, x[:, t : t + 1], cache, jnp.int32(t))
        outs.append(out)
    cached = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)
    # the cache holds the keys of every position written
    assert not np.allclose(cache.k[..., T - 1], 0)
    np.testing.assert_array_equal(cache.k[..., T:], 0)
    assert not np.allclose(cache.v[:, :, T - 1], 0)
    np.testing.assert_array_equal(cache.v[:, :, T:], 0)


@pytest.mark.slow  # 46 s; tests/test_generation.py covers ragged prompts by default
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


def test_single_sequence_and_bad_input(plain_python):
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


# --- implementations ------------------------------------------------------------

IMPLS = ("chunked", "fused")


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 so that T <= 16 runs the chunked kernel over several blocks."""
    monkeypatch.setattr(impls_mod, "BLOCK_SIZE", 4)


def _draw(seed):
    """A random attention configuration and call (a cheap hypothesis-style draw)."""
    rng = np.random.default_rng(seed)
    H = int(rng.choice([1, 2, 4]))
    KV = int(rng.choice([k for k in (1, 2, 4) if H % k == 0]))
    p = int(rng.choice([2, 4, 6]))
    d = int(rng.choice([8, 12]))
    T = int(rng.integers(5, 15))
    opts = dict(num_kv_heads=KV, head_dim=p)
    if rng.random() < 0.5:
        opts["attn_scale"] = float(rng.uniform(0.2, 1.0))
    if rng.random() < 0.6:
        opts["rope_theta"] = float(rng.choice([100.0, 1e4]))
    if rng.random() < 0.5:
        opts["window"] = int(rng.integers(1, T))
    opts["qk_norm"] = [False, "head", "full"][int(rng.integers(3))]
    batch = () if rng.random() < 0.3 else (2,)
    lens_kind = ["none", "causal", "ragged"][int(rng.integers(3))]
    lens = {
        "none": None,
        "causal": np.arange(1, T + 1),
        "ragged": rng.integers(0, T + 1, (*batch, T)),
    }[lens_kind]
    seg = None
    if rng.random() < 0.5:
        seg = np.sort(rng.integers(0, 3, (*batch, T)), axis=-1)
    pos = None
    if "rope_theta" in opts and rng.random() < 0.5:
        pos = rng.integers(0, 50, (*batch, T))
    softcap = float(rng.uniform(0.5, 3.0)) if rng.random() < 0.5 else None
    return d, H, opts, T, batch, lens, seg, pos, softcap


def _max_rel(a, b):
    scale = max(float(jnp.max(jnp.abs(a))), 1e-30)
    return float(jnp.max(jnp.abs(a - b))) / scale


def _compare(seed, dtype, tol, impls=IMPLS):
    d, H, opts, T, batch, lens, seg, pos, softcap = _draw(seed)
    mha = bl.MultiHeadAttention(
        d, H, attn_softcap=softcap, key=jax.random.key(seed), **opts
    )
    mha = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, mha)
    x = jax.random.normal(jax.random.key(seed + 100), (*batch, T, d), dtype)
    ct = jax.random.normal(jax.random.key(seed + 200), (*batch, T, d), dtype)

    def loss(m, x, impl):
        mask = Mask.lengths(lens) if lens is not None else Mask()
        if seg is not None:
            mask = mask & Mask.segments(seg)
        out = m(x, mask, positions=pos, impl=impl)
        return jnp.sum(out * ct), out

    @eqx.filter_jit
    def grads(mx, impl):
        return eqx.filter_grad(lambda mx: loss(*mx, impl), has_aux=True)(mx)

    ref_grads, ref_out = grads((mha, x), "reference")
    for impl in impls:
        if impl == "fused" and softcap is not None:
            with pytest.raises(ConfigError, match="softcap.*fused"):
                mha(x, lens, impl="fused")
            continue
        got, out = grads((mha, x), impl)
        assert _max_rel(ref_out, out) <= tol, (impl, seed)
        for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(got), strict=True):
            assert _max_rel(a, b) <= tol, (impl, seed)


@pytest.mark.parametrize(
    "seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3))]
)
def test_impls_equal_the_reference_on_random_configs_float32(seed, small_blocks):
    _compare(seed, jnp.float32, 2e-6 * 4)  # 2e-6 x scale, x 4 for rounding of sums


@pytest.mark.float64
@pytest.mark.parametrize("seed", [6])
def test_chunked_equals_the_reference_float64(seed, small_blocks):
    # "fused" computes its softmax in float32 (jax's kernel), so float64 checks
    # only the chunked kernel at 1e-12
    _compare(seed, jnp.float64, 1e-12, impls=("chunked",))


@pytest.mark.float64
def test_switching_to_chunked_changes_no_diagnostic(small_blocks):
    from blocklab.diagnostics import identities

    cfg = bl.BlockConfig(16, 4, num_kv_heads=2, rope_theta=1e4)
    key = jax.random.key(0)
    stack = bl.Stack(lambda k: bl.TransformerBlock(cfg, key=k), 2, key=key)
    chunked = bl.with_attention_impl(stack, "chunked")
    # same weights (the very arrays), every layer and config switched
    for a, b in zip(jax.tree.leaves(stack), jax.tree.leaves(chunked), strict=True):
        assert a is b
    assert chunked.blocks.attention.attention_impl == "chunked"
    assert chunked.blocks.cfg.attention_impl == "chunked"
    X = jax.random.normal(jax.random.key(1), (2, 9, 16))
    # the switch is real: the forward pass runs the chunked kernel (rounding differs)
    causal = jnp.arange(1, 10)
    assert not np.array_equal(stack(X, causal), chunked(X, causal))
    # signal_stats and the block traces: identical (reference path)
    s0, s1 = bl.signal_stats(stack, X), bl.signal_stats(chunked, X)
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1), strict=True):
        np.testing.assert_array_equal(a, b)
    t0, t1 = stack.block(0).trace(X), chunked.block(0).trace(X)
    for a, b in zip(jax.tree.leaves(t0), jax.tree.leaves(t1), strict=True):
        np.testing.assert_array_equal(a, b)
    # an identity: the same numbers both ways
    i0 = identities.pre_ln_stream_sum(stack, X[0])
    i1 = identities.pre_ln_stream_sum(chunked, X[0])
    np.testing.assert_array_equal(i0.lhs, i1.lhs)
    assert i0.discrepancy == i1.discrepancy


def test_bad_impl_lists_the_choices(plain_python):
    choices = "auto.*reference.*fused.*chunked"
    with pytest.raises(ConfigError, match=f"attention_impl.*{choices}.*flash"):
        bl.MultiHeadAttention(8, 2, attention_impl="flash", key=jax.random.key(0))
    with pytest.raises(ConfigError, match=f"attention_impl.*{choices}"):
        bl.BlockConfig(8, 2, attention_impl="fast")
    with pytest.raises(ConfigError, match=f"attention_impl.*{choices}"):
        bl.DecoderConfig(vocab_size=5, num_hiddens=8, num_heads=2, num_blks=1,
                         attention_impl="cudnn")  # fmt: skip
    mha = bl.MultiHeadAttention(
        8, 2, dropout=0.1, attn_softcap=2.0, key=jax.random.key(0)
    )
    with pytest.raises(ConfigError, match=f"with_attention_impl.*{choices}"):
        bl.with_attention_impl(mha, "xla")
    x = jnp.ones((4, 8))
    with pytest.raises(ConfigError, match=f"attention_impl.*{choices}"):
        mha(x, impl="Chunked")
    with pytest.raises(ConfigError, match="dropout.*'chunked'"):
        mha(x, impl="chunked", key=jax.random.key(1))
    with pytest.raises(ConfigError, match="softcap.*'fused'"):
        mha(x, impl="fused")
    with pytest.raises(ConfigError, match="segment_ids.*shape"):
        mha(x, Mask.segments(jnp.zeros(3, jnp.int32)))
    with pytest.raises(ConfigError, match="segment_ids.*integer"):
        mha(x, Mask.segments(jnp.zeros(4)))
    # "auto" with dropout on takes the reference path (the only one with dropout)
    assert mha(x, key=jax.random.key(1)).shape == x.shape


def test_auto_rule_and_non_finite_guard(small_blocks):
    from blocklab.nn.attention_impls import resolve_impl

    kw = dict(dtype=jnp.float32, softcap=None)
    if jax.devices()[0].platform == "cpu":
        assert resolve_impl("auto", num_keys=512, dropout_on=False, **kw) == "reference"
        assert resolve_impl("auto", num_keys=4096, dropout_on=False, **kw) == "chunked"
    assert resolve_impl("auto", num_keys=4096, dropout_on=True, **kw) == "reference"
    assert resolve_impl("fused", num_keys=8, dropout_on=False, **kw) == "fused"
    # a NaN in a padding row never leaks, in every implementation
    mha = bl.MultiHeadAttention(8, 2, num_kv_heads=1, rope_theta=1e4,
                                key=jax.random.key(0))  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2, 9, 8)).at[0, 7].set(jnp.nan)
    lens = jnp.array([[7], [9]])
    ref = mha(x, lens, impl="reference")
    for impl in IMPLS:
        out = mha(x, lens, impl=impl)
        np.testing.assert_array_equal(jnp.isnan(out), jnp.isnan(ref))
        assert not jnp.any(jnp.isnan(out[0, :7])) and jnp.all(jnp.isnan(out[1]) == 0)
        np.testing.assert_allclose(out[0, :7], ref[0, :7], atol=2e-6)
        g = jax.grad(lambda x, impl=impl: jnp.sum(mha(x, lens, impl=impl)[0, :7]))(x)
        assert jnp.all(jnp.isfinite(g[0, :7])) and jnp.all(g[0, 7:] == 0)


@pytest.mark.slow  # 22 s; the cached and chunked paths each have default tests
def test_chunked_prefill_in_a_cache_equals_the_reference(small_blocks):
    mha = bl.MultiHeadAttention(8, 4, num_kv_heads=2, rope_theta=1e4, window=3,
                                attn_softcap=2.0, key=jax.random.key(0))  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2, 11, 8))
    cache = mha.init_cache((2,), 16)
    ref, c_ref = mha.step(x, cache, 0, impl="reference")
    out, c_out = mha.step(x, cache, 0, impl="chunked")
    np.testing.assert_allclose(out, ref, atol=2e-6)
    np.testing.assert_array_equal(c_out.k, c_ref.k)
    np.testing.assert_allclose(ref, mha(x, jnp.arange(1, 12)), atol=2e-6)


@pytest.mark.parametrize(
    "model", [3, jnp.ones(3), bl.FeedForward(8, key=jax.random.key(0))]
)
def test_with_attention_impl_refuses_a_model_without_attention(model):
    """`with_attention_impl(3, "chunked")` returned 3: a model with no attention
    layer to switch is a mistake, named."""
    with pytest.raises(ConfigError, match=r"with_attention_impl: model holds no"):
        bl.with_attention_impl(model, "chunked")


@pytest.mark.parametrize("impl", ["fused", "chunked"])
def test_kernel_step_with_several_new_tokens_after_a_prefix(impl):
    """The cached step of the kernels with Tq = 4 new tokens at start = 5: the
    one case where the mask's alignment (top-left or bottom-right) changes the
    answer. Against the reference step and the uncached causal attention, with
    RoPE, GQA and a window shorter than the new tokens' reach."""
    cap = None if impl == "fused" else 2.0  # fused has no soft-capping
    mha = bl.MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=1e4, window=3,
                                attn_softcap=cap, key=jax.random.key(0))  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2, 9, 16))
    cache = mha.init_cache((2,), 12)
    _, cache = mha.step(x[:, :5], cache, 0, impl="reference")
    ref, c_ref = mha.step(x[:, 5:], cache, 5, impl="reference")
    out, c_out = mha.step(x[:, 5:], cache, 5, impl=impl)
    np.testing.assert_allclose(out, ref, atol=3e-6)
    np.testing.assert_array_equal(c_out.v, c_ref.v)
    whole = mha(x, jnp.arange(1, 10), impl="reference")
    np.testing.assert_allclose(ref, whole[:, 5:], atol=3e-6)


@pytest.mark.parametrize("impl", ["fused", "chunked"])
def test_kernels_take_windows_rope_and_explicit_positions(impl):
    """Windows, RoPE and explicit (shifted, per-sequence) positions in the
    kernels against the reference path, in the default run."""
    mha = bl.MultiHeadAttention(16, 4, num_kv_heads=1, rope_theta=500.0, window=4,
                                key=jax.random.key(2))  # fmt: skip
    x = jax.random.normal(jax.random.key(3), (2, 10, 16))
    pos = jnp.stack([jnp.arange(10) + 37, jnp.arange(10) * 3])
    lens = jnp.arange(1, 11)
    ref = mha(x, lens, positions=pos, impl="reference")
    got = mha(x, lens, positions=pos, impl=impl)
    np.testing.assert_allclose(got, ref, atol=3e-6)
    shifted = mha(x, lens, impl="reference")
    assert np.abs(np.asarray(shifted - ref)).max() > 1e-3  # positions matter
