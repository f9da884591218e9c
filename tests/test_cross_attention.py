"""Cross-attention: every implementation against a NumPy loop, cached keys and
values, the block's cross branch under every placement, one scan in a stack,
the named sites, the sharding axes, and bad input refused by name."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab._validate import ConfigError
from blocklab.interp.sites import site_shapes
from blocklab.nn import attention_impls as impls_mod
from blocklab.nn.block import TransformerBlock
from blocklab.nn.hooks import Hooks
from blocklab.nn.mask import Mask
from blocklab.nn.stack import Stack
from blocklab.training.placement import logical_axes

IMPLS = ("reference", "fused", "chunked")


def _impls(default):
    return [
        i if i == default else pytest.param(i, marks=pytest.mark.slow) for i in IMPLS
    ]


def numpy_cross(mha, x, c, visible, bias=None):
    """Cross-attention in float64: queries from x (B, Tq, d), keys and values
    from c (B, Tk, d), `visible` (B, Tk) (the same for every query)."""
    W = {
        n: np.asarray(getattr(mha, n).weight, np.float64)
        for n in ("W_q", "W_k", "W_v", "W_o")
    }
    x, c = np.asarray(x, np.float64), np.asarray(c, np.float64)
    B, Tq, _ = x.shape
    H, KV, p = mha.num_heads, mha.num_kv_heads, mha.head_dim
    q = (x @ W["W_q"].T).reshape(B, Tq, H, p)
    k = (c @ W["W_k"].T).reshape(B, -1, KV, p)
    v = (c @ W["W_v"].T).reshape(B, -1, KV, p)
    out = np.zeros((B, Tq, H, p))
    for b in range(B):
        for h in range(H):
            g = h // (H // KV)
            for i in range(Tq):
                s = k[b, :, g] @ q[b, i, h] * mha.scale
                if bias is not None:
                    s = s + np.asarray(bias, np.float64)[h, i]
                s = np.where(visible[b], s, -np.inf)
                w = np.exp(s - s.max())
                out[b, i, h] = (w / w.sum()) @ v[b, :, g]
    return out.reshape(B, Tq, H * p) @ W["W_o"].T


def _case():
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    c = jax.random.normal(jax.random.key(2), (2, 7, 16))
    lens = np.array([4, 7])
    cmask = np.ones((2, 7), bool)
    cmask[1, 2] = False
    bias = 0.5 * jax.random.normal(jax.random.key(3), (4, 5, 7))
    visible = (np.arange(7)[None] < lens[:, None]) & cmask
    return x, c, lens, cmask, bias, visible


@pytest.mark.parametrize("impl", _impls("chunked"))
def test_cross_attention_equals_numpy(impl, monkeypatch):
    monkeypatch.setattr(impls_mod, "BLOCK_SIZE", 4)  # several blocks, padded
    mha = bl.MultiHeadAttention(16, 4, num_kv_heads=2, key=jax.random.key(0))
    x, c, lens, cmask, bias, visible = _case()
    want = numpy_cross(mha, x, c, visible, bias)
    mask = Mask.lengths(lens[:, None]) & Mask.padding(cmask)
    got = mha.cross(x, c, mask, score_bias=bias, impl=impl)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # the cached keys and values give the same numbers
    kv = mha.cross_kv(c)
    again = mha.cross(x, mask=mask, kv=kv, score_bias=bias, impl=impl)
    np.testing.assert_allclose(again, got, atol=1e-6, rtol=1e-6)


def _hand_block(b, x, c, cmask):
    """The block's maths written out from its own sublayers."""

    def cross(y):
        return b.cross_attn.cross(y, c, Mask.padding(cmask))

    subs = [
        (lambda y: b.attention(y), b.norm1, b.out_norm1),
        (cross, b.norm_cross, b.out_norm_cross),
        (lambda y: b.ffn(y), b.norm2, b.out_norm2),
    ]
    for F, N, N_out in subs:
        if b.placement == "post":
            x = N(x + F(x))
        elif b.placement == "pre":
            x = x + F(N(x))
        elif b.placement == "output":
            x = x + N(F(x))
        else:
            x = x + N_out(F(N(x)))
    return x


