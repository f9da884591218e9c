"""Errors come from blocklab and name the argument, the value and the fix.

Block, attention, FFN and norm options, widths and input shapes; checkpoints,
porting, `CharLM`, `Stack`, `generate_text` and the `init` functions. Every
assertion is on the message text. The run-time shape checker of the test suite
is switched off here (`plain_python`), as in a user's program: otherwise a
wrong type or shape would be caught first by the jaxtyping/beartype annotation
check (tests/test_block.py checks that it names the parameter when on).
"""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blocklab as bl
from blocklab import (
    CharLM,
    GenerationConfig,
    Stack,
    generate_text,
    load,
    load_state_dict,
    save,
)
from blocklab._validate import ConfigError
from blocklab.data import VOCAB
from blocklab.nn import init
from blocklab.nn.normalization import make_norm

pytestmark = pytest.mark.usefixtures("plain_python")

KEY = jax.random.key(0)
FIX = re.escape("pass key=jax.random.key(0)")
ACTS = re.escape(str(list(bl.nn.ffn.ACTS)))


@pytest.fixture(scope="module")
def lm():
    return CharLM(28, 16, 2, 1, max_len=8, key=KEY)


# ---------------------------------------- block, attention, FFN and norm options
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
def test_wrong_input_width_or_rank(module, owner):
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
def test_valid_lens_of_the_wrong_shape(module, lens):
    with pytest.raises(
        ValueError,
        match=r"valid_lens must be a scalar or have shape \(T,\) = \(6,\) "
        rf"\(one length per query\), got shape {re.escape(str(tuple(lens.shape)))}",
    ):
        module(jnp.ones((6, 16)), lens)


def test_valid_lens_shape_is_checked_under_jit_too():
    blk = bl.TransformerBlock(16, 4, key=KEY)
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        jax.jit(lambda x, n: blk(x, n))(jnp.ones((6, 16)), jnp.arange(3))


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


# ----------------------------------------------------------------- PRNG keys
def _key_calls():
    rms = bl.RMSNorm(4)
    return {
        "CharLM": lambda key: CharLM(28, 16, 2, 1, max_len=8, key=key),
        "Stack": lambda key: Stack(lambda k: bl.RMSNorm(4), 2, key=key),
        "init.linear": lambda key: init.linear(4, 3, bias=False, key=key),
        "init.xavier_uniform": lambda key: init.xavier_uniform(rms, key=key),
        "init.normal": lambda key: init.normal(rms, 0.02, key=key),
    }


@pytest.mark.parametrize("owner", list(_key_calls()))
def test_missing_key(owner):
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(owner)}: key is required; {FIX}"
    ):
        _key_calls()[owner](None)


@pytest.mark.parametrize("owner", list(_key_calls()))
@pytest.mark.parametrize("bad", [0, 7.5, np.int64(3), "0"])
def test_an_int_or_other_value_where_a_key_belongs(owner, bad):
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(owner)}: key must be a JAX PRNG key, got "
        rf"{re.escape(repr(bad))} of type {type(bad).__name__}; {FIX}",
    ):
        _key_calls()[owner](bad)


def test_a_float_array_where_a_key_belongs():
    with pytest.raises(
        ConfigError,
        match=r"CharLM: key must be a JAX PRNG key, got an array of dtype float32 "
        rf"and shape \(2,\); {FIX}",
    ):
        CharLM(28, 16, 2, 1, max_len=8, key=jnp.zeros(2, jnp.float32))


def test_legacy_uint32_keys_are_accepted():
    s = Stack(lambda k: bl.RMSNorm(4), 2, key=jax.random.PRNGKey(0))
    assert s.blocks.weight.shape == (2, 4)
    lin = init.linear(4, 3, bias=False, key=jax.random.PRNGKey(0))
    assert lin.weight.shape == (3, 4)


