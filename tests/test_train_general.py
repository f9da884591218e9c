"""The general training step: any model, loss (with or without aux) and batch source;
errors checked once by tracing; a frozen run cannot recover after a non-finite step;
a host source (iterator, generator, list, `host_source`) gives a fresh batch every
step."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from regression import B, D, Linear, mse, regression_batch

from blocklab import (
    CharLM,
    RunConfig,
    SweepConfig,
    TimeMachine,
    TokenDataset,
    host_source,
    make_train_step,
    train_lm,
    train_model,
    train_sweep,
)
from blocklab._validate import ConfigError
from blocklab.training.step import init_state, step_keys


class RegressionSource(eqx.Module):
    """The same source in the method form, `source.batch(key)`."""

    scale: jax.Array

    def batch(self, key):
        x, y = regression_batch(key)
        return x, self.scale * y


def mse_with_aux(model, batch, key):
    x, y = batch
    r = model(x) - y
    return jnp.mean(r**2), {"max_abs_residual": jnp.max(jnp.abs(r))}


def zero_model():
    return Linear(jnp.zeros(D, jnp.float32), jnp.zeros((), jnp.float32))


def test_sgd_steps_equal_a_float64_numpy_loop():
    lr, n = 0.1, 4
    step = make_train_step(optax.sgd(lr), regression_batch, loss_fn=mse)
    keys = step_keys(jax.random.key(0), 0, n)
    state, losses = eqx.filter_jit(step.scan)(
        init_state(zero_model(), optax.sgd(lr)), keys
    )
    w, b = np.zeros(D), 0.0
    for s, k in enumerate(keys):
        x, y = (np.asarray(a, np.float64) for a in regression_batch(k))
        r = x @ w + b - y
        assert losses[s] == pytest.approx(np.mean(r**2), rel=1e-5)
        w, b = w - lr * 2 * x.T @ r / B, b - lr * 2 * r.mean()  # d/dw mean(r^2)
    np.testing.assert_allclose(state.model.w, w, rtol=1e-5)
    np.testing.assert_allclose(state.model.b, b, rtol=1e-5, atol=1e-7)
    assert int(state.step) == n and bool(state.finite)


def test_callable_and_method_sources_give_the_same_run():
    run = dict(key=jax.random.key(1), loss_fn=mse, run=RunConfig(progress=False))
    a = train_model(zero_model(), regression_batch, optax.adam(0.1), 6, **run)
    b = train_model(
        zero_model(), RegressionSource(jnp.float32(1.0)), optax.adam(0.1), 6, **run
    )
    np.testing.assert_array_equal(a.losses, b.losses)
    np.testing.assert_array_equal(a.model.w, b.model.w)
    assert np.isnan(a.val_loss) and a.aux is None


def test_aux_is_returned_per_step_and_equals_its_definition():
    opt = optax.sgd(0.05)
    res = train_model(
        zero_model(),
        regression_batch,
        opt,
        3,
        key=jax.random.key(2),
        loss_fn=mse_with_aux,
        run=RunConfig(steps_per_call=2, progress=False),
    )
    assert res.aux["max_abs_residual"].shape == (3,)
    # Step 0 starts from the zero model: the residual is -y of the first batch.
    _, y = regression_batch(step_keys(jax.random.key(2), 0, 1)[0])
    assert res.aux["max_abs_residual"][0] == pytest.approx(float(np.abs(y).max()))
    # The step itself returns (loss, aux).
    step = make_train_step(opt, regression_batch, loss_fn=mse_with_aux)
    _, (loss, aux) = step(init_state(zero_model(), opt), jax.random.key(3))
    assert loss.shape == () and set(aux) == {"max_abs_residual"}


def poisoned(bad_key):
    """`mse`, but NaN on the step whose loss key equals `bad_key` (one step only)."""
    bad = jax.random.key_data(bad_key)

    def loss_fn(model, batch, key):
        hit = jnp.all(jax.random.key_data(key) == bad)
        return jnp.where(hit, jnp.nan, mse(model, batch, key))

    return loss_fn


def test_a_frozen_run_stays_frozen_although_later_steps_are_finite():
    """Only step 3 is non-finite; steps 4..6 would be fine. With `ok = finite`
    (dropping `state.finite &`) they would apply and the run would 'recover'."""
    key = jax.random.key(4)
    keys = step_keys(key, 0, 6)
    loss_fn = poisoned(jax.random.fold_in(keys[2], 1))  # step 3's loss key
    opt = optax.sgd(0.1)
    step = make_train_step(opt, regression_batch, loss_fn=loss_fn)
    state, losses = eqx.filter_jit(step.scan)(init_state(zero_model(), opt), keys)
    assert np.all(np.isfinite(losses[:2])) and np.all(np.isnan(losses[2:]))
    assert int(state.step) == 2 and not bool(state.finite)
    clean = make_train_step(opt, regression_batch, loss_fn=mse)
    two, _ = eqx.filter_jit(clean.scan)(init_state(zero_model(), opt), keys[:2])
    np.testing.assert_array_equal(state.model.w, two.model.w)
    # The loop reports the stop and keeps the model after step 2.
    with pytest.warns(RuntimeWarning, match="at step 3"):
        res = train_model(
            zero_model(),
            regression_batch,
            opt,
            6,
            key=key,
            loss_fn=loss_fn,
            run=RunConfig(steps_per_call=6, progress=False),
        )
    assert res.losses.shape == (2,)
    np.testing.assert_array_equal(res.model.w, two.model.w)


def _assert_refused(loss_fn, match, steps=1):
    """`train_model` refuses `loss_fn` with a ConfigError matching `match`."""
    with pytest.raises(ConfigError, match=match):
        train_model(
            zero_model(),
            regression_batch,
            optax.sgd(0.1),
            steps,
            key=jax.random.key(0),
            loss_fn=loss_fn,
        )


def test_non_scalar_loss_is_refused_before_the_run():
    def per_example(model, batch, key):
        x, y = batch
        return (model(x) - y) ** 2  # forgot .mean()

    _assert_refused(per_example, r"real scalar loss.*float32\[5\]", steps=2)


def test_integer_loss_and_three_outputs_are_refused():
    _assert_refused(lambda m, b, k: jnp.int32(1), "real scalar loss")
    _assert_refused(lambda m, b, k: (mse(m, b, k), 1.0, 2.0), "real scalar loss.*tuple")


def test_a_batch_the_loss_cannot_take_names_its_shapes():
    def wrong(key):  # 4 features for a 3-weight model
        return jnp.ones((B, 4)), jnp.ones(B)

    with pytest.raises(ConfigError, match=r"failed on a batch of.*float\d+\[5, 4\]"):
        train_model(
            zero_model(), wrong, optax.sgd(0.1), 1, key=jax.random.key(0), loss_fn=mse
        )


def test_a_source_that_returns_no_arrays_is_refused():
    with pytest.raises(ConfigError, match="batch source failed"):
        train_model(
            zero_model(),
            lambda key: "not a batch",
            optax.sgd(0.1),
            1,
            key=jax.random.key(0),
            loss_fn=mse,
        )


@pytest.mark.parametrize(
    "source",
    [
        lambda key: (jnp.zeros((2, 4)), jnp.zeros((2, 4), jnp.int32)),  # float X
        lambda key: (jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 3), jnp.int32)),
        lambda key: jnp.zeros((2, 4), jnp.int32),  # not a pair
    ],
)
def test_the_next_token_loss_checks_its_batches(source):
    model = CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(0))
    with pytest.raises(ConfigError, match=r"next-token loss takes batches \(X, Y\)"):
        train_model(model, source, optax.sgd(0.1), 1, key=jax.random.key(0))


def test_bad_step_options():
    with pytest.raises(ConfigError, match="precision must be one of"):
        make_train_step(optax.sgd(0.1), regression_batch, precision="fp8")
    with pytest.raises(ConfigError, match="batch_size applies to token datasets"):
        make_train_step(optax.sgd(0.1), regression_batch, batch_size=4)
    with pytest.raises(ConfigError, match="source must be a batch source"):
        make_train_step(optax.sgd(0.1), np.zeros(3))
    with pytest.raises(ConfigError, match="loss_fn must be callable"):
        make_train_step(optax.sgd(0.1), regression_batch, loss_fn="mse")
    # (a TypeError: under the test suite's type-checking hook it comes from there)
    with pytest.raises(TypeError, match="data"):
        train_lm(
            zero_model(), regression_batch, optax.sgd(0.1), 1, key=jax.random.key(0)
        )


def test_train_lm_runs_on_a_token_dataset_like_on_the_time_machine(tmp_path):
    """TimeMachine over a file and TokenDataset over the same ids: one run."""
    text = "the quick brown fox jumps over the lazy dog " * 6
    path = tmp_path / "fox.txt"
    path.write_text(text)
    tm = TimeMachine(seq_len=8, num_train=200, num_val=10, path=path)
    tokens = TokenDataset(
        np.asarray(tm.corpus), 8, num_train=200, num_val=10, vocab_size=28
    )
    model = CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(0))
    run = dict(key=jax.random.key(1), batch_size=4, progress=False)
    a = train_lm(model, tm, optax.adam(1e-2), 3, **run)
    b = train_lm(model, tokens, optax.adam(1e-2), 3, **run)
    np.testing.assert_array_equal(a.losses, b.losses)
    assert a.val_loss == b.val_loss


def counting(traces):
    """`mse` that records each time it is traced (a Python side effect)."""

    def loss_fn(model, batch, key):
        traces.append(1)
        return mse(model, batch, key)

    return loss_fn


def test_chunks_do_not_retrace():
    """Compiled once per configuration: 3 chunks cost the traces of 1 (the
    check's eval_shape and the compile), and a rerun only the check's."""
    run = dict(key=jax.random.key(0), run=RunConfig(steps_per_call=2, progress=False))
    one, three = [], []
    train_model(zero_model(), regression_batch, optax.sgd(0.1), 2,
                loss_fn=counting(one), **run)  # fmt: skip
    fn, opt = counting(three), optax.sgd(0.1)  # the optimizer is static: reuse it
    train_model(zero_model(), regression_batch, opt, 6, loss_fn=fn, **run)
    assert len(three) == len(one) >= 2
    three.clear()
    train_model(zero_model(), regression_batch, opt, 6, loss_fn=fn, **run)
    assert len(three) == 1  # TrainStep.check only: the chunk was cached


# -- host sources: drawn every step, never traced once (issue 23, item 1) ----


def _batches(n, seed=0, rows=4, dim=3):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(rows, dim)).astype(np.float32),
            rng.normal(size=rows).astype(np.float32),
        )
        for _ in range(n)
    ]


def _sgd_reference(batches, lr):
    """Losses of plain SGD on `batches` in order, in float64 NumPy."""
    w = np.zeros(batches[0][0].shape[1])
    out = []
    for x, y in batches:
        x, y = x.astype(np.float64), y.astype(np.float64)
        r = x @ w - y
        out.append(np.mean(r**2))
        w = w - lr * 2 * x.T @ r / len(y)
    return np.array(out), w


def _train(source, n, steps_per_call=3):
    return train_model(
        Linear(jnp.zeros(3)),
        source,
        optax.sgd(0.1),
        n,
        key=jax.random.key(0),
        loss_fn=mse,
        run=RunConfig(steps_per_call=steps_per_call, progress=False),
    )


def test_a_callable_reading_an_iterator_is_refused_not_frozen():
    it = iter(_batches(6))
    with pytest.raises(ConfigError, match=r"host_source.*Supported: a pure source"):
        _train(lambda key: next(it), 4)
    rng = np.random.default_rng(0)  # a host random generator is not pure either
    with pytest.raises(ConfigError, match="side effects"):
        _train(lambda key: (rng.normal(size=(4, 3)), rng.normal(size=4)), 4)


@pytest.mark.parametrize(
    "wrap",
    [
        iter,  # an iterator
        lambda bs: (b for b in bs),  # a generator
        list,  # an iterable
        # a host callable (the default binds one iterator per source)
        lambda bs: host_source(lambda key, it=iter(bs): next(it)),  # noqa: B008
    ],
    ids=["iterator", "generator", "list", "host_source"],
)
def test_a_host_source_trains_on_a_fresh_batch_every_step(wrap):
    batches = _batches(7)
    ref, w = _sgd_reference(batches, 0.1)
    res = _train(wrap(batches), 7)
    np.testing.assert_allclose(res.losses, ref, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(res.model.w), w, rtol=2e-5, atol=1e-6)
    assert res.stopped is None


def test_a_host_source_that_runs_out_keeps_the_finished_steps():
    batches = _batches(5)
    ref, w = _sgd_reference(batches, 0.1)
    with pytest.warns(UserWarning, match="ran out after 5 of 9 steps"):
        res = _train(iter(batches), 9, steps_per_call=2)
    assert "ran out after 5 of 9" in res.stopped
    np.testing.assert_allclose(res.losses, ref, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(res.model.w), w, rtol=2e-5, atol=1e-6)
    assert int(res.state.step) == 5


def test_host_source_gets_each_steps_key():
    seen = []

    def fn(key):
        seen.append(np.asarray(jax.random.key_data(key)))
        return _batches(1)[0]

    _train(host_source(fn), 4)
    want = np.asarray(jax.random.key_data(step_keys(jax.random.key(0), 0, 4)))
    # the first call is the shape check (key 0), then one per step
    np.testing.assert_array_equal(np.stack(seen[-4:]), want)
    assert len(seen) == 4  # the checking draw is the first step's batch


def test_host_source_refusals():
    with pytest.raises(ConfigError, match="yielded no batch"):
        _train(iter([]), 2)
    bad = _batches(2) + [(np.zeros((5, 3), np.float32), np.zeros(5, np.float32))]
    with pytest.raises(ConfigError, match="batch 2 has structure"):
        _train(iter(bad), 3)
    # train_sweep takes a host iterable (every member trains on batch s at
    # step s), but not a host callable: K members have no one key to give it.
    with pytest.raises(ConfigError, match="host callable"):
        train_sweep(
            lambda k: Linear(jnp.zeros(3)),
            host_source(lambda key: _batches(1)[0]),
            2,
            model_keys=[0, 1],
            data_keys=[0, 1],
            loss_fn=mse,
            run=RunConfig(progress=False),
            sweep=SweepConfig(learning_rates=[0.1, 0.2]),
        )


def test_a_pure_source_with_a_fixed_batch_is_still_accepted():
    x, y = _batches(1)[0]
    ref, _ = _sgd_reference([(x, y)] * 3, 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = _train(lambda key: (jnp.asarray(x), jnp.asarray(y)), 3)
    np.testing.assert_allclose(res.losses, ref, rtol=2e-5)