@pytest.mark.parametrize(
    "placement",
    [
        "pre",
        *(
            pytest.param(p, marks=pytest.mark.slow)
            for p in ("post", "output", "sandwich")
        ),
    ],
)
def test_block_cross_branch_sits_between_attention_and_ffn(placement):
    b = TransformerBlock(
        16, 4, placement=placement, cross_attention=True, key=jax.random.key(0)
    )
    x, c, _, cmask, _, _ = _case()
    want = _hand_block(b, x, c, cmask)
    np.testing.assert_allclose(
        b(x, context=c, cross_mask=Mask.padding(cmask)), want, atol=1e-5
    )
    # no shared weights with the self-attention
    assert not np.allclose(b.cross_attn.W_q.weight, b.attention.W_q.weight)
    assert b.cross_attn.rope_theta is None and b.cross_attn.window is None


@pytest.mark.slow
def test_stack_with_cross_attention_is_one_scan_and_equals_the_blocks():
    stack = Stack(
        lambda k: TransformerBlock(16, 4, cross_attention=True, key=k), 3,
        key=jax.random.key(0),
    )  # fmt: skip
    x, c, lens, _, _, _ = _case()
    causal = jnp.arange(1, 6)
    lens = Mask.lengths(lens[:, None])
    got = stack(x, causal, context=c, cross_mask=lens)
    h = x
    for i in range(3):
        h = stack.block(i)(h, causal, context=c, cross_mask=lens)
    np.testing.assert_allclose(got, h, atol=1e-5)
    jaxpr = jax.make_jaxpr(lambda s: s(x, causal, context=c, cross_mask=lens))(stack)
    assert str(jaxpr).count("scan[") == 1


def test_cross_sites_are_catalogued_and_its_pattern_masks_padding():
    stack = Stack(
        lambda k: TransformerBlock(16, 4, cross_attention=True, key=k), 2,
        key=jax.random.key(0),
    )  # fmt: skip
    x, c, lens, _, _, _ = _case()
    lens = Mask.lengths(lens[:, None])
    shapes = site_shapes(stack, x, context=c, cross_mask=lens)
    for name, shape in {
        "blocks.*.ln_cross.hook_normalized": (2, 2, 5, 16),
        "blocks.*.cross_attn.hook_pattern": (2, 2, 4, 5, 7),
        "blocks.*.cross_attn.hook_k": (2, 2, 7, 4, 4),
        "blocks.*.hook_cross_attn_out": (2, 2, 5, 16),
        "blocks.*.hook_resid_mid_cross": (2, 2, 5, 16),
    }.items():
        assert shapes[name].shape == shape, name
    hooks = Hooks(["blocks.*.cross_attn.hook_pattern"])
    stack(x, context=c, cross_mask=lens, hooks=hooks)
    pattern = np.asarray(hooks.values["blocks.*.cross_attn.hook_pattern"])
    np.testing.assert_allclose(pattern.sum(-1), 1.0, rtol=1e-5)
    assert np.all(pattern[:, 0, ..., 4:] == 0)  # sequence 0 has 4 encoder tokens


def test_sharding_axes_cover_the_cross_branch():
    b = TransformerBlock(16, 4, cross_attention=True, key=jax.random.key(0))
    axes = logical_axes(b)
    assert tuple(axes.cross_attn.W_q.weight) == ("heads", "embed")
    assert tuple(axes.cross_attn.W_o.weight) == ("embed", "heads")
    assert tuple(axes.norm_cross.weight) == ("embed",)


def test_bad_cross_input_is_refused_by_name():
    b = TransformerBlock(16, 4, cross_attention=True, key=jax.random.key(0))
    plain = TransformerBlock(16, 4, key=jax.random.key(0))
    x, c, _, _, _, _ = _case()
    with pytest.raises(ConfigError, match="cross_attention=True.*context"):
        b(x)
    with pytest.raises(ConfigError, match="without cross-attention"):
        plain(x, context=c)
    with pytest.raises(ConfigError, match="context .*num_hiddens=16"):
        b(x, context=c[..., :8])
    with pytest.raises(ConfigError, match="key_mask"):
        b(x, context=c, cross_mask=Mask.padding(np.ones((2, 6), bool)))
    with pytest.raises(ConfigError, match="valid_lens"):
        b(x, context=c, cross_mask=Mask.lengths(np.array([1, 2, 3])))
    with pytest.raises(ConfigError, match="batch shape"):
        b(x, context=c[:1])
    assert eqx.tree_equal(b.cross_attn.cross_kv(c), b.cross_attn.cross_kv(c))
