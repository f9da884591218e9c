"""blocklab.diagnostics.theory: closed forms against hand values, simulation,
the library."""

import itertools
import math

import equinox as eqx
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blocklab
from blocklab.diagnostics import theory
from blocklab.nn.block import PLACEMENTS

GATED = ("swiglu", "geglu", "reglu", "bilinear")


def _count(build):
    return blocklab.count_params(eqx.filter_eval_shape(build))


# ------------------------------------------------------------ parameter counts
def test_default_block_count_matches_chapter():
    # 4 * 256^2 + 3 * 256 * 683 + 2 * 256, worked by hand; the chapter prints 787200.
    assert theory.block_param_count(256, 8) == 262144 + 524544 + 512 == 787200
    assert theory.ffn_param_count(256, "gelu") == 524288
    assert theory.ffn_param_count(256, "swiglu") == 524544


def _check_counts(d, h, grid):
    for norm, act, placement, bias, qk_norm in grid:
        opts = dict(norm=norm, act=act, placement=placement, bias=bias, qk_norm=qk_norm)
        counted = _count(
            lambda o=opts: blocklab.TransformerBlock(d, h, key=jax.random.key(0), **o)
        )
        assert theory.block_param_count(d, h, **opts) == counted, opts


def _full_grid():
    return itertools.product(
        ("rms", "layer"), blocklab.nn.ffn.ACTS, PLACEMENTS, (False, True), (False, True)
    )


@pytest.mark.parametrize("d, h", [(100, 4), (96, 3), (64, 8)])
def test_block_param_count_matches_count_params(d, h):
    # every act, norm and placement at least once, with bias and qk_norm alternating
    grid = [
        (norm, act, placement, i % 2 == 0, i % 3 == 0)
        for i, (norm, act, placement) in enumerate(
            itertools.product(("rms", "layer"), blocklab.nn.ffn.ACTS, PLACEMENTS)
        )
        if i % 3 == d % 3
    ]
    _check_counts(d, h, grid)


@pytest.mark.slow
def test_block_param_count_matches_count_params_on_every_configuration():
    _check_counts(100, 4, _full_grid())


