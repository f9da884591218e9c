"""μP as data: the table, the builders' init rules, `blocklab.optimizer`, z-loss.

References are independent: hand-worked multipliers, a NumPy update rule,
a NumPy cross-entropy and log-sum-exp, and a standard model with the same
weights (the base-width equivalence).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blocklab as bl
from blocklab.nn import parametrization as P
from blocklab.training.optimizers import schedule_factor


def _leaves(model):
    return jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_inexact_array))


def _name(path):
    return jax.tree_util.keystr(path)


def test_base_width_differs_from_standard_only_by_zero_query_and_readout():
    """At width == base_width: same draws except W_q and the untied head (zero),
    every rate multiplier 1, and with those two copied over: the same logits
    and the same trajectory under `blocklab.optimizer`."""
    d, heads = 48, 3
    kw = dict(vocab_size=28, num_hiddens=d, num_heads=heads, num_kv_heads=1,
              num_blks=1, max_len=16)  # fmt: skip
    std = bl.DecoderLM(bl.DecoderConfig.llama(**kw), key=jax.random.key(3))
    mup = bl.DecoderLM(
        bl.DecoderConfig.llama(**kw, parametrization="mup", base_width=d),
        key=jax.random.key(3),
    )
    differ = []
    for (path, a), (_, b) in zip(_leaves(std), _leaves(mup), strict=True):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            differ.append(_name(path))
            assert not np.any(np.asarray(b)), f"{_name(path)} is not zero under μP"
    assert sorted(differ) == [".head.weight", ".stack.blocks.attention.W_q.weight"]
    mults = jax.tree_util.tree_leaves(P.lr_multipliers(mup))
    assert mults and all(m == 1.0 for m in mults)
    assert mup.cfg.readout_multiplier == 1.0
    assert math.isclose(mup.cfg.attn_scale, (d // heads) ** -0.5, rel_tol=1e-12)

    same = eqx.tree_at(
        lambda m: (m.stack.blocks.attention.W_q.weight, m.head.weight),
        mup,
        (std.stack.blocks.attention.W_q.weight, std.head.weight),
    )
    ids = jnp.arange(12) % 28
    np.testing.assert_array_equal(np.asarray(same(ids)), np.asarray(std(ids)))
    data = bl.TimeMachine(seq_len=8)
    runs = [
        bl.train_lm(
            model,
            data,
            bl.optimizer(model, learning_rate=3e-3, weight_decay=0.01, warmup_steps=2),
            3,
            key=jax.random.key(1),
            batch_size=4,
            steps_per_call=3,
            progress=False,
        )  # fmt: skip
        for model in (std, same)
    ]
    np.testing.assert_allclose(runs[0].losses, runs[1].losses, rtol=1e-6)


def test_charlm_tied_head_at_base_width_differs_only_by_query(key):
    std = bl.CharLM(28, 32, 4, 1, max_len=16, key=key)
    mup = bl.CharLM(
        28, 32, 4, 1, max_len=16, parametrization="mup", base_width=32, key=key
    )
    differ = [
        _name(p)
        for (p, a), (_, b) in zip(_leaves(std), _leaves(mup), strict=True)
        if not np.array_equal(np.asarray(a), np.asarray(b))
    ]
    assert differ == [".stack.blocks.attention.W_q.weight"]
    assert math.isclose(mup.block.scale, 8**-0.5) and mup.block.scale == std.block.scale
    assert mup.readout_multiplier == 1.0


@pytest.mark.parametrize("d, base, heads", [(64, 16, 4), (96, 32, 2)])
def test_mup_multipliers_match_the_table_by_hand(d, base, heads):
    cfg = bl.DecoderConfig.llama(
        vocab_size=32, num_hiddens=d, num_heads=heads, num_kv_heads=1, num_blks=1,
        attn_bias=True, parametrization="mup", base_width=base,
    )  # fmt: skip
    model = bl.DecoderLM(cfg, key=jax.random.key(0))
    m = d / base
    mults = P.lr_multipliers(model)
    att = mults.stack.blocks.attention
    assert att.W_q.weight == att.W_k.weight == att.W_o.weight == 1 / m
    assert att.W_q.bias == att.W_k.bias == 1.0  # biases: constant rate
    assert mults.stack.blocks.ffn.W_2.weight == 1 / m
    assert mults.stack.blocks.norm1.weight == mults.norm.weight == 1.0
    assert mults.token_emb.weight == mults.head.weight == 1.0
    p, p0 = d // heads, (d // heads) * base // d
    assert math.isclose(cfg.attn_scale, math.sqrt(p0) / p, rel_tol=1e-12)
    assert math.isclose(cfg.readout_multiplier, base / d, rel_tol=1e-12)
    ids = jnp.arange(7)
    # the head starts at zero: give it weights to see the multiplier
    head = jax.random.normal(jax.random.key(1), model.head.weight.shape)
    model = eqx.tree_at(lambda t: t.head.weight, model, head)
    h, w = np.asarray(model.hidden(ids), np.float64), np.asarray(head, np.float64)
    ref = h @ w.T * base / d
    # float32 rounding of a d-term dot product, whatever the order of its sum:
    # |error| <= d u sum_i |h_i w_i| (u = 2^-24), plus the multiplier's rounding
    bound = (d + 2) * 2.0**-24 * (np.abs(h) @ np.abs(w).T) * base / d
    err = np.abs(np.asarray(model(ids), np.float64) - ref)
    assert np.all(err <= bound), (err - bound).max()
    # the multiplier is there: without it the logits are off by d / base
    assert np.abs(ref * d / base - ref).max() > 100 * bound.max()


def test_update_rule_against_numpy(key):
    """θ1 = θ0 − s0 (η μ g + λ θ0), with SGD's direction g, two rates (λ not × η)."""
    model = bl.CharLM(
        20, 32, 2, 1, max_len=8, parametrization="mup", base_width=8, key=key
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree_util.tree_map(
        lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params
    )
    mu = P.lr_multipliers(model)
    lam, W = 0.3, 4.0
    for eta in (1e-2, 1e-1):
        opt = bl.optimizer(
            model, optax.sgd, learning_rate=eta, weight_decay=lam, warmup_steps=W
        )
        state = opt.init(params)
        upd, _ = opt.update(grads, state, params)
        s0 = 1 / W
        for u, g, p, m in zip(
            *(jax.tree_util.tree_leaves(t) for t in (upd, grads, params)),
            jax.tree_util.tree_leaves(mu),
            strict=True,
        ):
            want = -s0 * (
                eta * m * np.asarray(g, np.float64) + lam * np.asarray(p, np.float64)
            )
            np.testing.assert_allclose(np.asarray(u), want, rtol=2e-5, atol=1e-8)
    assert {0.25, 1.0} == set(jax.tree_util.tree_leaves(mu))


def test_schedule_factor_by_hand():
    W, D, f = 4, 10, 0.1
    got = [float(schedule_factor(t, W, D, f)) for t in (0, 1, 3, 4, 9, 14, 30)]
    want = [
        0.25,
        0.5,
        1.0,
        1.0,
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)),
        0.1,
        0.1,
    ]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(schedule_factor(100, 0, 0, 0)) == 1.0


