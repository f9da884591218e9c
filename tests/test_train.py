"""Training: the loss, the pure step (vs a hand-written optax step), fusion, vmap,
the train_lm loop, validation and the non-finite stop; every loss and model
refuses ids and targets outside its vocabulary."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from blocklab import (
    CharLM,
    DecoderConfig,
    DecoderLM,
    TimeMachine,
    TokenDataset,
    lm_loss,
    make_train_step,
    train_lm,
)
from blocklab._validate import ConfigError
from blocklab.models import MoEDecoderConfig
from blocklab.training.losses import moe_loss
from blocklab.training.step import init_state, step_keys, validation_loss


@pytest.fixture(scope="module")
def data():
    return TimeMachine(seq_len=8, num_train=200, num_val=20)


@pytest.fixture(scope="module")
def model():
    return CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(0))


jit_lm_loss = eqx.filter_jit(lm_loss)


def params(m):
    return jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_inexact_array))


def assert_models_close(a, b, rtol=1e-6, atol=1e-7):
    for x, y in zip(params(a), params(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_lm_loss_is_mean_cross_entropy(model, data):
    X, Y = data.train_batch(jax.random.key(1), 4)
    logits = np.asarray(eqx.filter_jit(jax.vmap(model))(X), np.float64)
    logz = np.log(np.exp(logits).sum(-1))
    picked = np.take_along_axis(logits, np.asarray(Y)[..., None], -1)[..., 0]
    np.testing.assert_allclose(
        jit_lm_loss(model, X, Y), np.mean(logz - picked), rtol=1e-6
    )


def test_lm_loss_of_uniform_logits_is_log_vocab():
    X = jnp.zeros((3, 5), jnp.int32)
    Y = jnp.arange(15).reshape(3, 5) % 28
    loss = lm_loss(lambda x: jnp.zeros((*x.shape, 28), jnp.float32), X, Y)
    np.testing.assert_allclose(loss, np.log(28), rtol=1e-6)


def test_step_equals_a_hand_written_optax_step(model, data):
    opt = optax.adamw(1e-2, weight_decay=0.0)
    step = make_train_step(opt, data, batch_size=4)
    key = jax.random.key(2)
    new, loss = eqx.filter_jit(step)(init_state(model, opt), key)

    X, Y = data.train_batch(key, 4)
    p = eqx.filter(model, eqx.is_inexact_array)
    ref_loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lm_loss))(model, X, Y)
    updates, _ = opt.update(grads, opt.init(p), p)
    expected = eqx.apply_updates(model, updates)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    # Adam's first step is about lr * sign(g): float32 noise in tiny g shows up
    assert_models_close(new.model, expected, rtol=1e-5, atol=1e-5)
    assert int(new.step) == 1 and bool(new.finite)


def test_fused_scan_equals_single_steps_and_vmap_equals_separate_runs(model, data):
    opt = optax.adam(1e-2)
    step = make_train_step(opt, data, batch_size=4)
    keys = step_keys(jax.random.key(3), 0, 3)
    one = eqx.filter_jit(step)
    state, losses = init_state(model, opt), []
    for k in keys:
        state, loss = one(state, k)
        losses.append(loss)
    fused, fused_losses = eqx.filter_jit(step.scan)(init_state(model, opt), keys)
    np.testing.assert_allclose(fused_losses, losses, rtol=1e-5)
    assert_models_close(fused.model, state.model, rtol=1e-5, atol=1e-6)

    # a second seed, run alongside the first with vmap (the sweep's building block)
    other = CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(9))
    keys2 = step_keys(jax.random.key(4), 0, 3)
    alone, alone_losses = eqx.filter_jit(step.scan)(init_state(other, opt), keys2)
    states = jax.tree_util.tree_map(
        lambda a, b: jnp.stack([a, b]), init_state(model, opt), init_state(other, opt)
    )
    both, both_losses = eqx.filter_jit(eqx.filter_vmap(step.scan))(
        states, jnp.stack([keys, keys2])
    )
    np.testing.assert_allclose(both_losses, [fused_losses, alone_losses], rtol=1e-5)


def test_step_keys_are_fold_in_of_the_step_number():
    key = jax.random.key(5)
    keys = step_keys(key, 7, 3)
    for i, k in enumerate(keys):
        assert jnp.array_equal(
            jax.random.key_data(k), jax.random.key_data(jax.random.fold_in(key, 7 + i))
        )


def test_train_lm_is_independent_of_chunking_and_keeps_the_input(model, data):
    opt = optax.adamw(1e-2, weight_decay=0.0)
    run = dict(key=jax.random.key(6), batch_size=4, progress=False)
    a = train_lm(model, data, opt, 4, steps_per_call=2, **run)
    b = train_lm(model, data, opt, 4, steps_per_call=4, **run)
    assert a.losses.shape == (4,) and a.stopped is None
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-5)
    assert_models_close(a.model, b.model, rtol=1e-5, atol=1e-6)
    # validation: the mean loss over the fixed validation windows
    np.testing.assert_allclose(
        a.val_loss, jit_lm_loss(a.model, *data.val_batch()), rtol=1e-5
    )
    # the caller's model is still usable (train_lm donates a copy, not it)
    assert np.isfinite(params(model)[0]).all()
    # resuming from the state continues the same key stream
    c = train_lm(model, data, opt, 2, steps_per_call=2, **run)
    d = train_lm(None, data, opt, 2, steps_per_call=2, state=c.state, **run)
    np.testing.assert_allclose(
        np.concatenate([c.losses, d.losses]), a.losses, rtol=1e-5
    )


def test_validation_loss_with_uneven_chunks(model, data):
    expected = jit_lm_loss(model, *data.val_batch())  # 20 windows at once
    np.testing.assert_allclose(
        validation_loss(model, data, chunk=7), expected, rtol=1e-5
    )


def test_non_finite_loss_stops_and_keeps_the_last_finite_model(model, data):
    # SGD at rate 0.1 whose third update is NaN
    opt = optax.chain(
        optax.scale_by_schedule(lambda c: jnp.where(c == 2, jnp.nan, -0.1))
    )
    run = dict(key=jax.random.key(7), batch_size=4, progress=False)
    with pytest.warns(
        RuntimeWarning, match="non-finite training loss or update at step 3"
    ):
        result = train_lm(model, data, opt, 6, steps_per_call=6, **run)
    clean = train_lm(model, data, optax.sgd(0.1), 2, **run)
    assert result.losses.shape == (2,) and "step 3" in result.stopped
    np.testing.assert_allclose(result.losses, clean.losses, rtol=1e-6)
    assert_models_close(result.model, clean.model)
    assert int(result.state.step) == 2 and not bool(result.state.finite)


def test_bad_arguments(model, data):
    with pytest.raises(ValueError, match=r"batch_size must lie in \[1, inf\], got 0"):
        make_train_step(optax.sgd(0.1), data, batch_size=0)
    with pytest.raises(ValueError, match=r"steps_per_call must lie in \[1, inf\]"):
        train_lm(
            model, data, optax.sgd(0.1), 3, key=jax.random.key(0), steps_per_call=0
        )
    for steps in (0, -1):  # 0 used to end in an argmax-of-empty error
        with pytest.raises(ValueError, match=r"train_lm: num_steps must lie in \[1"):
            train_lm(model, data, optax.sgd(0.1), steps, key=jax.random.key(0))
    with pytest.raises(ValueError, match="validation_loss: chunk must lie in"):
        validation_loss(model, data, chunk=0)
    # (a TypeError naming key; under the suite's type-checking hook, its own)
    with pytest.raises(TypeError, match="key"):
        train_lm(model, data, optax.sgd(0.1), 1, key=None)


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.adam(-1e-2),
        optax.sgd(-0.1),
        optax.adamw(-1e-3, weight_decay=0.1),
    ],
)
def test_negative_learning_rates_are_refused(model, data, optimizer):
    with pytest.raises(ValueError, match="climbs the gradient"):
        train_lm(model, data, optimizer, 1, key=jax.random.key(0))


@pytest.mark.parametrize("lr", [0.0, -1e-3])
def test_injected_learning_rate_must_be_positive(model, data, lr):
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
    with pytest.raises(ValueError, match="learning rate must be > 0"):
        train_lm(model, data, opt, 1, key=jax.random.key(0))


@pytest.mark.parametrize("bad", [-1, 28, 1000])
def test_lm_loss_refuses_out_of_range_targets(model, data, bad):
    X, Y = data.train_batch(jax.random.key(1), 2)
    Y = Y.at[1, 3].set(bad)  # -1 would give a finite wrong loss, 28 a NaN
    with pytest.raises(Exception, match="target ids must lie in"):
        lm_loss(model, X, Y)
    with pytest.raises(Exception, match="target ids must lie in"):
        jit_lm_loss(model, X, Y)


def _loss(name):
    """The loss `fn(X, Y)` named `name`, and its vocabulary."""
    if name == "lm_loss":
        # the model is compiled; the targets reach lm_loss concrete
        char = eqx.filter_jit(CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(0)))
        return (lambda X, Y: lm_loss(char, X, Y)), 28
    cfg = MoEDecoderConfig.mixtral(32, 16, 2, 1, max_len=8, num_experts=4, top_k=2)
    fn, moe_lm = moe_loss(), DecoderLM(cfg, key=jax.random.key(0))
    return (lambda X, Y: fn(moe_lm, (X, Y))[0]), 32


@pytest.mark.parametrize("loss", ["lm_loss", "moe_loss"])
def test_every_loss_refuses_targets_outside_the_vocabulary(loss):
    fn, vocab = _loss(loss)
    X = jnp.zeros((2, 8), jnp.int32)
    jitted = eqx.filter_jit(fn)
    assert np.isfinite(float(jitted(X, jnp.full((2, 8), vocab - 1))))
    # (the MoE forward runs op by op when called eagerly: one value there)
    for bad in (vocab, -1) if loss == "lm_loss" else (-1,):
        Y = jnp.zeros((2, 8), jnp.int32).at[1, 3].set(bad)
        # concrete: checked in NumPy, the message names the id and its index
        with pytest.raises(ConfigError, match=rf"\[0, vocab={vocab}\), got {bad} "
                           r"at index \[1, 3\]"):  # fmt: skip
            fn(X, Y)
    for bad in (vocab, -1):
        Y = jnp.zeros((2, 8), jnp.int32).at[1, 3].set(bad)
        with pytest.raises(eqx.EquinoxRuntimeError, match=rf"vocab={vocab}\)"):
            jitted(X, Y)


def test_decoder_ids_and_empty_batches():
    m = DecoderLM(DecoderConfig.llama(32, 16, 2, 1, max_len=8), key=jax.random.key(0))
    with pytest.raises(ConfigError, match=r"vocab_size=32\), got 40 at index \[1\]"):
        m(jnp.array([0, 40]))
    char = CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(0))
    tm = TokenDataset(np.arange(40) % 28, 8)
    with pytest.raises(ConfigError, match="batch_size must lie in"):
        tm.train_batch(jax.random.key(0), 0)
    empty = jnp.zeros((0, 8), jnp.int32)
    with pytest.raises(ConfigError, match="the batch is empty"):
        lm_loss(char, empty, empty)