@pytest.mark.parametrize("act", blocklab.nn.ffn.ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_ffn_param_count_matches_count_params(act, bias):
    for d in (7, 8, 9, 256):
        counted = _count(
            lambda d=d: blocklab.FeedForward(d, act, bias=bias, key=jax.random.key(0))
        )
        assert theory.ffn_param_count(d, act, bias=bias) == counted


@pytest.mark.parametrize("d", list(range(1, 50)) + [128, 256, 4096])
def test_ffn_deviation_from_8d2_is_within_bound_and_exactly_0_or_d(d):
    for act in GATED:
        excess = theory.ffn_param_count(d, act) - 8 * d * d
        # 8d mod 3 = 0 -> exact; 8d = 3k + 1 -> rounds down (-d); 3k + 2 -> up (+d).
        expected = {0: 0, 1: -d, 2: d}[(8 * d) % 3]
        assert excess == expected
        assert abs(excess) / (8 * d * d) <= theory.ffn_deviation_bound(d) + 1e-18
    assert theory.ffn_param_count(d, "gelu") == 8 * d * d


def test_block_deviation_from_12d2_at_256():
    # d = 256: the SwiGLU FFN is 8d^2 + d (683 rounds up) and the norms 2d, so the
    # excess over 12 d^2 is 3d, a relative 3d / (12 d^2) = 1/(4d).
    assert theory.block_deviation_from_12d2(256, 8) == pytest.approx(
        1 / (4 * 256), abs=0
    )
    assert 787200 / (12 * 256**2) - 1 == pytest.approx(1 / 1024, abs=1e-15)


def test_llama_ffn_width_and_excess_hand_values():
    assert theory.llama_ffn_width(4096) == 11008  # 10922 -> 43 * 256
    assert theory.llama_ffn_width(256) == 768  # 682 -> 3 * 256
    assert theory.llama_ffn_width(128) == 512  # 341 -> 2 * 256
    assert theory.llama_ffn_excess(4096) == pytest.approx(33024 / 32768 - 1, abs=1e-15)
    assert theory.llama_ffn_excess(256) == pytest.approx(0.125, abs=1e-15)
    assert theory.llama_ffn_excess(128) == pytest.approx(0.5, abs=1e-15)


@given(
    d=st.integers(1, 20000),
    m=st.sampled_from([1, 8, 32, 64, 128, 256, 1000]),
)
@settings(max_examples=200, deadline=None)
def test_llama_ffn_width_agrees_with_library_rule(d, m):
    w = theory.llama_ffn_width(d, m)
    assert w == blocklab.nn.ffn.ffn_width(d, "swiglu", m)
    assert w % m == 0 and w - m < (8 * d) // 3 <= w  # the smallest such multiple


def test_llama_excess_matches_count_params():
    for d in (4096, 256, 128):
        n = _count(
            lambda d=d: blocklab.FeedForward(d, multiple_of=256, key=jax.random.key(0))
        )
        assert n / (8 * d * d) - 1 == pytest.approx(
            theory.llama_ffn_excess(d), abs=1e-15
        )


def test_count_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_hiddens must be divisible by num_heads"):
        theory.block_param_count(100, 3)
    with pytest.raises(ValueError, match="act must be one of .* got act='swish'"):
        theory.block_param_count(64, 4, act="swish")
    with pytest.raises(ValueError, match="placement must be one of"):
        theory.block_param_count(64, 4, placement="middle")
    with pytest.raises(ValueError, match="norm must be one of"):
        theory.block_param_count(64, 4, norm="batch")
    with pytest.raises(ValueError, match="multiple_of must be a positive int"):
        theory.llama_ffn_width(64, 0)


# ------------------------------------------------------------------ QK-norm
def _brute_force_logit_max(gq, gk, rng, trials=20000):
    """Largest |n_q^T diag(gq gk) n_k| / sqrt(p): random unit-RMS pairs, and the e_i."""
    p = gq.size
    best = 0.0
    for i in range(p):  # the candidate maximizers n_q = n_k = sqrt(p) e_i
        best = max(best, abs(gq[i] * gk[i]) * p / math.sqrt(p))
    n = rng.standard_normal((trials, 2, p))
    n *= math.sqrt(p) / np.linalg.norm(n, axis=-1, keepdims=True)
    vals = np.abs(np.einsum("tp,p,tp->t", n[:, 0], gq * gk, n[:, 1])) / math.sqrt(p)
    return max(best, vals.max()), vals.max()


@pytest.mark.parametrize("p", [4, 16, 64])
def test_qk_logit_bound_is_attained_and_never_exceeded(p):
    rng = np.random.default_rng(p)
    assert theory.qk_logit_bound(p) == pytest.approx(math.sqrt(p), rel=1e-15)
    gq, gk = 1 + 0.5 * rng.standard_normal(p), 1 + 0.5 * rng.standard_normal(p)
    best, random_best = _brute_force_logit_max(gq, gk, rng)
    bound = theory.qk_logit_bound(p, gq, gk)
    assert best == pytest.approx(bound, rel=1e-12)
    assert random_best <= bound


def test_max_weight_ratio_at_p64():
    assert theory.max_weight_ratio(64) == pytest.approx(math.exp(16), rel=1e-15)
    assert theory.max_weight_ratio(64) == pytest.approx(8.886e6, rel=1e-3)
    with pytest.raises(ValueError, match=r"gain_q must have shape \(head_dim,\)"):
        theory.qk_logit_bound(4, np.ones(3))


# -------------------------------------------------------------- GELU moments
def _gelu_np(z):
    return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))


@pytest.mark.parametrize("v", [0.05, 0.4, 1.0, 4.0])
def test_gelu_moments_against_monte_carlo(v):
    z = math.sqrt(v) * np.random.default_rng(0).standard_normal(2_000_000)
    g = _gelu_np(z)
    for closed, sample in (
        (theory.gelu_second_moment(v), g**2),
        (theory.gelu_mean(v), g),
    ):
        se = sample.std() / math.sqrt(sample.size)
        assert abs(closed - sample.mean()) <= 4 * se


def test_gelu_second_moment_limits():
    # small v: v/4 + 3 v^2 / (2 pi) + O(v^3)
    for v in (1e-3, 1e-2):
        assert theory.gelu_second_moment(v) == pytest.approx(
            v / 4 + 3 * v * v / (2 * math.pi), rel=20 * v
        )
    # large v: ReLU's v/2 (the tanh-GELU differs from ReLU only near zero)
    assert theory.gelu_second_moment(1e4) / 1e4 == pytest.approx(0.5, rel=1e-3)


# ----------------------------------------------------------- variance budget
def test_c_ffn_1_hand_value_and_simulation():
    assert theory.c_ffn_1() == pytest.approx(
        1.6 * theory.gelu_second_moment(0.4), rel=1e-15
    )
    # Independent simulation: unit-RMS tokens through a Xavier FFN of width 4d.
    rng, d = np.random.default_rng(1), 128
    lim1 = math.sqrt(6 / (d + 4 * d))
    vals = []
    for _ in range(20):
        x = rng.standard_normal((64, d))
        x = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)  # LayerNorm
        W1 = rng.uniform(-lim1, lim1, (4 * d, d))
        W2 = rng.uniform(-lim1, lim1, (d, 4 * d))
        vals.append(np.mean((_gelu_np(x @ W1.T) @ W2.T) ** 2))
    se = np.std(vals, ddof=1) / math.sqrt(len(vals))
    assert abs(np.mean(vals) - theory.c_ffn_1(d)) <= 4 * se


