"""TransformerBlock: 4 placements x 2 norms x 7 acts x bias against NumPy float64."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
import reference as ref
from ref_blocks import block_and_dict

import blocklab as bl

D, H, T = 16, 4, 6
# geglu_exact differs from geglu only in the FFN's phi (tests/test_ffn.py)
BLOCK_ACTS = tuple(a for a in ref.ALL_ACTS if a != "geglu_exact")
CONFIGS = list(
    itertools.product(ref.ALL_PLACEMENTS, ("rms", "layer"), BLOCK_ACTS, (False, True))
)


def _block_and_dict(seed, **structure):
    return block_and_dict(seed, D, H, **structure)


def test_there_are_112_configurations():
    assert len(CONFIGS) == 112
    assert bl.nn.block.PLACEMENTS == ref.ALL_PLACEMENTS


@pytest.mark.parametrize(
    ("placement", "norm", "act", "bias"),
    CONFIGS,
    ids=["-".join(map(str, c)) for c in CONFIGS],
)
@pytest.mark.float64
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
@pytest.mark.float64
def test_block_with_qk_norm_and_no_mask_matches_reference(placement):
    blk, sd, rng = _block_and_dict(
        1, placement=placement, norm="rms", act="swiglu", bias=False, qk_norm=True
    )
    x = rng.normal(size=(T, D))
    want = ref.block(sd, x, H, norm_kind="rms", act="swiglu", placement=placement)
    np.testing.assert_allclose(blk(jnp.asarray(x)), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("placement", ref.ALL_PLACEMENTS)
@pytest.mark.float64
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
        return bl.FeedForward(D, "relu", ffn_width=8, key=key)

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


# ------------------------------------------------- validation (issue 13, 4-6)
KEY = jax.random.key(0)


BUILDERS = {
    "block": lambda **kw: bl.TransformerBlock(16, 4, key=KEY, **kw),
    "attention": lambda **kw: bl.MultiHeadAttention(16, 4, key=KEY, **kw),
    "ffn": lambda **kw: bl.FeedForward(16, key=KEY, **kw),
}


@pytest.mark.parametrize(
    ("builder", "kwargs", "pattern"),
    [
        ("block", {"bias": "no"}, r"bias must be a bool \(True or False\), got 'no'"),
        ("attention", {"bias": 1}, r"bias must be a bool"),
        ("ffn", {"bias": "no"}, r"FeedForward: bias must be a bool"),
        ("block", {"attn_bias": "yes"}, r"attn_bias must be a bool"),
        ("block", {"qk_norm": "false"}, r"qk_norm must be one of \[False, True, "),
        ("attention", {"qk_norm": 1}, r"qk_norm must be one of"),
        ("attention", {"norm": "gemma"}, r"norm must be one of"),
        ("attention", {"num_kv_heads": True}, r"num_kv_heads must be an int"),
        ("attention", {"num_kv_heads": 3}, r"num_kv_heads must divide num_heads"),
        ("attention", {"head_dim": 2.0}, r"head_dim must be an int"),
        ("attention", {"attn_scale": 0.0}, r"attn_scale must lie in \(0.0, inf\]"),
        ("attention", {"rope_theta": float("nan")}, r"rope_theta must be finite"),
        ("attention", {"rope_theta": 1e4, "head_dim": 3}, r"RoPE needs an even"),
        ("attention", {"window": -1}, r"window must lie in \[0, inf\]"),
        ("attention", {"norm_eps": -1e-6}, r"norm_eps must lie in \[0.0, inf\]"),
        ("block", {"norm_eps": float("nan")}, r"eps must be finite"),
        ("block", {"dropout": float("nan")}, r"dropout must be finite"),
        ("block", {"dropout": "0.1"}, r"dropout must be a real number"),
        ("ffn", {"ffn_width": 8.5}, r"ffn_width must be an int"),
    ],
)
def test_options_of_the_wrong_type_or_value_are_refused(
    builder, kwargs, pattern, plain_python
):
    with pytest.raises(ValueError, match=pattern):
        BUILDERS[builder](**kwargs)


@pytest.mark.parametrize("cls", [bl.TransformerBlock, bl.MultiHeadAttention])
def test_counts_must_not_be_bools(cls, plain_python):
    with pytest.raises(ValueError, match=r"num_heads must be an int, got True"):
        cls(16, True, key=KEY)
    with pytest.raises(ValueError, match=r"num_hiddens must be an int, got False"):
        cls(False, 4, key=KEY)


def test_numpy_scalars_are_accepted_as_python_numbers(plain_python):
    blk = bl.TransformerBlock(
        np.int64(16),
        np.int32(4),
        dropout=np.float32(0.25),
        norm_eps=np.float64(1e-5),
        num_kv_heads=np.int64(2),
        rope_theta=np.float32(1e4),
        window=np.int16(3),
        bias=np.bool_(True),
        key=KEY,
    )
    assert type(blk.num_hiddens) is int and type(blk.dropout) is float
    assert blk.dropout == 0.25 and blk.attention.num_kv_heads == 2
    assert type(blk.norm1.eps) is float and blk.norm1.eps == 1e-5
    y = jax.jit(lambda b, x: b(x))(blk, jnp.ones((T, 16)))  # static fields hash
    assert y.shape == (T, 16)
    assert bl.RMSNorm(np.int64(4), np.float32(0.0)).eps == 0.0


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), "1e-6", True])
@pytest.mark.parametrize("cls", [bl.RMSNorm, bl.LayerNorm])
def test_norm_eps_must_be_finite_and_non_negative(cls, eps, plain_python):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: eps must"):
        cls(8, eps)


@pytest.mark.parametrize("builder", list(BUILDERS))
@pytest.mark.parametrize("key", [None, 0, np.uint32(3)], ids=["none", "int", "npint"])
def test_a_missing_or_non_key_is_refused_clearly(builder, key, plain_python):
    fn = {"block": bl.TransformerBlock, "attention": bl.MultiHeadAttention}.get(builder)
    with pytest.raises(ValueError, match=r"key .*jax\.random\.key\(0\)"):
        if fn is None:
            bl.FeedForward(16, key=key)
        else:
            fn(16, 4, key=key)


@pytest.mark.parametrize(
    "module",
    [
        BUILDERS["block"](),
        BUILDERS["attention"](),
        BUILDERS["ffn"](),
        bl.RMSNorm(16),
        bl.LayerNorm(16),
    ],
    ids=["block", "attention", "ffn", "rms", "layer"],
)
def test_integer_inputs_are_refused_not_truncated(module, plain_python):
    with pytest.raises(ValueError, match=r"must have a floating dtype, got int32"):
        module(jnp.ones((T, 16), jnp.int32))


@pytest.mark.parametrize(
    ("lens", "pattern"),
    [
        (jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), r"integer dtype, got dtype float"),
        (jnp.ones(T, bool), r"integer dtype, got dtype bool"),
        (True, r"must be integers, got the bool True"),
        (jnp.array([1, 2, -1, 4, 5, 6]), r"non-negative, got \[1, 2, -1, 4, 5, 6\]"),
        (jnp.array(-2), r"non-negative, got -2"),
        (jnp.arange(3), r"got shape \(3,\).*\(B, 1\) for one length per sequence"),
    ],
)
@pytest.mark.parametrize("builder", ["block", "attention"])
def test_bad_valid_lens_are_refused(builder, lens, pattern, plain_python):
    with pytest.raises(ValueError, match=pattern):
        BUILDERS[builder]()(jnp.ones((T, 16)), lens)


def test_shape_checker_names_the_parameter_when_on():
    blk = bl.TransformerBlock(16, 4, key=KEY)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'x'"):
        blk(jnp.ones((16,)))
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'mask'"):
        blk(jnp.ones((6, 16)), jnp.arange(4))


def test_per_sequence_lengths_are_unambiguous():
    """A batch of B = T sequences: (B, 1) is per sequence, (1, T) per query,
    and a 1-D (T,) array, which could be either, is refused (issue 23)."""
    blk = bl.TransformerBlock(16, 4, key=KEY)
    xs = jax.random.normal(jax.random.key(1), (T, T, 16))
    per_seq = jnp.arange(1, T + 1)[:, None]
    want = jnp.stack([blk(xs[b], b + 1) for b in range(T)])
    np.testing.assert_allclose(blk(xs, per_seq), want, rtol=1e-5, atol=1e-6)
    per_query = jnp.arange(1, T + 1)
    want = jnp.stack([blk(xs[b], per_query) for b in range(T)])
    np.testing.assert_allclose(blk(xs, per_query[None]), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(bl.ConfigError, match=r"ambiguous.*\(1, 6\).*\(6, 1\)"):
        blk(xs, per_query)


@pytest.mark.parametrize(
    ("placement", "act", "size"),
    [
        ("post", "gelu", 2.5e4),
        ("output", "gelu", 2e4),
        ("output", "swiglu", 1e4),
        ("output", "geglu", 2e4),
    ],
)
def test_float16_stream_near_its_range_stays_finite(placement, act, size):
    """fp16's max is 65504. At |x| ~ 2.5e4 the post residual sum x + branch
    reaches ~7e4: it is computed in float32 before the norm now (in float16 it
    was inf, then NaN). The norms' statistics (x^2 ~ 4e9) are float32 too.
    With "output" placement the raw stream feeds the branch, and a gated FFN
    grows as |x|^2 (~1e8 at |x| ~ 1e4): the branch and its norm run in
    float32 (in float16 the output was inf for |x| beyond ~1e2)."""
    blk = bl.TransformerBlock(
        16, 4, norm="layer", act=act, placement=placement, key=KEY
    )
    # |z| <= 2 keeps the float16 input itself finite (2 * 2.5e4 < 65504) whatever
    # the float precision the sample is drawn in
    z = jax.random.truncated_normal(jax.random.key(2), -2.0, 2.0, (T, 16))
    x = (size * z).astype(jnp.float16)
    causal = jnp.arange(1, T + 1)
    got = blk(x, causal)
    assert got.dtype == jnp.float16 and np.isfinite(got).all()
    want = blk(x.astype(jnp.float32), causal)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2 * scale)
    if placement == "post":  # the sum really leaves float16's range here
        branch = blk.trace(x, causal).attn_out.astype(jnp.float32)
        assert np.abs(x.astype(jnp.float32) + branch).max() > 65504
    if act != "gelu":  # the gated FFN's own output leaves float16's range
        x32 = x.astype(jnp.float32)
        _, acts = bl.capture(blk, x32, "hook_resid_mid", mask=causal)
        assert np.abs(blk.ffn(acts["hook_resid_mid"])).max() > 65504
    for norm in (bl.RMSNorm(16), bl.LayerNorm(16)):
        assert np.isfinite(norm((6e4 * jnp.sign(x)).astype(jnp.float16))).all()
