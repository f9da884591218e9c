"""`train_sweep` over any injected hyperparameter (here a learning rate and a
warm-up length) x independent model and data seeds, against a float64 NumPy
loop; grids, look-up by value, and the errors (one range rule per optax
hyperparameter, shared with `train_model`)."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from regression import B, D, Linear, mse
from regression import regression_batch as source

from blocklab import (
    RunConfig,
    SweepConfig,
    sharded_map,
    sweep_grid,
    train_model,
    train_sweep,
)
from blocklab._validate import ConfigError
from blocklab.training.member_axis import check_seeds
from blocklab.training.sweep import sweep_optimizer

STEPS = 6


def make_model(key):
    return Linear(0.1 * jax.random.normal(key, (D,), jnp.float32), jnp.zeros(()))


def sgd_warmup(learning_rate, warmup):
    """SGD whose rate ramps linearly to `learning_rate` over `warmup` steps."""
    return optax.sgd(lambda t: learning_rate * jnp.minimum(1.0, (t + 1) / warmup))


OPT = optax.inject_hyperparams(sgd_warmup, hyperparam_dtype=jnp.float32)(
    learning_rate=1.0, warmup=1.0
)
GRID = sweep_grid(
    learning_rate=[0.05, 0.2], warmup=[1.0, 4.0], model_seed=[0, 1], data_seed=[7, 8]
)


def reference(lr, warmup, model_seed, data_seed):
    """The member's run as a float64 NumPy loop (batches drawn by the source)."""
    m = make_model(jax.random.key(model_seed))
    w, b = np.asarray(m.w, np.float64), 0.0
    losses = []
    for s in range(STEPS):
        batch = source(jax.random.fold_in(jax.random.key(data_seed), s))
        x, y = (np.asarray(a, np.float64) for a in batch)
        r = x @ w + b - y
        losses.append(np.mean(r**2))
        rate = lr * min(1.0, (s + 1) / warmup)
        w, b = w - rate * 2 * x.T @ r / B, b - rate * 2 * r.mean()
    return np.array(losses), w


@pytest.fixture(scope="module")
def result():
    return train_sweep(
        make_model,
        source,
        STEPS,
        model_keys=GRID["model_seed"],
        data_keys=GRID["data_seed"],
        loss_fn=mse,
        run=RunConfig(steps_per_call=4, progress=False),
        sweep=SweepConfig(
            hyperparams={
                "learning_rate": GRID["learning_rate"],
                "warmup": GRID["warmup"],
            },
            optimizer=OPT,
            probe=lambda m: m.w,
        ),
    )