def test_softmax_collision_against_numpy_and_large_n_limit():
    rng = np.random.default_rng(123)
    s = rng.standard_normal((100_000, 64))
    a = np.exp(s) / np.exp(s).sum(1, keepdims=True)
    sample = (a**2).sum(1)
    se = sample.std() / math.sqrt(sample.size)
    assert abs(theory.softmax_collision(64) - sample.mean()) <= 4 * se
    # large n: e^{sigma^2} / n
    assert theory.softmax_collision(
        4096, 1.0, num_samples=2000
    ) * 4096 == pytest.approx(math.e, rel=0.01)


def test_c_attn_1_variants():
    assert theory.c_attn_1(64) == pytest.approx(math.e / 64, rel=1e-15)
    finite = theory.c_attn_1(64, finite_n=True)
    assert finite == pytest.approx(0.0388, abs=2e-4)
    assert theory.c_attn_1(64, num_hiddens=256) == pytest.approx(
        finite + 1 / 256, rel=1e-12
    )


# ------------------------------------------------------------- token collapse
@pytest.mark.float64
def test_rho0_against_simulated_random_tokens():
    rng, n, d = np.random.default_rng(2), 64, 256
    rhos = []
    for _ in range(200):
        x = rng.standard_normal((n, d))
        mu = x.mean(0)
        rhos.append(n * (mu @ mu) / ((x - mu) ** 2).sum())
    se = np.std(rhos) / math.sqrt(len(rhos))
    assert abs(np.mean(rhos) - theory.collapse_rho0(n)) <= 4 * se
    # and the spread of signal_stats is (1 + rho)^-1/2 exactly, for any tokens
    x = rng.standard_normal((n, d)) + 0.3
    mu = x.mean(0)
    rho = n * (mu @ mu) / ((x - mu) ** 2).sum()
    spread = float(blocklab.nn.functional.token_spread(jax.numpy.asarray(x)))
    assert spread == pytest.approx((1 + rho) ** -0.5, rel=1e-12)


@given(k=st.integers(0, 40), alpha=st.floats(0.0, 1.5), n=st.integers(2, 512))
@settings(max_examples=100, deadline=None)
def test_collapse_spread_recursion(k, alpha, n):
    rho = 1 / (n - 1)
    for _ in range(k):
        rho *= 1 + alpha**4
    assert theory.collapse_spread(k, alpha, n) == pytest.approx(
        (1 + rho) ** -0.5, rel=1e-12
    )


def test_gpt1_and_xavier_predictions():
    alpha = theory.init_alpha(768, 0.02)
    assert alpha == pytest.approx(0.02 * math.sqrt(768), rel=1e-15)  # 0.5543
    rho = (1 + alpha**4) ** 12 / 63
    assert theory.collapse_spread(12, alpha, 64) == pytest.approx((1 + rho) ** -0.5)
    assert theory.collapse_spread(12, 1.0, 64) == pytest.approx((1 + 4096 / 63) ** -0.5)
    assert theory.collapse_spread(0, 1.0, 64) == pytest.approx(math.sqrt(63 / 64))


def test_post_ln_identity_factor_forms_agree_for_common_c():
    assert theory.post_ln_identity_factor([0.3] * 8) == pytest.approx(
        1.3**-4, rel=1e-14
    )
    assert theory.post_ln_identity_factor(0.3, 4) == pytest.approx(1.3**-4, rel=1e-14)


# ---------------------------------------------------------------- norm cost
def test_norm_cost_on_chapter_array():
    shape = (64, 512, 1024)
    rms, ln = theory.norm_cost(shape, "rms"), theory.norm_cost(shape, "layer")
    assert rms.bytes_moved == 2 * 64 * 512 * 1024 * 4 + 1024 * 4 == 268439552
    assert ln.bytes_moved == 268439552 + 4096
    assert (rms.flops_per_element, ln.flops_per_element) == (4, 7)
    assert rms.intensity < 1 and ln.intensity < 1
    with pytest.raises(ValueError, match="norm must be one of"):
        theory.norm_cost(shape, "batch")


def test_passes_over_x_hand_values():
    # X -> 2X moves 2|X| in t; a kernel taking 1.5 t made 3 passes.
    bw = theory.achieved_bandwidth(2 * 1000, 0.5)
    assert bw == 4000.0
    assert theory.passes_over_x(0.75, bw, 1000) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        theory.achieved_bandwidth(10, 0.0)
