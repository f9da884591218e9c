"""One meaning per name: renamed keywords still work, with a DeprecationWarning
naming the new keyword, and give the new keyword's values; both at once is a
`ConfigError`."""

import math

import pytest

from blocklab import ConfigError
from blocklab._validate import renamed_keyword
from blocklab.diagnostics import theory


def test_renamed_keyword_returns_the_one_given():
    assert renamed_keyword("f", "new", 3, "old", None) == 3
    assert renamed_keyword("f", "new", None, "old", None) is None
    with pytest.warns(DeprecationWarning, match=r"f: old= is deprecated; use new=4"):
        assert renamed_keyword("f", "new", None, "old", 4) == 4
    with pytest.raises(ConfigError, match=r"give new= only .* new=1 and old=2"):
        renamed_keyword("f", "new", 1, "old", 2)


def test_collapse_spread_takes_num_blks_and_the_old_num_blocks():
    # hand-worked: rho_0 = 1/(n-1) = 1/63, (1 + alpha^4)^k = 2^8 = 256
    expected = (1 + 256 / 63) ** -0.5
    assert theory.collapse_spread(8, 1.0, 64) == pytest.approx(expected, rel=1e-12)
    assert theory.collapse_spread(num_blks=8, alpha=1.0, num_tokens=64) == (
        pytest.approx(expected, rel=1e-12)
    )
    with pytest.warns(DeprecationWarning, match="num_blocks= is deprecated"):
        old = theory.collapse_spread(num_blocks=8, alpha=1.0, num_tokens=64)
    assert old == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ConfigError, match="give num_blks= only"):
        theory.collapse_spread(8, 1.0, 64, num_blocks=8)
    with pytest.raises(ConfigError, match="num_tokens is required"):
        theory.collapse_spread(8, 1.0)


def test_post_ln_identity_factor_takes_num_blks_and_the_old_num_blocks():
    expected = (1 + 0.5) ** -12  # (1 + c)^(-N), c = 0.5, N = 12
    assert theory.post_ln_identity_factor(0.5, 12) == pytest.approx(expected)
    with pytest.warns(DeprecationWarning, match="use num_blks=12"):
        assert theory.post_ln_identity_factor(0.5, num_blocks=12) == (
            pytest.approx(expected)
        )
    # a sequence of c_j: prod (1 + c_j)^(-1/2)
    assert theory.post_ln_identity_factor([0.5, 1.0]) == pytest.approx(
        1 / math.sqrt(1.5 * 2.0)
    )


def test_no_public_keyword_is_named_num_blocks_any_more():
    import inspect

    import blocklab.diagnostics.theory as th

    for name in th.__all__:
        fn = getattr(th, name)
        if callable(fn) and not isinstance(fn, type):
            params = inspect.signature(fn).parameters
            if "num_blocks" in params:
                assert params["num_blocks"].kind is inspect.Parameter.KEYWORD_ONLY
                assert params["num_blocks"].default is None, name


def test_a_trailing_underscore_means_in_place_only():
    """`DecoderConfig.kv_heads_` / `.head_dim_` (resolved sizes) are deprecated
    for `cfg.block.num_kv_heads` / `.head_dim`; `rms_norm_` stays in place."""
    from blocklab import DecoderConfig

    cfg = DecoderConfig.llama(
        vocab_size=32, num_hiddens=48, num_heads=6, num_kv_heads=None, num_blks=1,
        max_len=16,
    )  # fmt: skip
    # hand-worked: no kv heads given -> K = H = 6; p = d / H = 48 / 6 = 8
    assert (cfg.block.num_kv_heads, cfg.block.head_dim) == (6, 8)
    with pytest.warns(
        DeprecationWarning, match=r"use DecoderConfig.block.num_kv_heads"
    ):
        assert cfg.kv_heads_ == 6
    with pytest.warns(DeprecationWarning, match=r"use DecoderConfig.block.head_dim"):
        assert cfg.head_dim_ == 8
