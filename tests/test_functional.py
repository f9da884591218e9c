"""The pure array functions against NumPy float64 and closed forms."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st

import blocklab as bl
import blocklab.nn.functional as F
from blocklab._validate import ConfigError

SHAPES = [(8,), (5, 8), (2, 3, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.float64
def test_rms_norm_matches_reference_over_leading_axes(shape, with_weight):
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape)
    w = 1 + rng.normal(size=shape[-1]) if with_weight else None
    got = F.rms_norm(jnp.asarray(x), None if w is None else jnp.asarray(w))
    np.testing.assert_allclose(got, ref.rms_norm(x, w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.float64
def test_layer_norm_matches_reference_over_leading_axes(shape, affine):
    rng = np.random.default_rng(1)
    x = 3 + 2 * rng.normal(size=shape)
    w, b = (
        (rng.normal(size=shape[-1]), rng.normal(size=shape[-1]))
        if affine
        else (None, None)
    )
    got = F.layer_norm(
        jnp.asarray(x),
        None if w is None else jnp.asarray(w),
        None if b is None else jnp.asarray(b),
    )
    np.testing.assert_allclose(got, ref.layer_norm(x, w, b), rtol=1e-12, atol=1e-12)


def test_norm_eps_enters_under_the_square_root():
    # x = (1, -1): mean square 1, so rms_norm = x / sqrt(1 + eps).
    x = jnp.array([1.0, -1.0])
    np.testing.assert_allclose(
        F.rms_norm(x, eps=0.25), np.array([1, -1]) / math.sqrt(1.25)
    )
    np.testing.assert_allclose(
        F.layer_norm(x, eps=0.25), np.array([1, -1]) / math.sqrt(1.25)
    )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_norm_statistics_in_float32_results_in_input_dtype(dtype):
    # 300^2 = 9e4 overflows float16 (max 65504): a float16 statistic would give
    # inf and a zero output. In float32 the result is exactly +-1.
    x = jnp.array([300.0, -300.0] * 4, dtype)
    for fn in (F.rms_norm, F.layer_norm):
        y = fn(x)
        assert y.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(y, np.float64), [1.0, -1.0] * 4, rtol=1e-2
        )


def test_norm_float32_weights_keep_low_precision_input_dtype():
    x = jnp.ones((3, 4), jnp.bfloat16)
    assert F.rms_norm(x, jnp.ones(4, jnp.float32)).dtype == jnp.bfloat16
    assert F.layer_norm(x, jnp.ones(4), jnp.zeros(4)).dtype == jnp.bfloat16


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.sampled_from([2, 5, 16, 33]),
    log_scale=st.floats(-6.0, 6.0),
)
@pytest.mark.float64
def test_rms_norm_is_invariant_to_positive_scaling(seed, d, log_scale):
    # Exercise 1 of the chapter: with eps = 0, RMSNorm(c x) = RMSNorm(x), c > 0.
    x = np.random.default_rng(seed).normal(size=(3, d))
    c = 10.0**log_scale
    a = F.rms_norm(jnp.asarray(x), eps=0.0)
    b = F.rms_norm(jnp.asarray(c * x), eps=0.0)
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.sampled_from([2, 5, 16, 33]),
    log_scale=st.floats(-3.0, 3.0),
    shift=st.floats(-100.0, 100.0),
)
@pytest.mark.float64
def test_layer_norm_is_invariant_to_shift_and_positive_scaling(
    seed, d, log_scale, shift
):
    x = np.random.default_rng(seed).normal(size=(3, d))
    a = F.layer_norm(jnp.asarray(x), eps=0.0)
    b = F.layer_norm(jnp.asarray(10.0**log_scale * x + shift), eps=0.0)
    np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-7)


Z = np.linspace(-6, 6, 49)


@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_exact", "silu"])
@pytest.mark.float64
def test_activations_match_closed_forms(name):
    got = getattr(F, name)(jnp.asarray(Z))
    np.testing.assert_allclose(got, ref.ELEMENTWISE[name](Z), rtol=1e-12, atol=1e-14)


def test_activation_table_names_the_functions():
    assert F.ACTIVATIONS == {
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_exact": F.gelu_exact,
        "silu": F.silu,
    }


def test_gelu_variants_differ_by_the_tanh_approximation():
    # The tanh form is an approximation: close to, but not equal to, z Phi(z).
    diff = np.abs(np.asarray(F.gelu(jnp.asarray(Z)) - F.gelu_exact(jnp.asarray(Z))))
    assert 1e-5 < diff.max() < 1e-3


@pytest.mark.parametrize(
    "valid_lens", [None, 3, np.array([1, 2, 3, 4, 5]), np.array([0, 5, 2, 0, 1])]
)
@pytest.mark.float64
def test_masked_softmax_matches_reference(valid_lens):
    s = np.random.default_rng(2).normal(size=(2, 5, 5)) * 3
    got = F.masked_softmax(jnp.asarray(s), valid_lens)
    want = ref.masked_softmax(s, valid_lens)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(got).sum(-1), 1.0, atol=1e-12)


def test_masked_softmax_zeroes_keys_beyond_each_length():
    s = jnp.asarray(np.random.default_rng(3).normal(size=(4, 6)))
    p = np.asarray(F.masked_softmax(s, jnp.array([1, 2, 3, 6])))
    for i, n in enumerate([1, 2, 3, 6]):
        assert np.all(p[i, n:] == 0.0)
    assert p[0, 0] == 1.0


def test_masked_softmax_fully_masked_rows_are_uniform_not_nan():
    s = jnp.asarray(np.random.default_rng(4).normal(size=(3, 4, 7)), jnp.float32)
    p = F.masked_softmax(s, 0)
    np.testing.assert_allclose(p, np.full((3, 4, 7), 1 / 7), rtol=1e-6)
    p = np.asarray(F.masked_softmax(s, jnp.array([0, 2, 0, 7])))
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p[:, 0], 1 / 7, rtol=1e-6)


def test_masked_softmax_low_precision_scores_return_float32():
    s = jnp.full((2, 2), 1000.0, jnp.float16)
    p = F.masked_softmax(s, jnp.array([1, 2]))
    assert p.dtype == jnp.float32
    np.testing.assert_allclose(p, [[1.0, 0.0], [0.5, 0.5]])


@pytest.mark.float64
def test_attention_entropy_closed_forms():
    for n in (1, 2, 7, 64):
        uniform = jnp.full((n,), 1.0 / n)
        np.testing.assert_allclose(
            F.attention_entropy(uniform), math.log(n), atol=1e-12
        )
    one_hot = jnp.eye(5)
    np.testing.assert_array_equal(F.attention_entropy(one_hot), np.zeros(5))
    p = np.random.default_rng(5).dirichlet(np.ones(6), size=(2, 3))
    np.testing.assert_allclose(
        F.attention_entropy(jnp.asarray(p)), ref.entropy(p), rtol=1e-12
    )


def test_attention_entropy_of_masked_causal_rows():
    # Causal uniform logits: row i attends uniformly over i + 1 keys.
    p = F.masked_softmax(jnp.zeros((5, 5)), jnp.arange(1, 6))
    np.testing.assert_allclose(
        F.attention_entropy(p), np.log(np.arange(1, 6)), atol=1e-12
    )


def test_token_spread_hand_worked_values():
    # Tokens (1, 0), (-1, 0): mean zero -> spread 1.
    assert float(F.token_spread(jnp.array([[1.0, 0.0], [-1.0, 0.0]]))) == pytest.approx(
        1.0
    )
    # Identical tokens -> spread 0.
    assert float(F.token_spread(jnp.ones((4, 3)))) == pytest.approx(0.0, abs=1e-15)
    # (2, 0), (0, 0): mean (1, 0); ||H - mean|| = sqrt 2, ||H|| = 2.
    h = jnp.array([[2.0, 0.0], [0.0, 0.0]])
    # float32: a sqrt and a division, each within half an ulp (2^-24)
    assert float(F.token_spread(h)) == pytest.approx(math.sqrt(2) / 2, rel=3e-7)


def test_token_spread_over_a_batch_pools_all_sequences():
    # Sequence 1 collapsed ((1,1),(1,1)), sequence 2 ((1,0),(-1,0)): the
    # centred norms are 0 and sqrt 2, the norms sqrt 4 and sqrt 2.
    h = jnp.array([[[1.0, 1.0], [1.0, 1.0]], [[1.0, 0.0], [-1.0, 0.0]]])
    assert float(F.token_spread(h)) == pytest.approx(  # float32: as above
        math.sqrt(2) / math.sqrt(6), rel=3e-7
    )


def test_token_spread_of_collapsed_and_zero_states():
    assert float(F.token_spread(jnp.zeros((2, 4, 8)))) == 0.0  # was 0/0 = NaN
    assert float(F.token_spread(jnp.ones((2, 4, 8)))) == 0.0
    h = np.random.default_rng(0).normal(size=(2, 4, 8))
    want = np.linalg.norm(h - h.mean(-2, keepdims=True)) / np.linalg.norm(h)
    np.testing.assert_allclose(float(F.token_spread(jnp.asarray(h))), want, rtol=1e-5)


# ------------------------------------------- valid lengths, eps = 0 (issue 13)
def test_valid_mask_broadcast_forms():
    T = 4
    causal = np.tril(np.ones((T, T), bool))
    np.testing.assert_array_equal(F.valid_mask(jnp.arange(1, T + 1), T, T), causal)
    np.testing.assert_array_equal(
        F.valid_mask(2, T, T), np.arange(T) < np.full((T, 1), 2)
    )
    per_seq = F.valid_mask(jnp.array([[1], [3]]), T, T)  # (B, 1): one per sequence
    assert per_seq.shape == (2, T, T)
    np.testing.assert_array_equal(per_seq[1], np.broadcast_to(np.arange(T) < 3, (T, T)))
    per_both = F.valid_mask(jnp.array([[1, 1, 2, 2], [4, 3, 2, 1]]), T, T)
    np.testing.assert_array_equal(per_both[1, 0], [True, True, True, True])
    np.testing.assert_array_equal(per_both[1, 3], [True, False, False, False])


def test_masked_softmax_with_lengths_aligned_to_the_leading_axes():
    rng = np.random.default_rng(5)
    s = rng.normal(size=(2, 3, 4, 4))  # (B, heads, Tq, Tk)
    lens = np.array([1, 3])[:, None, None]  # (B, 1, 1)
    got = F.masked_softmax(jnp.asarray(s), jnp.asarray(lens))
    assert got.dtype == jnp.float32  # the suite's default precision
    for b in range(2):
        # float32 exp, sum and division: a few roundings of 2^-24 each
        np.testing.assert_allclose(
            got[b], ref.masked_softmax(s[b], int(lens[b, 0, 0])), rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize(
    ("lens", "pattern"),
    [
        (np.array([1.5, 2.0, 3.0]), "integer dtype, got dtype float64"),
        (np.array([True, False, True]), "integer dtype, got dtype bool"),
        (np.array([1, -1, 2]), r"non-negative, got \[1, -1, 2\]"),
        (np.arange(5), r"got shape \(5,\)"),
    ],
)
def test_masked_softmax_refuses_bad_lengths(lens, pattern, plain_python):
    with pytest.raises(ValueError, match=pattern):
        F.masked_softmax(jnp.zeros((3, 3)), lens)


@pytest.mark.parametrize("fn", [F.rms_norm, F.layer_norm])
def test_eps_zero_maps_a_degenerate_row_to_zero_with_a_finite_gradient(fn):
    import jax

    x = jnp.array([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 3.0, 0.5]])
    if fn is F.layer_norm:
        x = x.at[0].set(7.0)  # constant row: zero variance
    y = fn(x, eps=0.0)
    np.testing.assert_array_equal(y[0], 0.0)
    want = (
        ref.rms_norm(x[1:], eps=0.0)
        if fn is F.rms_norm
        else ref.layer_norm(x[1:], eps=0.0)
    )
    # float32 (the test's point is the degenerate row): a few roundings of 2^-24
    np.testing.assert_allclose(y[1:], want, rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(fn(x, eps=0.0)[1] ** 3))(x)
    assert np.isfinite(grad).all()


def test_clamped_softmax_equals_replacement_on_finite_and_inf_scores():
    """The attention layers' `_softmax_clamped` (min against a +inf / MASK_VALUE
    table) gives the replaced-score softmax of a NumPy loop: random masks with
    fully masked rows, and +inf or huge scores at masked positions."""
    from blocklab.nn.functional import MASK_VALUE, _softmax_clamped

    rng = np.random.default_rng(7)
    scores = rng.normal(0, 4, (3, 5, 9)).astype(np.float32)
    mask = rng.random((3, 5, 9)) < 0.6
    mask[0, 1] = False  # a row with no visible key: uniform weights
    scores[~mask & (rng.random(mask.shape) < 0.3)] = np.inf
    scores[~mask & (rng.random(mask.shape) < 0.3)] = 3e38
    got = np.asarray(_softmax_clamped(jnp.asarray(scores), jnp.asarray(mask)))
    want = np.empty(scores.shape)
    for idx in np.ndindex(scores.shape[:-1]):
        s = np.where(mask[idx], scores[idx].astype(np.float64), MASK_VALUE)
        e = np.exp(s - s.max())
        want[idx] = e / e.sum()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got[0, 1], 1 / 9, rtol=1e-6)
    # the same gradient as the replacement: nothing reaches a masked score
    fin = jnp.asarray(np.where(np.isfinite(scores) & (scores < 1e30), scores, 1.0))
    g = jax.grad(
        lambda s: jnp.sum(_softmax_clamped(s, jnp.asarray(mask))[..., 0] ** 2)
    )(fin)
    assert np.all(np.asarray(g)[~mask] == 0.0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: F.rope_frequencies(0), r"head_dim must lie in \[2"),
        (lambda: F.rope_frequencies(-4), r"head_dim must lie in \[2"),
        (lambda: bl.rope(jnp.ones((4, 8)), theta=0.0), r"theta must lie in \(0"),
        (lambda: bl.rope(jnp.ones((4, 8)), theta=-1e4), r"theta must lie in \(0"),
        (lambda: bl.rope(jnp.ones((4, 8)), theta=float("nan")), "theta must be finite"),
        (lambda: bl.rope(jnp.ones(8)), r"\(\.\.\., T, p\).*x\[None\]"),
        (lambda: bl.rope(jnp.ones((4, 8), jnp.int32)), "must be floating point"),
        (lambda: bl.rms_norm_(jnp.ones((4, 8), jnp.int32)), "must be floating point"),
        (lambda: bl.rms_norm(jnp.ones((4, 8), jnp.int32)), "must be floating point"),
        (lambda: bl.rms_norm_(jnp.ones((4, 8)), jnp.ones(5)),
         r"weight must have shape \(d,\) = \(8,\)"),
        (lambda: bl.layer_norm_(jnp.ones((4, 8)), jnp.ones(8), jnp.ones(3)),
         r"bias must have shape \(d,\) = \(8,\)"),
        (lambda: bl.layer_norm(jnp.ones((4, 8)), jnp.ones(5)),
         r"weight must have shape"),
    ],
)  # fmt: skip
def test_numeric_arguments_are_refused_naming_them(call, match, monkeypatch):
    import inspect

    # The suite's jaxtyping hook refuses some of these by their annotations
    # first; users have no hook, so check the functions' own refusals.
    for mod in (bl, F, bl.nn.inplace):
        for name in ("rope", "rms_norm", "rms_norm_", "layer_norm", "layer_norm_"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, inspect.unwrap(getattr(mod, name)))
    with pytest.raises(ConfigError, match=match):
        call()


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((2.5, 4), r"causal_lengths: shape\[0\] must be an int, got 2.5"),
        ((-3,), r"causal_lengths: shape\[0\] must lie in \[0, inf\], got -3"),
        (5, r"causal_lengths: shape must be a tuple of sizes .* got 5"),
    ],
)
def test_causal_lengths_refuses_a_shape_that_is_not_sizes(shape, match, plain_python):
    from blocklab._validate import ConfigError
    from blocklab.nn.functional import causal_lengths

    with pytest.raises(ConfigError, match=match):
        causal_lengths(shape)
    np.testing.assert_array_equal(causal_lengths((2, 3)), [[1, 2, 3]])