# ------------------------------------------------- CharLM / Stack arguments
COUNTS = ["vocab_size", "num_hiddens", "num_heads", "num_blks", "max_len"]
GOOD = dict(vocab_size=28, num_hiddens=16, num_heads=2, num_blks=1, max_len=8)


def _not_an_int():
    return st.one_of(
        st.booleans(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=3),
        st.none(),
        st.lists(st.integers(1, 4), max_size=2),
        st.sampled_from([np.bool_(True), np.float32(2.0), np.float64(4.0)]),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(COUNTS), value=_not_an_int())
def test_charlm_counts_must_be_ints(name, value):
    """A bool, float, string, None or list where a count belongs names itself."""
    with pytest.raises(
        ConfigError,
        match=rf"^CharLM: {name} must be an int, got .* of type {type(value).__name__}",
    ):
        CharLM(**{**GOOD, name: value}, key=KEY)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(COUNTS), value=st.integers(-5, 0))
def test_charlm_counts_must_be_positive(name, value):
    with pytest.raises(
        ConfigError, match=rf"^CharLM: {name} must lie in \[1, inf\], got {value}\."
    ):
        CharLM(**{**GOOD, name: value}, key=KEY)


@settings(max_examples=25, deadline=None)
@given(
    value=st.one_of(
        st.integers(), st.floats(), st.text(max_size=3), st.none(), st.just("no")
    )
)
def test_remat_must_be_a_bool(value):
    pattern = (
        rf"must be a bool \(True or False\), got {re.escape(repr(value))} "
        rf"of type {type(value).__name__}"
    )
    with pytest.raises(ConfigError, match=rf"^CharLM: remat {pattern}"):
        CharLM(**GOOD, remat=value, key=KEY)
    with pytest.raises(ConfigError, match=rf"^Stack: remat {pattern}"):
        Stack(lambda k: bl.RMSNorm(4), 2, remat=value, key=KEY)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", np.float64(2.0)])
def test_unroll_must_be_a_positive_int_or_a_bool(value):
    with pytest.raises(
        ConfigError, match=r"Stack: unroll must be a positive int or a bool, got "
    ):
        Stack(lambda k: bl.RMSNorm(4), 2, unroll=value, key=KEY)
    with pytest.raises(ConfigError, match=r"^CharLM: unroll must "):
        CharLM(**GOOD, unroll=value, key=KEY)


@pytest.mark.parametrize("value", [True, 2.0, "2", np.float32(2)])
def test_stack_depth_must_be_an_int(value):
    with pytest.raises(
        ConfigError,
        match=rf"^Stack: num_blks must be a positive int, got {re.escape(repr(value))}",
    ):
        Stack(lambda k: bl.RMSNorm(4), value, key=KEY)


def test_numpy_scalar_options_are_plain_numbers(tmp_path):
    """NumPy scalars for sizes and block options become Python numbers (the
    config a Python-number model has), run under jit with dropout (they used
    to be traced: a tracer error), and are stored as plain JSON numbers."""
    lm = CharLM(
        np.int64(28),
        np.int32(16),
        np.int16(2),
        np.int8(1),
        max_len=np.int64(8),
        remat=np.bool_(False),
        unroll=np.int64(1),
        dropout=np.float32(0.25),
        bias=np.bool_(True),
        key=KEY,
    )
    assert lm.init_args() == dict(
        GOOD, act="swiglu", remat=False, unroll=1, bias=True, dropout=0.25
    )
    assert all(type(v) in (int, float, bool, str) for v in lm.init_args().values())
    out = eqx.filter_jit(lambda m, t, k: m(t, key=k))(
        lm, jnp.array([3, 4, 5]), jax.random.key(1)
    )
    assert out.shape == (3, 28) and bool(jnp.all(jnp.isfinite(out)))
    path = save(tmp_path / "np.ckpt", lm)
    header = json.loads(path.read_bytes().split(b"\n")[2])
    assert header["config"]["dropout"] == 0.25 and header["config"]["bias"] is True


