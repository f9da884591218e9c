"""Parameter census: the chapter's numbers and hand-derived formulas."""

import equinox as eqx
import jax
import pytest

import blocklab as bl


def _abstract(make):
    return eqx.filter_eval_shape(make)


def test_chapter_block_census():
    c = bl.census(_abstract(lambda: bl.TransformerBlock(256, 8, key=jax.random.key(0))))
    assert c["attention"] == 262144  # 4 d^2
    assert c["ffn"] == 524544  # 3 d round(8d/3) = 3 * 256 * 683
    assert c["total"] == 787200
    assert c == {
        "norm1": 256,
        "norm2": 256,
        "attention": 262144,
        "ffn": 524544,
        "total": 787200,
    }
    assert f"{c['total'] / 256**2:.2f}" == "12.01"


def test_chapter_ffn_counts():
    assert (
        bl.count_params(
            _abstract(lambda: bl.FeedForward(256, "gelu", key=jax.random.key(0)))
        )
        == 524288
    )
    assert (
        bl.count_params(
            _abstract(lambda: bl.FeedForward(256, "swiglu", key=jax.random.key(0)))
        )
        == 524544
    )


@pytest.mark.parametrize("d", [64, 256, 512])
def test_2017_block_census_matches_hand_formula(d):
    # Post-LN, LayerNorm, GELU MLP, biases: attention 4(d^2 + d); FFN
    # d*4d + 4d + 4d*d + d = 8d^2 + 5d; two LayerNorms 2 * 2d. Total 12d^2 + 13d.
    blk = _abstract(
        lambda: bl.TransformerBlock(
            d,
            8,
            norm="layer",
            act="gelu",
            placement="post",
            bias=True,
            key=jax.random.key(0),
        )
    )
    c = bl.census(blk)
    assert c["attention"] == 4 * (d * d + d)
    assert c["ffn"] == 8 * d * d + 5 * d
    assert c["norm1"] == c["norm2"] == 2 * d
    assert c["total"] == 12 * d * d + 13 * d


def test_2017_block_census_at_chapter_size():
    blk = _abstract(
        lambda: bl.TransformerBlock(
            256, 8, norm="layer", act="gelu", placement="post", bias=True,
            key=jax.random.key(0),
        )
    )  # fmt: skip
    assert bl.census(blk)["total"] == 789760  # 12 * 65536 + 13 * 256


def test_sandwich_adds_two_output_norms_and_qk_norm_two_head_gains():
    d, h = 128, 4
    c = bl.census(
        _abstract(
            lambda: bl.TransformerBlock(
                d, h, placement="sandwich", qk_norm=True, key=jax.random.key(0)
            )
        )
    )
    assert c["out_norm1"] == c["out_norm2"] == d
    assert c["attention"] == 4 * d * d + 2 * (d // h)
    assert c["total"] == 4 * d + 4 * d * d + 2 * (d // h) + 3 * d * round(8 * d / 3)


@pytest.mark.parametrize(
    "options",
    [{}, {"norm": "layer", "act": "gelu", "placement": "post", "bias": True}],
    ids=["modern", "2017"],
)
def test_census_of_abstract_and_concrete_modules_agree(options):
    def make():
        return bl.TransformerBlock(16, 4, key=jax.random.key(0), **options)

    assert bl.census(_abstract(make)) == bl.census(make())
    assert bl.count_params(make()) == sum(
        a.size for a in bl.state_dict(make()).values()
    )


def test_count_params_of_a_stack_is_depth_times_block():
    stack = _abstract(
        lambda: bl.Stack(
            lambda k: bl.TransformerBlock(64, 4, key=k), 5, key=jax.random.key(0)
        )
    )
    one = bl.count_params(
        _abstract(lambda: bl.TransformerBlock(64, 4, key=jax.random.key(0)))
    )
    assert bl.count_params(stack) == 5 * one


def _real_arch_configs():
    """Many configurations of the real-architecture options, deterministically."""
    import itertools
    import random

    rng = random.Random(0)
    grid = list(
        itertools.product(
            (None, 1, 2),  # num_kv_heads (H = 4)
            (None, 8),  # head_dim
            (False, "head", "full"),  # qk_norm
            ("rms", "layer", "gemma_rms"),
            ("pre", "sandwich", "post", "output"),
        )
    )
    for kv, hd, qk, norm, placement in rng.sample(grid, 40):
        yield dict(
            num_kv_heads=kv,
            head_dim=hd,
            qk_norm=qk,
            norm=norm,
            placement=placement,
            act=rng.choice(bl.nn.ffn.ACTS),
            ffn_width=rng.choice([None, 40]),
            attn_bias=rng.choice([None, False, True]),
            ffn_bias=rng.choice([None, False, True]),
            bias=rng.choice([False, True]),
            rope_theta=rng.choice([None, 1e4]),
            window=rng.choice([None, 0, 3]),
            attn_scale=rng.choice([None, 0.2]),
        )


def test_closed_form_equals_the_count_for_every_real_architecture_option():
    for opts in _real_arch_configs():
        blk = _abstract(
            lambda o=opts: bl.TransformerBlock(24, 4, key=jax.random.key(0), **o)
        )
        counted = bl.count_params(blk)
        assert bl.block_param_count(24, 4, **opts) == counted, opts
        c = bl.census(blk)
        assert (
            c["total"] == counted
            and sum(v for k, v in c.items() if k != "total") == counted
        )


def test_census_of_grouped_query_full_qk_norm_attention_by_hand():
    # d=32, H=4, KV=2, p=6: W_q 32*24, W_k and W_v 32*12 each, W_o 24*32,
    # full-width QK-norm gains 24 + 12; the int32 window/theta leaves are not
    # parameters.
    mha = bl.MultiHeadAttention(
        32, 4, num_kv_heads=2, head_dim=6, qk_norm="full", rope_theta=1e4,
        window=5, key=jax.random.key(0),
    )  # fmt: skip
    assert bl.census(mha) == {
        "W_q": 768, "W_k": 384, "W_v": 384, "W_o": 768,
        "q_norm": 24, "k_norm": 12, "total": 2340,
    }  # fmt: skip