def test_base_rate_is_an_injected_hyperparameter(key):
    model = bl.CharLM(
        20, 32, 2, 1, max_len=8, parametrization="mup", base_width=8, key=key
    )
    state = bl.optimizer(model, b2=0.95, weight_decay=0.1).init(
        eqx.filter(model, eqx.is_inexact_array)
    )
    hp = state.hyperparams
    assert {"learning_rate", "weight_decay", "warmup_steps", "b2"} <= set(hp)
    assert hp["b2"].dtype == jnp.float32 and float(hp["weight_decay"]) == np.float32(
        0.1
    )


@pytest.mark.slow
def test_sweep_over_the_base_rate_matches_single_runs():
    data = bl.TimeMachine(seq_len=8)

    def make(k):
        return bl.CharLM(data.vocab_size, 32, 2, 1, max_len=8,
                         parametrization="mup", base_width=16, key=k)  # fmt: skip

    opt = bl.optimizer(eqx.filter_eval_shape(make, jax.random.key(0)), warmup_steps=2)
    rates = [1e-3, 1e-2]
    res = bl.train_sweep(
        make,
        data,
        4,
        model_keys=[0, 0],
        data_keys=[1, 1],
        run=bl.RunConfig(batch_size=4, steps_per_call=4, progress=False),
        sweep=bl.SweepConfig(learning_rates=rates, optimizer=opt, validate=False),
    )
    for k, lr in enumerate(rates):
        one = bl.train_lm(
            make(jax.random.key(0)), data,
            bl.optimizer(make(jax.random.key(0)), learning_rate=lr, warmup_steps=2),
            4, key=jax.random.key(1), batch_size=4, progress=False,
        )  # fmt: skip
        np.testing.assert_allclose(res.losses[k], one.losses, rtol=2e-5)


