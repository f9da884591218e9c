"""Rotary position embedding: NumPy reference, identities, positions, transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab.nn import functional as F

KEY = jax.random.key(0)


def _reference(x, positions, theta, *, float32_angles=True):
    """Half-split RoPE with explicit loops over positions and feature pairs."""
    x = np.asarray(x, np.float64)
    *_, T, p = x.shape
    out = np.empty_like(x)
    for t in range(T):
        for i in range(p // 2):
            if float32_angles:  # transformers: inv_freq and the angle in float32
                inv = np.float32(1.0) / np.float32(theta) ** (
                    np.float32(2 * i) / np.float32(p)
                )
                angle = float(np.float32(positions[t]) * inv)
            else:
                angle = positions[t] * theta ** (-2.0 * i / p)
            c, s = np.cos(angle), np.sin(angle)
            if float32_angles:  # ... and cos / sin rounded to float32
                c, s = float(np.float32(c)), float(np.float32(s))
            a, b = x[..., t, i], x[..., t, i + p // 2]
            out[..., t, i] = a * c - b * s
            out[..., t, i + p // 2] = b * c + a * s
    return out


@pytest.mark.parametrize("theta", [10000.0, 1e6, 500.0])
@pytest.mark.float64
def test_matches_the_float64_reference(theta):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 7, 8))
    pos = np.array([0, 1, 2, 5, 9, 17, 40])
    got = np.asarray(F.rope(jnp.asarray(x), jnp.asarray(pos), theta=theta))
    assert got.dtype == np.float64
    # float32 cos/sin may differ from the rounded float64 ones by one ulp.
    np.testing.assert_allclose(got, _reference(x, pos, theta), rtol=0, atol=3e-7)
    # Against float64 angles: only the float32 rounding of the angles differs.
    exact = _reference(x, pos, theta, float32_angles=False)
    np.testing.assert_allclose(got, exact, atol=2e-5)
    assert np.abs(got - exact).max() > 0  # the float32 angles are really used


def test_frequencies_and_default_positions():
    inv = np.asarray(bl.nn.functional.rope_frequencies(8, 10000.0))
    assert inv.dtype == np.float32
    np.testing.assert_allclose(inv, [1.0, 0.1, 0.01, 0.001], rtol=1e-6)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 8)), jnp.float32)
    np.testing.assert_array_equal(F.rope(x), F.rope(x, jnp.arange(5)))
    np.testing.assert_array_equal(F.rope(x)[0], x[0])  # position 0: no rotation


@pytest.mark.parametrize(
    "dtype",
    [jnp.float32, pytest.param(jnp.float64, marks=pytest.mark.float64), jnp.bfloat16],
)
def test_preserves_norms_and_dtype(dtype):
    x = jax.random.normal(jax.random.key(0), (2, 9, 16)).astype(dtype)
    y = F.rope(x, theta=100.0)
    assert y.dtype == dtype
    nx = np.linalg.norm(np.asarray(x, np.float64), axis=-1)
    ny = np.linalg.norm(np.asarray(y, np.float64), axis=-1)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(ny, nx, rtol=tol)


def test_rope_angles_stay_float32_for_bf16_input():
    # Angles m * omega formed in bf16 are off by up to ~0.25 rad at T = 64
    # (max error 0.26 against this reference); in float32 only the output's
    # bf16 rounding remains (0.008).
    x = jax.random.normal(jax.random.key(0), (64, 64)).astype(jnp.bfloat16)
    out = bl.rope(x)
    assert out.dtype == jnp.bfloat16
    want = _reference(x, np.arange(64), 1e4, float32_angles=False)
    err = np.abs(np.asarray(out, np.float64) - want).max()
    assert err < 0.02, err


def test_scores_depend_only_on_the_position_difference():
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.normal(size=(1, 16))) for _ in range(2))

    def score(m, n):
        rq = F.rope(q, jnp.array([m]), theta=1000.0)
        rk = F.rope(k, jnp.array([n]), theta=1000.0)
        return float(jnp.sum(rq * rk))

    for m, n in [(0, 0), (3, 1), (1, 3), (7, 2)]:
        base = score(m, n)
        for shift in rng.integers(1, 40, size=3):
            assert score(m + shift, n + shift) == pytest.approx(base, abs=1e-4)
    # ... and does depend on it: the identity is not vacuous.
    assert abs(score(3, 1) - score(1, 3)) > 1e-2


def test_explicit_positions_give_generation_offsets_and_packing():
    x = jax.random.normal(jax.random.key(1), (10, 8), jnp.float32)
    full = F.rope(x)
    for k in (1, 4, 9):
        np.testing.assert_array_equal(F.rope(x[k:], jnp.arange(k, 10)), full[k:])
    # Two packed sequences of lengths 4 and 6, each restarting at 0.
    packed = jnp.concatenate([jnp.arange(4), jnp.arange(6)])
    got = F.rope(x, packed)
    np.testing.assert_array_equal(got[4:], F.rope(x[4:]))
    # Per-sequence positions of a batch broadcast against x.shape[:-1].
    xb = jnp.stack([x, x])
    pos = jnp.stack([jnp.arange(10), jnp.arange(3, 13)])
    got = F.rope(xb, pos)
    np.testing.assert_array_equal(got[0], full)
    np.testing.assert_array_equal(got[1], F.rope(x, jnp.arange(3, 13)))
    assert not np.allclose(got[1], full)


def test_theta_may_be_traced():
    x = jax.random.normal(jax.random.key(2), (6, 8), jnp.float32)
    traced = jax.jit(lambda th: F.rope(x, theta=th))(jnp.float32(123.0))
    np.testing.assert_allclose(traced, F.rope(x, theta=123.0), rtol=0, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="head dimension must be even, got 5"):
        F.rope(jnp.ones((3, 5)))
    with pytest.raises((ValueError, TypeError)):
        F.rope(jnp.ones((3, 4)), jnp.array([0.0, 1.0, 2.0]))
    with pytest.raises((ValueError, TypeError)):
        F.rope(jnp.ones((3, 4)), jnp.arange(4))


def test_matches_transformers_apply_rotary_pos_emb():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    H, T, p = 3, 12, 16
    for theta in (10000.0, 1e6):
        cfg = LlamaConfig(
            hidden_size=H * p,
            num_attention_heads=H,
            num_hidden_layers=1,
            vocab_size=8,
            rope_theta=theta,
        )
        rng = np.random.default_rng(3)
        q, k = rng.normal(size=(2, 1, H, T, p)).astype(np.float32)
        pos = np.arange(5, 5 + T)
        cos, sin = LlamaRotaryEmbedding(config=cfg)(
            torch.from_numpy(q), torch.from_numpy(pos)[None]
        )
        rq, rk = apply_rotary_pos_emb(
            torch.from_numpy(q), torch.from_numpy(k), cos, sin
        )
        for ours, theirs in ((q, rq), (k, rk)):
            got = F.rope(jnp.asarray(ours), jnp.asarray(pos), theta=theta)
            np.testing.assert_allclose(got, theirs.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_rope_rotates_by_the_float32_angles_past_position_1000(dtype):
    """The angles positions x inv_freq must be computed in float32 whatever the
    input dtype: in bfloat16, 1000 x 1.0 rounds to a spacing of 8 there, so
    the rotation would move by up to ~6 rad, which a norm check cannot see.
    A bf16 / fp16 rotation of x must equal the float32 rotation of the same
    (rounded) x, to the input dtype's rounding of the output."""
    x = jax.random.normal(jax.random.key(3), (64, 2, 16)).astype(dtype)
    pos = jnp.arange(1000, 1064)[:, None]
    got = np.asarray(F.rope(x, pos, theta=10000.0), np.float32)
    want = np.asarray(F.rope(x.astype(jnp.float32), pos, theta=10000.0))
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, atol=4 * eps * np.abs(want).max())
    # and a whole model: a bf16 RoPE attention against its float32 self there
    attn = bl.MultiHeadAttention(32, 4, num_kv_heads=2, rope_theta=10000.0, key=KEY)
    h = jax.random.normal(jax.random.key(4), (8, 32))
    far = jnp.arange(1200, 1208)
    lo = attn(h.astype(dtype), positions=far).astype(jnp.float32)
    hi = attn(h.astype(dtype).astype(jnp.float32), positions=far)
    np.testing.assert_allclose(lo, hi, atol=0.05 * float(np.abs(hi).max()))
