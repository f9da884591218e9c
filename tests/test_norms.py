"""RMSNorm and LayerNorm modules against the NumPy reference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import blocklab as bl
from blocklab.nn.normalization import make_norm


def test_default_parameters_are_unit_gain_and_zero_bias():
    np.testing.assert_array_equal(bl.RMSNorm(5).weight, np.ones(5))
    ln = bl.LayerNorm(5)
    np.testing.assert_array_equal(ln.weight, np.ones(5))
    np.testing.assert_array_equal(ln.bias, np.zeros(5))
    assert bl.count_params(bl.RMSNorm(5)) == 5
    assert bl.count_params(ln) == 10


@pytest.mark.parametrize("shape", [(6,), (4, 6), (2, 3, 6)])
@pytest.mark.float64
def test_rmsnorm_module_matches_reference_with_learned_gain(shape):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=shape), 1 + rng.normal(size=6)
    norm = bl.load_state_dict(bl.RMSNorm(6), {"weight": w}, dtype=jnp.float64)
    np.testing.assert_allclose(norm(jnp.asarray(x)), ref.rms_norm(x, w), rtol=1e-12)


@pytest.mark.parametrize("shape", [(6,), (4, 6), (2, 3, 6)])
@pytest.mark.float64
def test_layernorm_module_matches_reference_with_learned_affine(shape):
    rng = np.random.default_rng(1)
    x, w, b = rng.normal(size=shape), rng.normal(size=6), rng.normal(size=6)
    norm = bl.load_state_dict(
        bl.LayerNorm(6), {"weight": w, "bias": b}, dtype=jnp.float64
    )
    np.testing.assert_allclose(
        norm(jnp.asarray(x)), ref.layer_norm(x, w, b), rtol=1e-12
    )


@pytest.mark.parametrize("cls", [bl.RMSNorm, bl.LayerNorm])
def test_norm_module_uses_its_eps(cls):
    # x = (1, -1): mean square and variance are 1, so y = x / sqrt(1 + eps).
    y = cls(2, eps=0.5)(jnp.array([1.0, -1.0]))
    assert y.dtype == jnp.float32
    # float32: the mean, the rsqrt and the product round to a few ulp (2^-24 each)
    np.testing.assert_allclose(y, np.array([1.0, -1.0]) / np.sqrt(1.5), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("cls", [bl.RMSNorm, bl.LayerNorm])
def test_norm_module_returns_input_dtype(cls, dtype):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 8)), dtype)
    y = cls(8)(x)
    assert y.dtype == dtype
    want = (
        ref.rms_norm(np.asarray(x, np.float64))
        if cls is bl.RMSNorm
        else (ref.layer_norm(np.asarray(x, np.float64)))
    )
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-2, atol=1e-2)


def test_make_norm_builds_the_named_norm():
    assert isinstance(make_norm("rms", 4), bl.RMSNorm)
    assert isinstance(make_norm("layer", 4), bl.LayerNorm)
    gemma = make_norm("gemma_rms", 4)
    assert isinstance(gemma, bl.RMSNorm) and gemma.unit_offset
    assert set(bl.nn.normalization.NORMS) == {"rms", "layer", "gemma_rms"}


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_block_norm_eps_reaches_every_norm(norm):
    """`norm_eps` sets eps on every norm of the block (porting PyTorch's 1e-5)."""
    blk = bl.TransformerBlock(
        16, 4, norm=norm, placement="sandwich", norm_eps=1e-5, key=jax.random.key(0)
    )
    eps = [n.eps for n in (blk.norm1, blk.norm2, blk.out_norm1, blk.out_norm2)]
    assert eps == [1e-5] * 4
    # and eps is used: a constant-free input of tiny scale sees eps in the denominator
    x = np.full((3, 16), 1e-3)
    x[:, ::2] *= -1
    expected = x / np.sqrt(1e-6 + 1e-5)  # mean square 1e-6 (rms and layer agree here)
    np.testing.assert_allclose(blk.norm1(jnp.asarray(x)), expected, rtol=1e-6)


@pytest.mark.float64
def test_gemma_rmsnorm_gain_is_one_plus_weight_in_float32():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, 8))
    w = 0.3 * rng.normal(size=8)
    norm = bl.RMSNorm(8, 1e-6, unit_offset=True)
    np.testing.assert_array_equal(norm.weight, 0.0)  # gain 1 at init
    np.testing.assert_allclose(norm(jnp.asarray(x)), ref.rms_norm(x), rtol=1e-12)
    norm = eqx.tree_at(lambda n: n.weight, norm, jnp.asarray(w))
    np.testing.assert_allclose(norm(jnp.asarray(x)), ref.rms_norm(x, 1 + w), rtol=1e-12)
    # bfloat16 weights: 1 + w is formed in float32, not rounded to bfloat16
    wb = jnp.asarray(w, jnp.bfloat16)
    nb = eqx.tree_at(lambda n: n.weight, norm, wb)
    want = ref.rms_norm(x, 1 + np.asarray(wb, np.float64))
    np.testing.assert_allclose(nb(jnp.asarray(x, jnp.float32)), want, rtol=2e-6)


def test_gemma_rmsnorm_matches_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    theirs = Gemma3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(0.2 * torch.randn(16))
    x = torch.randn(2, 5, 16)
    ours = eqx.tree_at(
        lambda n: n.weight,
        bl.RMSNorm(16, 1e-6, unit_offset=True),
        jnp.asarray(theirs.weight.detach().numpy()),
    )
    with torch.no_grad():
        want = theirs(x).numpy()
    np.testing.assert_allclose(ours(jnp.asarray(x.numpy())), want, rtol=1e-6, atol=1e-6)