def test_every_member_equals_its_float64_reference(result):
    assert result.num_members == 16
    for k in range(16):
        args = [
            GRID[n][k] for n in ("learning_rate", "warmup", "model_seed", "data_seed")
        ]
        losses, w = reference(*args)
        np.testing.assert_allclose(
            result.losses[k], losses, rtol=2e-5, err_msg=str(args)
        )
        np.testing.assert_allclose(result.state.model.w[k], w, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(result.diverged_at, 0)
    assert np.all(np.isnan(result.val_loss))  # a general source: no validation


def test_hyperparameters_live_in_the_optimizer_state(result):
    hyper = result.state.opt_state.hyperparams
    np.testing.assert_array_equal(hyper["warmup"], np.float32(GRID["warmup"]))
    np.testing.assert_array_equal(
        result.hyperparams["learning_rate"], result.learning_rates
    )


def test_model_and_data_seeds_are_independent_axes(result):
    init = result.probes[:, 0]  # (16, D) weights at step 0
    for k, j in itertools.combinations(range(16), 2):
        same_model = GRID["model_seed"][k] == GRID["model_seed"][j]
        assert np.array_equal(init[k], init[j]) == same_model
    # Same model seed and hyperparameters, other data seed: other batches.
    a = result.select(learning_rate=0.2, warmup=4.0, model_seed=0, data_seed=7)
    b = result.select(learning_rate=0.2, warmup=4.0, model_seed=0, data_seed=8)
    assert a.num_members == b.num_members == 1
    assert not np.array_equal(a.losses, b.losses)


def test_select_looks_members_up_by_value(result):
    sub = result.select(learning_rate=0.05, warmup=4.0)
    assert sub.num_members == 4  # 2 model seeds x 2 data seeds
    idx = result.index(learning_rate=0.05, warmup=4.0)
    expected = [
        k for k in range(16)
        if GRID["learning_rate"][k] == 0.05 and GRID["warmup"][k] == 4.0
    ]  # fmt: skip
    expected = np.asarray(expected)
    np.testing.assert_array_equal(idx, expected)
    np.testing.assert_array_equal(sub.losses, result.losses[expected])
    np.testing.assert_array_equal(sub.state.model.w, result.state.model.w[expected])
    np.testing.assert_array_equal(sub.probes, result.probes[expected])
    assert sub.runs()[0].losses.shape == (STEPS,)
    with pytest.raises(ConfigError, match="no swept hyperparameter or seed named 'b1'"):
        result.select(b1=0.9)
    with pytest.raises(ConfigError, match=r"no member has .*learning_rate: \[0.05"):
        result.select(learning_rate=0.1)


def test_sweep_grid_is_the_cartesian_product_last_axis_fastest():
    g = sweep_grid(a=[1, 2], b=[0.5, 0.25, 0.125])
    rows = list(itertools.product([1, 2], [0.5, 0.25, 0.125]))
    np.testing.assert_array_equal(g["a"], [r[0] for r in rows])
    np.testing.assert_array_equal(g["b"], [r[1] for r in rows])
    with pytest.raises(ConfigError, match="axis b is empty"):
        sweep_grid(a=[1], b=[])
    with pytest.raises(ConfigError, match="at least one axis"):
        sweep_grid()
    with pytest.raises(ConfigError, match="axis a must hold numbers"):
        sweep_grid(a=["x"])


def sweep(**kw):
    """`train_sweep` of two members; `kw` holds its keys and the fields of
    its `RunConfig` and `SweepConfig`."""
    args = dict(model_keys=[0, 1], data_keys=[0, 1], loss_fn=mse)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    run = RunConfig(progress=False, **{k: kw.pop(k) for k in list(kw) if k in RUN})
    return train_sweep(make_model, source, 2, **args, run=run, sweep=SweepConfig(**kw))


RUN = {f.name for f in dataclasses.fields(RunConfig)}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(hyperparams={"learning_rat": 0.1}, optimizer=OPT),
         r"no hyperparameter 'learning_rat'; it has \['learning_rate', 'warmup'\]"),
        (dict(hyperparams={"learning_rate": [0.1, 0.2, 0.3]}, optimizer=OPT),
         "learning_rate has 3 values .* K=2 members"),
        (dict(learning_rates=0.1, hyperparams={"learning_rate": 0.1}, optimizer=OPT),
         "give the learning rate once"),
        (dict(learning_rates=[0.1, 0.0]), r"learning_rate of member 1 must be in \(0"),
        (dict(learning_rates=[0.1, -1.0]), r"learning_rate of member 1 .* got -1"),
        (dict(learning_rates=[0.1, float("nan")]), "must be finite"),
        (dict(hyperparams={"weight_decay": 0.1}, optimizer=optax.adamw(0.1)),
         "inject_hyperparams"),
        (dict(), "learning_rates is required with the default optimizer"),
        (dict(learning_rates=0.1, model_keys=[0, 1], data_keys=[0, 1, 2]),
         "same length, got 2 and 3"),
        (dict(learning_rates=0.1, model_keys=[0, -1]), r"model_keys\[1\] must lie in"),
        (dict(learning_rates=0.1, model_keys=[0, True]),
         r"model_keys\[1\] must be an int"),
        (dict(learning_rates=0.1, model_keys=[], data_keys=[]), "at least one"),
        (dict(learning_rates=0.1, steps_per_call=0), "steps_per_call must lie in"),
    ],
)  # fmt: skip
def test_bad_sweeps_raise_naming_the_problem(kw, match):
    with pytest.raises(ConfigError, match=match):
        sweep(**kw)


# One range rule per optax hyperparameter, in sweeps and in train_model.
BAD_HPARAMS = [
    (optax.adamw, "weight_decay", -0.1, r"\[0, inf\)"),
    (optax.adam, "b1", 1.5, r"\[0, 1\)"),
    (optax.adam, "b2", 1.0, r"\[0, 1\)"),
    (optax.adam, "eps", -1e-3, r"\[0, inf\)"),
    (optax.sgd, "momentum", 1.2, r"\[0, 1\)"),
    (optax.rmsprop, "decay", -0.5, r"\[0, 1\)"),
    (optax.sgd, "learning_rate", -0.5, r"\(0, inf\)"),
]


def train_one(opt, steps=2):
    return train_model(
        make_model(jax.random.key(0)),
        source,
        opt,
        steps,
        key=jax.random.key(0),
        loss_fn=mse,
        run=RunConfig(progress=False),
    )


