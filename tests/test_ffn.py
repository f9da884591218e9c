"""The FFN family (7 activations) and its widths against the NumPy reference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import blocklab as bl

D = 16


def _ffn_dict(rng, act, bias, width):
    sd = {
        "W_1.weight": rng.normal(0, D**-0.5, (width, D)),
        "W_2.weight": rng.normal(0, width**-0.5, (D, width)),
    }
    if act in ref.GATED:
        sd["W_g.weight"] = rng.normal(0, D**-0.5, (width, D))
    if bias:
        for name, n in (("W_1", width), ("W_2", D), ("W_g", width)):
            if f"{name}.weight" in sd:
                sd[f"{name}.bias"] = rng.normal(0, 0.5, n)
    return sd


def test_acts_are_the_eight_settings():
    assert bl.nn.ffn.ACTS == ref.ALL_ACTS
    assert set(bl.nn.ffn.GATED_ACTS) == set(ref.GATED)


@pytest.mark.parametrize("act", ref.ALL_ACTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.float64
def test_ffn_matches_reference(act, bias):
    rng = np.random.default_rng(0)
    ffn = bl.FeedForward(D, act, bias=bias, key=jax.random.key(0))
    assert ffn.width == ref.ffn_hidden(D, act)
    sd = _ffn_dict(rng, act, bias, ffn.width)
    ffn = bl.load_state_dict(ffn, sd, dtype=jnp.float64)
    x = rng.normal(size=(5, D))
    want = ref.ffn({f"ffn.{k}": v for k, v in sd.items()}, x, act)
    np.testing.assert_allclose(ffn(jnp.asarray(x)), want, rtol=1e-12, atol=1e-12)


def test_ffn_acts_row_by_row_over_any_leading_axes():
    ffn = bl.FeedForward(D, "geglu", key=jax.random.key(1))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, D)), jnp.float32)
    y = ffn(x)
    np.testing.assert_allclose(y[1, 2], ffn(x[1, 2]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        y.reshape(6, D), ffn(x.reshape(6, D)), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    ("d", "act", "multiple_of", "width"),
    [
        (256, "gelu", None, 1024),
        (256, "relu", None, 1024),
        (256, "swiglu", None, 683),  # round(682.67)
        (128, "geglu", None, 341),  # round(341.33)
        (96, "bilinear", None, 256),  # 8 * 96 / 3 exactly
        (4096, "swiglu", 256, 11008),  # Llama: 256 * ceil(10922 / 256)
        (4096, "reglu", 256, 11008),
        (256, "swiglu", 64, 704),  # 682 -> 704
        (256, "gelu", 100, 1100),  # 1024 -> 1100
        (768, "swiglu", 256, 2048),  # floor(8 * 768 / 3) = 2048 exactly
    ],
)
def test_ffn_width_rule(d, act, multiple_of, width):
    assert bl.nn.ffn.ffn_width(d, act, multiple_of) == width


def test_ffn_multiple_of_sets_the_module_width_without_allocating():
    ffn = eqx.filter_eval_shape(
        lambda: bl.FeedForward(4096, "swiglu", multiple_of=256, key=jax.random.key(0))
    )
    assert ffn.width == 11008
    assert ffn.W_1.weight.shape == ffn.W_g.weight.shape == (11008, 4096)
    assert ffn.W_2.weight.shape == (4096, 11008)


def test_explicit_width_overrides_the_rule():
    ffn = bl.FeedForward(D, "gelu", ffn_width=7, key=jax.random.key(0))
    assert ffn.W_1.weight.shape == (7, D) and ffn.W_g is None


def test_gated_acts_hold_the_same_parameter_count():
    counts = {
        a: bl.count_params(
            eqx.filter_eval_shape(
                lambda a=a: bl.FeedForward(96, a, key=jax.random.key(0))
            )
        )
        for a in bl.nn.ffn.ACTS
    }
    assert {counts[a] for a in bl.nn.ffn.GATED_ACTS} == {3 * 96 * 256}
    assert {counts[a] for a in ("relu", "gelu", "gelu_exact")} == {8 * 96 * 96}


def test_key_is_accepted_and_ignored():
    ffn = bl.FeedForward(D, key=jax.random.key(0))
    x = jnp.ones((2, D))
    np.testing.assert_array_equal(ffn(x, key=jax.random.key(9)), ffn(x))
