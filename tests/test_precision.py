"""The suite's precision: float32 by default, float64 only under the marker.

`tests/conftest.py` turns `jax_enable_x64` on for a test marked
`@pytest.mark.float64` and restores it after the test, so that a pytest-xdist
worker that runs a float64 test and then a float32 one runs the second in
float32, as users run it; a fixture shared by several tests is built in the
precision of its module or class, not in that of the first test that asks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from ref_blocks import block_and_dict

import blocklab.nn.functional as F


def test_default_tests_run_in_float32():
    assert not jax.config.read("jax_enable_x64")
    assert jnp.zeros(3).dtype == jnp.float32
    assert jnp.asarray(np.ones(3)).dtype == jnp.float32  # NumPy float64 is truncated
    assert F.rms_norm(jnp.asarray(np.ones((2, 4)))).dtype == jnp.float32


@pytest.mark.float64
def test_marked_tests_run_in_float64():
    assert jax.config.read("jax_enable_x64")
    assert jnp.zeros(3).dtype == jnp.float64
    # 1 + 2^-40 is representable in float64, rounds to 1 in float32
    x = jnp.asarray(1.0 + 2.0**-40)
    assert float(x) != 1.0


def test_the_flag_is_off_again_after_a_marked_test():
    # collected right after the marked test above, which leaves x64 on: the
    # conftest must restore it (run without xdist, or on the same worker)
    assert not jax.config.read("jax_enable_x64")
    assert jnp.ones(2).dtype == jnp.float32


@pytest.mark.float64
@pytest.mark.parametrize("step", [0, 1])
def test_a_marked_test_may_change_the_flag_and_it_is_restored(step):
    # The conftest restores the flag after each test: a test that turns x64 off
    # inside still leaves the next (float32) test as it should be.
    assert jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="module")
def shared_zeros():
    """Built once, by whichever of the two tests below a worker runs first."""
    return jnp.zeros(2)


@pytest.mark.float64
def test_a_module_fixture_is_float32_even_when_a_float64_test_builds_it(
    shared_zeros,
):
    # (first in the file: without xdist it is the test that builds it)
    assert jax.config.read("jax_enable_x64")
    assert shared_zeros.dtype == jnp.float32


def test_a_module_fixture_is_float32_in_a_float32_test(shared_zeros):
    assert shared_zeros.dtype == jnp.float32


@pytest.mark.float64
class TestAFloat64Class:
    @pytest.fixture(scope="class")
    def shared_zeros(self):
        return jnp.zeros(2)

    def test_its_class_fixture_is_float64(self, shared_zeros):
        assert shared_zeros.dtype == jnp.float64


def test_float32_norm_matches_the_float64_reference_to_float32_rounding():
    # rms_norm in float32 vs NumPy float64: a mean of d = 64 squares, an rsqrt
    # and a product, each within a few ulp of 2^-24 ~ 6e-8: 1e-6 is ~16 ulp.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 64))
    w = 1 + rng.normal(size=64)
    got = F.rms_norm(jnp.asarray(x), jnp.asarray(w))
    assert got.dtype == jnp.float32
    want = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and float32 is really what ran: it is not float64-exact
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) > 1e-12


@pytest.mark.parametrize("placement", ref.ALL_PLACEMENTS)
@pytest.mark.parametrize(("norm", "act"), [("rms", "swiglu"), ("layer", "gelu")])
def test_float32_block_matches_the_float64_reference(placement, norm, act):
    # The block as users run it: float32 weights and input, against the NumPy
    # float64 reference of tests/test_block.py (which checks all 112
    # configurations in float64 at 1e-10). d = 16, a hidden width <= 64: each
    # output is a chain of sums of <= 64 products, two norms and a softmax, so
    # its float32 rounding error is a few hundred ulp of 2^-24 at most: 2e-5.
    d, heads, t = 16, 4, 6
    structure = dict(placement=placement, norm=norm, act=act, bias=True)
    blk, sd, rng = block_and_dict(0, d, heads, dtype=jnp.float32, **structure)
    x = rng.normal(size=(t, d))
    lens = np.arange(1, t + 1)
    got = blk(jnp.asarray(x, jnp.float32), jnp.asarray(lens))
    assert got.dtype == jnp.float32
    want = ref.block(
        sd, x, heads, norm_kind=norm, act=act, placement=placement, valid_lens=lens
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