@pytest.mark.parametrize(("opt", "name", "bad", "valid"), BAD_HPARAMS)
def test_sweeps_and_train_model_share_one_range_rule(opt, name, bad, valid):
    good = {"learning_rate": 0.1}
    # swept: the message names the member
    swept = (
        {**good, name: [0.0, bad]} if name != "learning_rate" else {name: [0.1, bad]}
    )
    with pytest.raises(ConfigError, match=rf"{name} of member 1 must be in {valid}"):
        sweep(hyperparams=swept, optimizer=sweep_optimizer(opt))
    # fixed in the injected optimizer, not swept: still refused
    fixed = optax.inject_hyperparams(opt)(**{**good, name: bad})
    with pytest.raises(ConfigError, match=rf"{name} .*must be in {valid}.*, got"):
        sweep(hyperparams={}, optimizer=fixed)
    with pytest.raises(ConfigError, match=rf"train_model: hyperparameter {name} must"):
        train_one(fixed)


def test_a_negative_rate_fixed_inside_an_injected_optimizer_is_refused():
    opt = optax.inject_hyperparams(lambda momentum: optax.sgd(-0.5, momentum))(
        momentum=0.9
    )
    with pytest.raises(ConfigError, match="member 0 climbs the gradient"):
        sweep(hyperparams={"momentum": [0.5, 0.9]}, optimizer=opt)
    with pytest.raises(ConfigError, match="climbs the gradient"):
        train_one(optax.sgd(-0.5, 0.9))


def test_edge_values_inside_the_ranges_are_accepted():
    res = sweep(
        hyperparams={
            "learning_rate": [0.05, 0.1], "b1": [0.0, 0.9], "weight_decay": [0.0, 0.1]
        },
        optimizer=sweep_optimizer(optax.adamw),
    )  # fmt: skip
    assert np.all(np.isfinite(res.losses))


def test_zero_steps_is_refused():
    with pytest.raises(ConfigError, match=r"train_sweep: num_steps must lie in \[1"):
        train_sweep(
            make_model,
            source,
            0,
            model_keys=[0],
            data_keys=[0],
            loss_fn=mse,
            sweep=SweepConfig(learning_rates=0.1),
        )


def test_seeds_rule():
    assert check_seeds([0, np.int64(3), 2**32 - 1], name="--seeds", _owner="cmd") == (
        0,
        3,
        2**32 - 1,
    )
    assert check_seeds([1, 1], name="keys", distinct=False, _owner="s") == (1, 1)
    for bad, match in [
        ([1, 1], r"--seeds must be distinct, got \[1, 1\] \(repeated: \[1\]\)"),
        ([-1], r"--seeds\[0\] must lie in \[0, 4294967295\], got -1"),
        ([2**32], r"--seeds\[0\] must lie in"),
        ([1.0], r"--seeds\[0\] must be an int"),
        ([False], r"--seeds\[0\] must be an int"),
        ([], "at least one seed"),
        ("12", "must be a sequence of int seeds"),
    ]:
        with pytest.raises(ConfigError, match=match):
            check_seeds(bad, name="--seeds", _owner="cmd")


def test_sharded_map_refuses_negative_seeds():
    with pytest.raises(ConfigError, match=r"sharded_map: keys\[1\] must lie in"):
        sharded_map(lambda k: jax.random.normal(k, ()), [3, -2])


def test_sweep_optimizer_injects_every_numeric_argument():
    opt = sweep_optimizer(optax.adamw, weight_decay=0.1, b2=0.95)
    hyper = opt.init({"w": jnp.zeros(2, jnp.float32)}).hyperparams
    assert {"learning_rate", "weight_decay", "b1", "b2"} <= set(hyper)
    assert all(hyper[n].dtype == jnp.float32 for n in ("learning_rate", "b2"))


def test_sweep_chunks_do_not_retrace():
    def counting(traces):
        def loss_fn(model, batch, key):
            traces.append(1)
            return mse(model, batch, key)

        return loss_fn

    one, three = [], []
    for steps, traces in ((2, one), (6, three)):
        train_sweep(
            make_model,
            source,
            steps,
            model_keys=[0, 1],
            data_keys=[2, 3],
            loss_fn=counting(traces),
            run=RunConfig(steps_per_call=2, progress=False),
            sweep=SweepConfig(learning_rates=0.1),
        )
    assert len(three) == len(one) >= 2