def test_z_loss_against_numpy(key):
    model = bl.CharLM(12, 16, 2, 1, max_len=8, key=key)
    X = jax.random.randint(jax.random.key(1), (3, 8), 0, 12)
    Y = jax.random.randint(jax.random.key(2), (3, 8), 0, 12)
    z = np.asarray(model(X), np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    ce = np.mean(lse - np.take_along_axis(z, np.asarray(Y)[..., None], -1)[..., 0])
    for alpha in (0.0, 1e-4, 0.5):
        got = float(bl.lm_loss(model, X, Y, z_loss=alpha))
        assert math.isclose(got, ce + alpha * np.mean(lse**2), rel_tol=1e-5)


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda: bl.DecoderConfig.llama(parametrization="mup", base_width=0),
            "base_width",
        ),
        (
            lambda: bl.DecoderConfig.llama(parametrization="mup", base_width=-8),
            "base_width",
        ),
        (lambda: bl.DecoderConfig.llama(parametrization="mup"), "needs base_width"),
        # d=64, 4 heads: p=16 at base 6 would be 1.5
        (
            lambda: bl.DecoderConfig.llama(parametrization="mup", base_width=6),
            "head_dim",
        ),
        (
            lambda: bl.DecoderConfig.llama(parametrization="muP", base_width=8),
            "'standard', 'mup'",
        ),
        (
            lambda: bl.CharLM(28, 32, 4, parametrization="ntk", key=jax.random.key(0)),
            "parametrization",
        ),
        (
            lambda: bl.CharLM(
                28, 32, 4, parametrization="mup", base_width=5, key=jax.random.key(0)
            ),
            "base_width=5",
        ),
    ],
)
def test_bad_parametrization_is_named(build, match):
    with pytest.raises(bl.ConfigError, match=match):
        build()


def test_bad_optimizer_input_is_named(key):
    model = bl.CharLM(
        20, 32, 2, 1, max_len=8, parametrization="mup", base_width=8, key=key
    )
    mults = P.lr_multipliers(model)
    short = jax.tree_util.tree_leaves(mults)[:-1]
    with pytest.raises(bl.ConfigError, match="does not match the model"):
        bl.optimizer(model, multipliers=short)
    other = P.lr_multipliers(bl.CharLM(20, 32, 2, 2, max_len=8, key=key))
    bl.optimizer(model, multipliers=mults)  # its own tree is fine
    with pytest.raises(bl.ConfigError, match="multipliers"):
        bl.optimizer(bl.DecoderLM(bl.DecoderConfig.llama(), key=key), multipliers=other)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(bl.ConfigError, match="weight_decay"):
            bl.optimizer(model, weight_decay=bad)
        with pytest.raises(bl.ConfigError, match="z_loss"):
            bl.lm_loss(
                model, jnp.zeros((1, 4), int), jnp.zeros((1, 4), int), z_loss=bad
            )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(learning_rat=1e-3),
            r"unknown hyperparameter 'learning_rat' for adam; valid: \[.*'b2'",
        ),
        (dict(learning_rate=1e-3, b2="0.95"), r"b2 must be a number, got '0.95'"),
    ],
)
def test_optimizer_refuses_a_misspelt_or_textual_hyperparameter(
    kwargs, match, plain_python
):
    """Both were accepted and failed only at the first step."""
    model = bl.CharLM(28, 16, 2, 1, key=jax.random.key(0))
    with pytest.raises(bl.ConfigError, match=match):
        bl.optimizer(model, optax.adam, **kwargs)
    assert bl.optimizer(model, optax.adam, learning_rate=1e-3, b2=0.95) is not None


def test_coord_check_refuses_a_model_factory_that_is_not_callable(plain_python):
    with pytest.raises(
        bl.ConfigError, match=r"coord_check: make_model must be a function"
    ):
        bl.coord_check(3, [16, 32])
