"""Gradient accumulation (`microbatches=`, issue 36): the mean of the
microbatches' gradients is the full batch's (closed form for a quadratic
loss), `train_model` takes the same steps with 1, 2 or 4 microbatches, with a
remat policy and on a mesh; a count that does not divide the batch is refused
by name."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from blocklab import ConfigError, DecoderConfig, DecoderLM, RunConfig, SweepConfig
from blocklab.training.run import train_model
from blocklab.training.step import accumulate, make_train_step, split_microbatches


def test_accumulated_gradient_is_the_full_batch_gradient_in_closed_form():
    # L(w) = mean_i (x_i . w - y_i)^2 over 8 rows; dL/dw = 2/n X^T (X w - y)
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(8, 3)), rng.normal(size=8)
    w = rng.normal(size=3)

    def loss_of(p, batch, key):
        xb, yb = batch
        r = xb @ p - yb
        return jnp.mean(r**2), {"sq": jnp.mean(r**2), "rows": jnp.sum(r > -jnp.inf)}

    batch = (jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32))
    loss, aux, grad = accumulate(
        loss_of, jnp.asarray(w, jnp.float32), batch, jax.random.key(0), 4
    )
    r = X @ w - y
    np.testing.assert_allclose(loss, np.mean(r**2), rtol=1e-5)
    np.testing.assert_allclose(grad, 2 / 8 * X.T @ r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux["sq"], np.mean(r**2), rtol=1e-5)  # mean
    assert float(aux["rows"]) == 8  # summed over the 4 microbatches of 2 rows
    # microbatch j holds rows j, j + k, ... (strided)
    parts = split_microbatches(jnp.arange(8), 4)
    np.testing.assert_array_equal(parts, [[0, 4], [1, 5], [2, 6], [3, 7]])


def _model():
    cfg = DecoderConfig.llama(
        vocab_size=32, num_hiddens=16, num_heads=2, num_blks=2, max_len=8
    )
    return DecoderLM(cfg, key=jax.random.key(0))


def _source(key):
    X = jax.random.randint(key, (4, 9), 0, 32)
    return X[:, :-1], X[:, 1:]


def _train(k, **kw):
    return train_model(
        _model(), _source, optax.sgd(0.5), 2, key=jax.random.key(1),
        run=RunConfig(microbatches=k, progress=False, **kw),
    )  # fmt: skip


def _params(r):
    return jax.tree.leaves(eqx.filter(r.model, eqx.is_inexact_array))


@pytest.mark.slow  # CI time: the default suite keeps the cheaper checks of this feature
def test_train_model_takes_the_full_batch_steps_with_microbatches():
    full, four = _train(1), _train(4, remat="dots")
    np.testing.assert_allclose(four.losses, full.losses, rtol=1e-5)
    for a, b in zip(_params(four), _params(full), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert four.model.stack.remat == "dots"


@pytest.mark.slow
def test_microbatches_on_a_mesh_take_the_same_steps():
    from blocklab.training.placement import mesh_of

    full, two = _train(1), _train(2, mesh=mesh_of("data=1"))
    np.testing.assert_allclose(two.losses, full.losses, rtol=1e-5)
    for a, b in zip(_params(two), _params(full), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_microbatches_that_do_not_divide_the_batch_are_refused():
    with pytest.raises(ConfigError, match=r"microbatches=3 does not divide .*4 rows"):
        _train(3)
    with pytest.raises(ConfigError, match="microbatches must lie in"):
        make_train_step(optax.sgd(0.1), _source, microbatches=0)


@pytest.mark.slow
def test_a_sweep_with_microbatches_takes_its_members_full_batch_steps():
    from blocklab.training.sweep import train_sweep

    def sweep(k):
        return train_sweep(
            _model(),
            _source,
            2,
            data_keys=jax.random.split(jax.random.key(1), 2),
            run=RunConfig(steps_per_call=2, microbatches=k, progress=False),
            sweep=SweepConfig(
                learning_rates=[0.5, 0.25],
                optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.5),
            ),
        )

    full, two = sweep(1), sweep(2)
    np.testing.assert_allclose(two.losses, full.losses, rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(two.state.model, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(full.state.model, eqx.is_inexact_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="microbatches=3 does not divide"):
        sweep(3)