def test_stack_accepts_numpy_depth_and_flags():
    s = Stack(lambda k: bl.RMSNorm(4), np.int64(3), remat=np.bool_(True), key=KEY)
    assert s.num_blks == 3 and type(s.num_blks) is int and s.remat is True


# -------------------------------------------------------------- token ids
def test_float_token_ids_are_refused_not_truncated(lm):
    with pytest.raises(
        ValueError,
        match=r"CharLM: tokens must be integer token ids, got dtype float(32|64); "
        r"encode text with blocklab.data.encode",
    ):
        lm(jnp.array([1.0, 2.7]))
    with pytest.raises(ValueError, match=r"got dtype bool"):
        lm(jnp.array([True, False]))


@pytest.mark.parametrize("jit", [jax.jit, eqx.filter_jit])
def test_out_of_range_ids_under_jit_carry_blocklab_text(lm, jit):
    fn = jit(lambda t: lm(t))
    with pytest.raises(
        (eqx.EquinoxRuntimeError, jax.errors.JaxRuntimeError),
        match=r"CharLM: token ids must lie in \[0, vocab_size=28\), got 99 \(the "
        r"largest id of the batch",
    ):
        jax.block_until_ready(fn(jnp.array([1, 99])))


def test_out_of_range_ids_eagerly_name_position_and_value(lm):
    with pytest.raises(
        ValueError,
        match=r"CharLM: token ids must lie in \[0, vocab_size=28\), got "
        r"tokens\[2\]=31; the model was built for 28 symbols",
    ):
        lm(jnp.array([0, 1, 31]))


# ----------------------------------------------------------- generate_text
def test_generate_text_needs_ids_in_the_model_vocabulary():
    # the structure alone (no weights drawn): generate_text refuses it up front
    small = eqx.filter_eval_shape(CharLM, 10, 8, 2, 1, max_len=4, key=KEY)
    with pytest.raises(
        ConfigError,
        match=r"generate_text: tokenizer.encode\(prompts\) gave token id 21 at "
        r"index 0, outside the model's vocabulary \[0, vocab_size=10\); use the "
        r"tokenizer the model was trained with",
    ):
        generate_text(small, VOCAB, "the", 3, key=KEY)
    with pytest.raises(
        ConfigError, match=r"generate_text: model must be a DecoderLM or a CharLM"
    ):
        generate_text(bl.RMSNorm(4), VOCAB, "the", 3, key=KEY)


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (0.0, r"temperature must lie in \(0.0, inf\], got 0.0"),
        (-1, r"temperature must lie in \(0.0, inf\], got -1.0"),
        (float("inf"), r"temperature must be finite, got inf"),
        (float("nan"), r"temperature must be finite, got nan"),
        ("1", r"temperature must be a real number, got '1' of type str"),
        (True, r"temperature must be a real number, got True of type bool"),
    ],
)
def test_generate_text_temperature(lm, value, pattern):
    with pytest.raises(ConfigError, match=rf"^GenerationConfig: {pattern}"):
        GenerationConfig(temperature=value)


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (-1, r"max_new_tokens must lie in \[0, inf\], got -1"),
        (2.5, r"max_new_tokens must be an int, got 2.5 of type float"),
        (True, r"max_new_tokens must be an int, got True of type bool"),
    ],
)
def test_generate_text_max_new_tokens(lm, value, pattern):
    with pytest.raises(ConfigError, match=rf"^generate_text: {pattern}"):
        generate_text(lm, VOCAB, "the", value, key=KEY)


def test_generate_text_key_and_prompt(lm):
    with pytest.raises(
        ConfigError, match=r"^generate_text: key must be a JAX PRNG key, got 5"
    ):
        generate_text(lm, VOCAB, "the", 3, key=5)
    with pytest.raises(
        ConfigError,
        match=r"^generate_text: prompts must be a non-empty str or a non-empty "
        r"list of str, got b'the' of type bytes",
    ):
        generate_text(lm, VOCAB, b"the", 3, key=KEY)


