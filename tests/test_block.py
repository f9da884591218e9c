"""TransformerBlock: 4 placements x 2 norms x 7 acts x bias against NumPy float64."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import blocklab as bl

D, H, T = 16, 4, 6
CONFIGS = list(
    itertools.product(ref.ALL_PLACEMENTS, ("rms", "layer"), ref.ALL_ACTS, (False, True))
)


def _block_and_dict(seed, *, placement, norm, act, bias, qk_norm=False):
    rng = np.random.default_rng(seed)
    sd = ref.random_state_dict(
        rng,
        D,
        norm_kind=norm,
        act=act,
        placement=placement,
        bias=bias,
        dtype=np.float64,
    )
    if qk_norm:
        ref.add_qk_norm(sd, rng, D // H, dtype=np.float64)
    blk = bl.TransformerBlock(
        D,
        H,
        norm=norm,
        act=act,
        placement=placement,
        bias=bias,
        qk_norm=qk_norm,
        key=jax.random.key(seed),
    )
    return bl.load_state_dict(blk, sd, dtype=jnp.float64), sd, rng


def test_there_are_112_configurations():
    assert len(CONFIGS) == 112
    assert bl.PLACEMENTS == ref.ALL_PLACEMENTS


@pytest.mark.parametrize(
    ("placement", "norm", "act", "bias"),
    CONFIGS,
    ids=["-".join(map(str, c)) for c in CONFIGS],
)
def test_block_matches_reference(placement, norm, act, bias):
    blk, sd, rng = _block_and_dict(
        0, placement=placement, norm=norm, act=act, bias=bias
    )
    x = rng.normal(size=(T, D))
    for valid_lens in (np.arange(1, T + 1), 4):  # causal per-query, then scalar
        want = ref.block(
            sd,
            x,
            H,
            norm_kind=norm,
            act=act,
            placement=placement,
            valid_lens=valid_lens,
        )
        got = blk(jnp.asarray(x), jnp.asarray(valid_lens))
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("placement", ref.ALL_PLACEMENTS)
def test_block_with_qk_norm_and_no_mask_matches_reference(placement):
    blk, sd, rng = _block_and_dict(
        1, placement=placement, norm="rms", act="swiglu", bias=False, qk_norm=True
    )
    x = rng.normal(size=(T, D))
    want = ref.block(sd, x, H, norm_kind="rms", act="swiglu", placement=placement)
    np.testing.assert_allclose(blk(jnp.asarray(x)), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("placement", ref.ALL_PLACEMENTS)
def test_trace_branch_outputs_rebuild_the_stream(placement):
    blk, sd, rng = _block_and_dict(
        2, placement=placement, norm="layer", act="gelu", bias=True
    )
    x = rng.normal(size=(T, D))
    tr = blk.trace(jnp.asarray(x), np.arange(1, T + 1))
    attn_out, ffn_out = np.asarray(tr.attn_out), np.asarray(tr.ffn_out)
    if placement == "post":
        mid = ref.norm(sd, "norm1", x + attn_out, "layer")
        want = ref.norm(sd, "norm2", mid + ffn_out, "layer")
    else:
        want = x + attn_out + ffn_out
    np.testing.assert_allclose(tr.output, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(tr.output, blk(jnp.asarray(x), np.arange(1, T + 1)))
    assert tr.attention.weights.shape == (H, T, T)


def test_only_sandwich_has_output_norms_and_post_normalizes_the_stream():
    for placement in ref.ALL_PLACEMENTS:
        blk = bl.TransformerBlock(D, H, placement=placement, key=jax.random.key(0))
        assert (blk.out_norm1 is not None) == (placement == "sandwich")
        assert (blk.out_norm2 is not None) == (placement == "sandwich")
    # Post-norm with unit gains ends on an RMSNorm: every row has RMS 1.
    blk = bl.TransformerBlock(D, H, placement="post", key=jax.random.key(0))
    y = np.asarray(blk(jnp.asarray(np.random.default_rng(3).normal(size=(T, D)) * 10)))
    np.testing.assert_allclose(np.sqrt((y**2).mean(-1)), 1.0, rtol=1e-5)


def test_factories_replace_the_sublayers():
    calls = []

    class Doubler(eqx.Module):
        def __call__(self, x, valid_lens=None, *, key=None):
            calls.append(valid_lens)
            return 2 * x

    def attn_factory(*, key):
        return Doubler()

    def ffn_factory(*, key):
        return bl.FeedForward(D, "relu", width=8, key=key)

    blk = bl.TransformerBlock(
        D,
        H,
        placement="pre",
        attn_factory=attn_factory,
        ffn_factory=ffn_factory,
        key=jax.random.key(0),
    )
    assert blk.ffn.width == 8 and isinstance(blk.attention, Doubler)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(T, D)))
    tr = blk.trace(x, 3)
    assert tr.attention is None and calls == [3]
    stream = x + 2 * blk.norm1(x)
    np.testing.assert_allclose(
        tr.output, stream + blk.ffn(blk.norm2(stream)), rtol=1e-6
    )


def test_dropout_is_off_without_a_key_and_on_with_one():
    blk = bl.TransformerBlock(D, H, dropout=0.3, key=jax.random.key(0))
    ref_blk = bl.TransformerBlock(D, H, key=jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(T, D)), jnp.float32)
    np.testing.assert_array_equal(blk(x), ref_blk(x))
    assert np.abs(np.asarray(blk(x, key=jax.random.key(1)) - blk(x))).max() > 1e-3
