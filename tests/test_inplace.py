"""In-place (donating) norms: same values as a NumPy float64 loop, and x is consumed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab
from blocklab.nn.inplace import default_block_rows, layer_norm_, rms_norm_


def _np_rms(x, w, eps):
    out = np.empty_like(x, dtype=np.float64)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx].astype(np.float64)
        out[idx] = row / np.sqrt(np.mean(row**2) + eps) * w
    return out


def _np_layer(x, w, b, eps):
    out = np.empty_like(x, dtype=np.float64)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx].astype(np.float64)
        mu = np.sum(row) / row.size
        var = np.sum((row - mu) ** 2) / row.size
        out[idx] = (row - mu) / np.sqrt(var + eps) * w + b
    return out


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3 + 0.5
    w = 1 + 0.1 * rng.standard_normal(shape[-1])
    b = 0.1 * rng.standard_normal(shape[-1])
    return x.astype(dtype), w.astype(dtype), b.astype(dtype)


# (shape, block_rows): ragged row counts, a block larger than the input, default.
CASES = [
    ((7, 16), 3),
    ((2, 5, 32), 4),
    ((3, 8), 16),
    ((2, 2, 3, 8), 1),
    ((40, 64), None),
]


@pytest.mark.parametrize(("shape", "block_rows"), CASES)
@pytest.mark.float64
def test_rms_norm_matches_numpy_float64(shape, block_rows):
    x, w, _ = _data(shape, np.float64)
    y = rms_norm_(jnp.asarray(x), jnp.asarray(w), 1e-6, block_rows=block_rows)
    np.testing.assert_allclose(
        np.asarray(y), _np_rms(x, w, 1e-6), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(("shape", "block_rows"), CASES)
@pytest.mark.float64
def test_layer_norm_matches_numpy_float64(shape, block_rows):
    x, w, b = _data(shape, np.float64)
    y = layer_norm_(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), 1e-6, block_rows=block_rows
    )
    np.testing.assert_allclose(
        np.asarray(y), _np_layer(x, w, b, 1e-6), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(("shape", "block_rows"), CASES)
def test_float32_equals_out_of_place_norms(shape, block_rows):
    x, w, b = (jnp.asarray(a) for a in _data(shape, np.float32))
    ref_rms = blocklab.rms_norm(x, w)
    ref_ln = blocklab.layer_norm(x, w, b)
    y_rms = rms_norm_(jnp.array(x, copy=True), w, block_rows=block_rows)
    y_ln = layer_norm_(jnp.array(x, copy=True), w, b, block_rows=block_rows)
    assert y_rms.dtype == y_ln.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(y_rms), np.asarray(ref_rms), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(y_ln), np.asarray(ref_ln), rtol=1e-6, atol=1e-6
    )


def test_float32_statistics_against_numpy():
    # Offset rows: the two-pass variance keeps float32 accurate relative to float64.
    x, w, b = _data((9, 256), np.float32)
    x = x + np.float32(100.0)
    y = layer_norm_(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), block_rows=4)
    np.testing.assert_allclose(np.asarray(y), _np_layer(x, w, b, 1e-6), atol=2e-4)


def test_bfloat16_input_keeps_dtype_and_uses_float32_statistics():
    x, w, b = _data((5, 3, 64), np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    exact = np.asarray(xb.astype(jnp.float32), np.float64)  # the values actually stored
    y_rms = rms_norm_(jnp.array(xb, copy=True), jnp.asarray(w), block_rows=2)
    y_ln = layer_norm_(
        jnp.array(xb, copy=True), jnp.asarray(w), jnp.asarray(b), block_rows=2
    )
    assert y_rms.dtype == y_ln.dtype == jnp.bfloat16
    # One bfloat16 rounding of the output: relative error 2**-8.
    for y, ref in (
        (y_rms, _np_rms(exact, w, 1e-6)),
        (y_ln, _np_layer(exact, w, b, 1e-6)),
    ):
        got = np.asarray(y.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(got, ref, rtol=2**-8, atol=1e-2)
        assert np.all(np.isfinite(got))


@pytest.mark.float64
def test_defaults_are_unit_gain_zero_shift():
    x, _, _ = _data((6, 32), np.float64)
    d = x.shape[-1]
    np.testing.assert_allclose(
        np.asarray(rms_norm_(jnp.asarray(x), eps=0.5)),
        _np_rms(x, np.ones(d), 0.5),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        np.asarray(layer_norm_(jnp.asarray(x), eps=0.5)),
        _np_layer(x, np.ones(d), np.zeros(d), 0.5),
        rtol=1e-12,
    )


@pytest.mark.parametrize("fn", [rms_norm_, layer_norm_], ids=["rms", "layer"])
def test_input_buffer_is_donated(fn):
    x = jax.random.normal(jax.random.key(0), (10, 32), jnp.float32)
    y = fn(x, block_rows=4)
    assert x.is_deleted()
    assert not y.is_deleted() and y.shape == (10, 32)


def test_default_block_rows_is_about_128_kib():
    assert default_block_rows(1024) == 32
    assert default_block_rows(1024, 2) == 64
    assert default_block_rows(48) == 682
    assert default_block_rows(10**6) == 1


@pytest.mark.parametrize("bad", [0, -3, True])
def test_bad_block_rows_raises(bad):
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"block_rows must be a positive int.*got"):
        rms_norm_(x, block_rows=bad)


def test_exported_at_top_level():
    assert blocklab.rms_norm_ is rms_norm_ and blocklab.layer_norm_ is layer_norm_
    assert blocklab.nn.inplace.rms_norm_ is rms_norm_