def test_generate_text_numpy_arguments_are_fine(lm):
    warm = GenerationConfig(temperature=np.float32(0.5))
    a = generate_text(lm, VOCAB, "the", np.int64(4), key=KEY, config=warm)
    half = GenerationConfig(temperature=0.5)
    assert a == generate_text(lm, VOCAB, "the", 4, key=KEY, config=half)


# ------------------------------------------------------------ init functions
@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda m: init.normal(m, float("nan"), key=KEY),
            r"init.normal: std must be finite, got nan",
        ),
        (
            lambda m: init.normal(m, -1.0, key=KEY),
            r"init.normal: std must lie in \[0.0, inf\], got -1.0",
        ),
        (
            lambda m: init.normal(m, "0.02", key=KEY),
            r"init.normal: std must be a real number, got '0.02'",
        ),
        (
            lambda m: init.scale(m, float("inf")),
            r"init.scale: alpha must be finite, got inf",
        ),
        (
            lambda m: init.scale(m, None),
            r"init.scale: alpha must be a real number, got None",
        ),
        (
            lambda m: init.linear(4, 3, bias="no", key=KEY),
            r"init.linear: bias must be a bool \(True or False\), got 'no'",
        ),
        (
            lambda m: init.linear(True, 3, bias=False, key=KEY),
            r"init.linear: in_features must be an int, got True",
        ),
        (
            lambda m: init.linear(4, 0, bias=False, key=KEY),
            r"init.linear: out_features must lie in \[1, inf\], got 0",
        ),
    ],
)
def test_init_arguments(call, pattern):
    with pytest.raises(ConfigError, match=pattern):
        call(bl.RMSNorm(4))


def test_init_accepts_numpy_scalars():
    lin = init.linear(np.int64(4), np.int32(3), bias=np.bool_(True), key=KEY)
    scaled = init.scale(lin, np.float32(2.0))
    np.testing.assert_array_equal(scaled.weight, 2.0 * lin.weight)


# -------------------------------------------------------------- checkpoints
def test_load_on_a_directory(tmp_path):
    with pytest.raises(
        ValueError,
        match=rf"load: {re.escape(str(tmp_path))} is a directory; pass the "
        r"checkpoint file written by blocklab.save",
    ):
        load(tmp_path)


def test_flipped_bit_names_the_checksum(lm, tmp_path):
    path = save(tmp_path / "lm.ckpt", lm)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x10
    path.write_bytes(bytes(blob))
    with pytest.raises(
        ValueError,
        match=r"is corrupted: its SHA-256 checksum does not match \(stored [0-9a-f]{16}"
        r"\.\.\., computed [0-9a-f]{16}\.\.\.\)\. The file was changed or damaged",
    ):
        load(path)


# ------------------------------------------------------------------ porting
@pytest.fixture(scope="module")
def norm_sd():
    return {"weight": np.ones(4, np.float32)}


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (
            np.array([1, np.nan, 1, 1], np.float32),
            r"holds 1 non-finite value\(s\) \(first: .*nan.* at index \[1\]\); "
            "refusing",
        ),
        (
            np.array([1, 1, 1, -np.inf]),
            r"holds 1 non-finite value\(s\) \(first: .*inf.* at index \[3\]\)",
        ),
        (
            np.ones(4, np.int64),
            r"holds an array of dtype int64; parameters must be real floating point",
        ),
        (
            np.ones(4, np.complex64),
            r"holds an array of dtype complex64; .*refused, not cast",
        ),
        (np.ones(4, bool), r"holds an array of dtype bool;"),
        (
            np.full(4, 1e300),
            r"overflows float32 \(its largest magnitude is .*1e\+300.*\); "
            "pass a wider dtype=",
        ),
    ],
)
def test_load_state_dict_refuses_nonsense_weights(value, pattern):
    with pytest.raises(ValueError, match=rf"load_state_dict: key 'weight' {pattern}"):
        load_state_dict(bl.RMSNorm(4), {"weight": value})


