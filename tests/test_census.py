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
