"""Bad input raises ValueError naming the argument, the value and the valid choices."""

import re

import jax
import jax.numpy as jnp
import jaxtyping
import pytest

import blocklab as bl
from blocklab.nn import init as init
from blocklab.nn.normalization import make_norm

KEY = jax.random.key(0)
ACTS = re.escape(str(list(bl.nn.ffn.ACTS)))


@pytest.fixture
def plain_python(monkeypatch):
    """Switch off the suite's run-time shape checker, as in a user's program.

    With it on, a wrong rank or a wrong `valid_lens` shape is already caught
    by the jaxtyping annotation (a TypeCheckError naming the parameter);
    users normally run without it and get blocklab's own ValueError.
    """
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"norm": "batch"},
            r"norm must be one of \['gemma_rms', 'layer', 'rms'\], got norm='batch'",
        ),
        ({"act": "swish"}, rf"act must be one of {ACTS}, got act='swish'"),
        (
            {"placement": "middle"},
            r"placement must be one of \['post', 'pre', 'output', 'sandwich'\], "
            r"got placement='middle'",
        ),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got dropout=1.0"),
        ({"dropout": -0.1}, r"dropout must be in \[0, 1\), got dropout=-0.1"),
    ],
)
def test_block_rejects_bad_options(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        bl.TransformerBlock(16, 4, key=KEY, **kwargs)


def test_option_strings_are_case_sensitive_never_a_silent_default():
    with pytest.raises(ValueError, match="got norm='RMS'"):
        bl.TransformerBlock(16, 4, norm="RMS", key=KEY)
    with pytest.raises(ValueError, match="got act='SwiGLU'"):
        bl.TransformerBlock(16, 4, act="SwiGLU", key=KEY)


@pytest.mark.parametrize("cls", [bl.TransformerBlock, bl.MultiHeadAttention])
def test_heads_must_divide_width(cls):
    with pytest.raises(
        ValueError,
        match=r"num_hiddens must be divisible by num_heads, got num_hiddens=10, "
        r"num_heads=4; choose num_heads among the divisors of 10",
    ):
        cls(10, 4, key=KEY)


@pytest.mark.parametrize("cls", [bl.TransformerBlock, bl.MultiHeadAttention])
@pytest.mark.parametrize(
    ("name", "args"), [("num_hiddens", (0, 1)), ("num_heads", (8, 0))]
)
def test_sizes_must_be_positive_ints(cls, name, args):
    with pytest.raises(ValueError, match=rf"{name} must be a positive int, got 0"):
        cls(*args, key=KEY)


def test_ffn_rejects_bad_act_and_widths():
    with pytest.raises(
        ValueError, match=rf"FeedForward: act must be one of {ACTS}, got act='tanh'"
    ):
        bl.FeedForward(8, "tanh", key=KEY)
    with pytest.raises(
        ValueError, match=rf"ffn_width: act must be one of {ACTS}, got act='elu'"
    ):
        bl.nn.ffn.ffn_width(8, "elu")
    with pytest.raises(
        ValueError,
        match=r"give ffn_width or multiple_of, not both \(got ffn_width=8, "
        r"multiple_of=4\)",
    ):
        bl.FeedForward(8, ffn_width=8, multiple_of=4, key=KEY)
    with pytest.raises(ValueError, match=r"ffn_width must lie in \[1, inf\], got 0"):
        bl.FeedForward(8, ffn_width=0, key=KEY)
    with pytest.raises(ValueError, match=r"multiple_of must be a positive int, got -1"):
        bl.nn.ffn.ffn_width(8, "gelu", -1)


def test_make_norm_rejects_unknown_norm():
    with pytest.raises(
        ValueError,
        match=r"norm must be one of \['gemma_rms', 'layer', 'rms'\], got norm='l2'",
    ):
        make_norm("l2", 8)


@pytest.mark.parametrize(
    ("module", "owner"),
    [
        (bl.TransformerBlock(16, 4, key=KEY), "TransformerBlock"),
        (bl.MultiHeadAttention(16, 4, key=KEY), "MultiHeadAttention"),
    ],
)
def test_wrong_input_width_or_rank(module, owner, plain_python):
    pattern = (
        rf"{owner} acts on a sequence x of shape \(T, num_hiddens=16\) \(or a "
        r"batch \(\.\.\., T, num_hiddens\)\), got x.shape="
    )
    with pytest.raises(ValueError, match=pattern + r"\(5, 12\)"):
        module(jnp.ones((5, 12)))
    with pytest.raises(ValueError, match=pattern + r"\(2, 5, 12\)"):
        module(jnp.ones((2, 5, 12)))
    with pytest.raises(ValueError, match=pattern + r"\(16,\)"):
        module(jnp.ones((16,)))


@pytest.mark.parametrize(
    ("module", "owner"),
    [
        (bl.FeedForward(16, key=KEY), "FeedForward"),
        (bl.RMSNorm(16), "RMSNorm"),
        (bl.LayerNorm(16), "LayerNorm"),
    ],
)
def test_wrong_feature_width_of_rowwise_modules(module, owner):
    with pytest.raises(
        ValueError,
        match=rf"{owner} was built with num_hiddens=16, but its input x has "
        r"shape \(5, 12\)",
    ):
        module(jnp.ones((5, 12)))


@pytest.mark.parametrize("lens", [jnp.arange(1, 5), jnp.ones((2, 6), int)])
@pytest.mark.parametrize(
    "module",
    [bl.TransformerBlock(16, 4, key=KEY), bl.MultiHeadAttention(16, 4, key=KEY)],
)
def test_valid_lens_of_the_wrong_shape(module, lens, plain_python):
    with pytest.raises(
        ValueError,
        match=r"valid_lens must be a scalar or have shape \(T,\) = \(6,\) "
        rf"\(one length per query\), got shape {re.escape(str(tuple(lens.shape)))}",
    ):
        module(jnp.ones((6, 16)), lens)


def test_valid_lens_shape_is_checked_under_jit_too(plain_python):
    blk = bl.TransformerBlock(16, 4, key=KEY)
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        jax.jit(lambda x, n: blk(x, n))(jnp.ones((6, 16)), jnp.arange(3))


def test_shape_checker_names_the_parameter_when_on():
    blk = bl.TransformerBlock(16, 4, key=KEY)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'x'"):
        blk(jnp.ones((16,)))
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'valid_lens'"):
        blk(jnp.ones((6, 16)), jnp.arange(4))


def test_norm_sizes_and_init_arguments():
    with pytest.raises(
        ValueError, match=r"RMSNorm: num_hiddens must be a positive int, got 0"
    ):
        bl.RMSNorm(0)
    with pytest.raises(
        ValueError, match=r"init.normal: std must lie in \[0.0, inf\], got -0.02"
    ):
        init.normal(bl.RMSNorm(4), -0.02, key=KEY)
    with pytest.raises(
        ValueError, match=r"Stack: num_blks must be a positive int, got 0"
    ):
        bl.Stack(lambda k: bl.RMSNorm(4), 0, key=KEY)
    for bad in (0, -2):
        with pytest.raises(
            ValueError,
            match=rf"Stack: unroll must be a positive int or a bool, got {bad}",
        ):
            bl.Stack(lambda k: bl.RMSNorm(4), 2, unroll=bad, key=KEY)