def test_load_state_dict_names_the_stacked_key():
    stack = Stack(lambda k: bl.RMSNorm(4), 2, key=KEY)
    sd = {"blocks.0.weight": np.ones(4), "blocks.1.weight": np.array([1, 1, np.nan, 1])}
    with pytest.raises(ValueError, match=r"key 'blocks.1.weight' holds 1 non-finite"):
        load_state_dict(stack, sd)


def test_load_state_dict_dtype_must_be_floating(norm_sd):
    with pytest.raises(
        ConfigError, match=r"load_state_dict: dtype must be a floating-point dtype"
    ):
        load_state_dict(bl.RMSNorm(4), norm_sd, dtype=jnp.int32)
    out = load_state_dict(bl.RMSNorm(4), norm_sd, dtype=jnp.bfloat16)
    assert out.weight.dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", [None, 3, "", b"lm.ckpt"])
def test_checkpoint_path_must_be_a_file_name(lm, bad):
    for owner, call in (("save", lambda: save(bad, lm)), ("load", lambda: load(bad))):
        with pytest.raises(
            ConfigError,
            match=rf"^{owner}: path must be a file name \(a non-empty str or "
            rf"os.PathLike\), got {re.escape(repr(bad))} of type {type(bad).__name__}",
        ):
            call()


def test_charlm_call_key_must_be_a_key_or_none(lm):
    with pytest.raises(
        ConfigError,
        match=rf"^CharLM: key must be a JAX PRNG key, got 1 of type int; {FIX}",
    ):
        lm(jnp.array([1, 2]), key=1)


# ----------------------------------- the obscure errors of the first round
def test_old_obscure_errors_name_the_argument_and_the_fix():
    import inspect

    block = bl.TransformerBlock(16, 2, dropout=0.1, key=jax.random.key(0))
    call = inspect.unwrap(type(block).__call__)  # past the suite's type hook
    with pytest.raises(
        ConfigError, match="TransformerBlock: key must be a JAX PRNG key, got 0"
    ):
        call(block, jnp.ones((4, 16)), key=0)
    with pytest.raises(ConfigError, match=r"must be an array, got a list.*jnp.asarray"):
        call(block, [[1.0] * 16] * 4)
    with pytest.raises(ConfigError, match=r"census: .*got dict.*count_params"):
        bl.census({"w": jnp.ones(3)})
    with pytest.raises(ConfigError, match=r"train_batch: batch_size must lie in \[1"):
        bl.TokenDataset(np.arange(40) % 28, 8).train_batch(jax.random.key(0), -1)
    from blocklab.training.member_axis import key_data

    with pytest.raises(
        ConfigError, match=r"train_sweep: model_keys must be int seeds .*float"
    ):
        key = np.array([0.5, 1.0])
        inspect.unwrap(key_data)(key, "model_keys", _owner="train_sweep")


@pytest.mark.parametrize("jit", [jax.jit, eqx.filter_jit])
def test_out_of_range_ids_of_a_decoder_under_jit_name_the_id(jit):
    """A `DecoderLM` as the `CharLM` above: under plain `jax.jit` too, the
    error the user sees names the offending id and the vocabulary size."""
    model = bl.DecoderLM(bl.DecoderConfig(50, 16, 2, 1), key=jax.random.key(0))
    fn = jit(lambda m, t: m(t))
    with pytest.raises(
        (eqx.EquinoxRuntimeError, jax.errors.JaxRuntimeError),
        match=r"DecoderLM: token ids must lie in \[0, vocab_size=50\), got 70",
    ):
        jax.block_until_ready(fn(model, jnp.array([1, 2, 70])))
