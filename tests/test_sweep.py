"""`blocklab.training.sweep`: a vmapped sweep equals sequential runs; divergence
is contained."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from blocklab import CharLM, RunConfig, SweepConfig, TimeMachine, train_lm
from blocklab.training.sweep import (
    member_mesh,
    pad_members,
    sharded_map,
    sweep_optimizer,
    train_sweep,
)

STEPS, SPC, BATCH = 10, 5, 4
SEEDS = [0, 1, 2, 3]
LRS = [1e-3, 3e-3, 1e-2, 3e-2]


@pytest.fixture(scope="module")
def data():
    return TimeMachine(seq_len=16, num_train=2000, num_val=40)


def make_model(key):
    return CharLM(28, 16, 2, 1, max_len=16, key=key)


def _sweep(data, lrs, steps=STEPS, **kw):
    return train_sweep(
        make_model,
        data,
        steps,
        model_keys=SEEDS[: len(lrs)],
        data_keys=[s + 100 for s in SEEDS[: len(lrs)]],
        run=RunConfig(batch_size=BATCH, steps_per_call=SPC, progress=False),
        sweep=SweepConfig(learning_rates=lrs, **kw),
    )


@pytest.fixture(scope="module")
def sweep(data):
    return _sweep(data, LRS)


def test_sweep_of_four_members_equals_four_sequential_train_lm_runs(data, sweep):
    for k, (seed, lr) in enumerate(zip(SEEDS, LRS, strict=True)):
        ref = train_lm(
            make_model(jax.random.key(seed)),
            data,
            optax.adamw(lr, weight_decay=0.0),
            STEPS,
            key=jax.random.key(seed + 100),
            batch_size=BATCH,
            steps_per_call=SPC,
            progress=False,
        )
        rel = np.abs(sweep.losses[k] - ref.losses) / np.abs(ref.losses)
        assert rel.max() <= 1e-5, (k, rel.max())
        assert abs(sweep.val_loss[k] - ref.val_loss) <= 1e-5 * abs(ref.val_loss)
    np.testing.assert_array_equal(sweep.diverged_at, 0)
    np.testing.assert_allclose(sweep.learning_rates, np.float32(LRS))


def test_learning_rates_live_in_the_optimizer_state(sweep):
    lr = sweep.state.opt_state.hyperparams["learning_rate"]
    np.testing.assert_array_equal(np.asarray(lr), np.float32(LRS))


def test_runs_unstack_the_members(sweep):
    runs = sweep.runs()
    assert len(runs) == 4
    for k, run in enumerate(runs):
        np.testing.assert_array_equal(run.losses, sweep.losses[k])
        assert run.stopped is None
        w = run.model.token_emb.weight
        np.testing.assert_array_equal(w, sweep.state.model.token_emb.weight[k])


def test_results_are_frozen_dataclasses_not_tuples(sweep):
    run = sweep.runs()[0]
    for result in (sweep, run):
        assert dataclasses.is_dataclass(result) and not isinstance(result, tuple)
        with pytest.raises(dataclasses.FrozenInstanceError):
            result.losses = None
    sub = sweep.select(learning_rate=LRS[2])
    assert type(sub) is type(sweep) and sub.losses.shape == (1, STEPS)
    np.testing.assert_array_equal(sub.losses[0], sweep.losses[2])


def adam_poisoned(learning_rate, poison_at):
    """Adam whose update at (0-based) step `poison_at` is NaN: a member that
    diverges at step poison_at + 1 after finite steps. poison_at = -1: never."""
    return optax.chain(
        optax.adam(learning_rate),
        optax.scale_by_schedule(lambda c: jnp.where(c == poison_at, jnp.nan, 1.0)),
    )


POISON = optax.inject_hyperparams(adam_poisoned, hyperparam_dtype=jnp.float32)(
    learning_rate=1e-2, poison_at=-1.0
)


def _poisoned_sweep(data, poison_at):
    def probe(model):  # every weight, after every chunk
        return eqx.filter(model, eqx.is_inexact_array)

    return train_sweep(
        make_model,
        data,
        9,
        model_keys=[0, 1, 2],
        data_keys=[5, 6, 7],
        run=RunConfig(batch_size=BATCH, steps_per_call=3, progress=False),
        sweep=SweepConfig(
            hyperparams={"learning_rate": [1e-2, 1e-2, 3e-2], "poison_at": poison_at},
            optimizer=POISON,
            probe=probe,
        ),
    )


def test_divergent_member_is_frozen_and_leaves_the_others_bit_identical(data):
    """Member 1's 4th update is NaN (steps 1-3 are finite). The same program,
    without the poison, is the reference: the other members must match it bit
    for bit, and member 1 must hold exactly its weights after step 3."""
    good = _poisoned_sweep(data, [-1.0, -1.0, -1.0])
    bad = _poisoned_sweep(data, [-1.0, 3.0, -1.0])
    np.testing.assert_array_equal(bad.diverged_at, [0, 4, 0])
    np.testing.assert_array_equal(good.diverged_at, [0, 0, 0])
    weights = lambda r: jax.tree_util.tree_leaves(  # noqa: E731
        eqx.filter(r.state.model, eqx.is_inexact_array)
    )
    for k in (0, 2):
        np.testing.assert_array_equal(bad.losses[k], good.losses[k])
        np.testing.assert_array_equal(bad.val_loss[k], good.val_loss[k])
        for a, b in zip(weights(bad), weights(good), strict=True):
            np.testing.assert_array_equal(a[k], b[k])
    # Member 1: the same losses up to its divergence, NaN from step 4 on ...
    np.testing.assert_array_equal(bad.losses[1, :3], good.losses[1, :3])
    assert np.all(np.isnan(bad.losses[1, 3:]))
    # ... and frozen at its weights after step 3 (the probe after chunk 1),
    # which differ from where the clean run went on to.
    assert bad.probe_steps.tolist() == [0, 3, 6, 9]
    after3 = jax.tree_util.tree_leaves(bad.probes)
    for final, probed in zip(weights(bad), after3, strict=True):
        np.testing.assert_array_equal(final[1], probed[1, 1])
    assert not np.array_equal(weights(bad)[0][1], weights(good)[0][1])
    finite = np.asarray(bad.state.finite)
    assert finite.tolist() == [True, False, True]
    assert np.asarray(bad.state.step).tolist() == [9, 3, 9]
    run = bad.runs()[1]
    assert run.stopped is not None and "step 4" in run.stopped
    assert len(run.losses) == 3


@pytest.mark.slow
def test_probe_is_recorded_at_init_and_after_every_chunk(data):
    def probe(model):
        return jnp.max(jnp.abs(model.token_emb.weight))

    res = _sweep(data, [1e-2, 3e-2], probe=probe, validate=False)
    np.testing.assert_array_equal(res.probe_steps, [0, 5, 10])
    assert res.probes.shape == (2, 3)
    for k, seed in enumerate(SEEDS[:2]):
        w0 = np.asarray(make_model(jax.random.key(seed)).token_emb.weight)
        assert res.probes[k, 0] == pytest.approx(np.abs(w0).max(), rel=1e-7)
        w_end = np.asarray(res.state.model.token_emb.weight[k])
        assert res.probes[k, -1] == pytest.approx(np.abs(w_end).max(), rel=1e-7)
    assert np.all(np.isnan(res.val_loss))


def test_sharded_map_equals_a_python_loop():
    def fn(key, scale):
        return {"x": scale * jax.random.normal(key, (3,), jnp.float32)}

    seeds = [3, 1, 4, 1, 5]
    scales = np.arange(5, dtype=np.float32)
    out = sharded_map(fn, seeds, scales)
    for i, s in enumerate(seeds):
        ref = np.asarray(fn(jax.random.key(s), scales[i])["x"])
        np.testing.assert_allclose(out["x"][i], ref, rtol=1e-6)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 9])
def test_sharded_map_in_chunks_equals_a_python_loop_and_compiles_once(chunk):
    """Chunks of any size (the last one padded) give each member its own values,
    and every chunk runs the same compiled program: one trace."""
    traces = []

    def fn(key, scale):
        traces.append(1)
        return {"x": scale * jax.random.normal(key, (3,), jnp.float32)}

    seeds = [3, 1, 4, 1, 5]
    scales = np.arange(5, dtype=np.float32)
    out = sharded_map(fn, seeds, scales, chunk=chunk)
    assert out["x"].shape == (5, 3) and len(traces) == 1
    for i, s in enumerate(seeds):
        ref = np.asarray(fn(jax.random.key(s), scales[i])["x"])
        np.testing.assert_allclose(out["x"][i], ref, rtol=1e-6)
    with pytest.raises(ValueError, match="chunk must lie in"):
        sharded_map(fn, seeds, scales, chunk=0)


@pytest.mark.parametrize(
    ("members", "devices", "padded"), [(1, 1, 1), (4, 4, 4), (5, 4, 8), (7, 2, 8)]
)
def test_pad_members_rounds_up_to_a_multiple_of_the_devices(members, devices, padded):
    assert pad_members(members, devices) == padded


def test_member_mesh_spans_the_visible_devices():
    mesh = member_mesh()
    assert mesh.axis_names == ("members",)
    assert mesh.devices.size == len(jax.devices())


def test_mismatched_keys_raise(data):
    with pytest.raises(ValueError, match="same length, got 2 and 3"):
        train_sweep(
            make_model,
            data,
            1,
            model_keys=[0, 1],
            data_keys=[0, 1, 2],
            sweep=SweepConfig(learning_rates=1e-3),
        )


def test_optimizer_without_injected_learning_rate_raises(data):
    with pytest.raises(ValueError, match="inject_hyperparams"):
        train_sweep(
            make_model,
            data,
            1,
            model_keys=[0],
            data_keys=[0],
            sweep=SweepConfig(learning_rates=1e-3, optimizer=optax.adamw(1e-3)),
        )


def test_bad_learning_rates_raise(data):
    with pytest.raises(ValueError, match="learning_rate must be finite"):
        train_sweep(
            make_model,
            data,
            1,
            model_keys=[0, 1],
            data_keys=[0, 1],
            sweep=SweepConfig(learning_rates=[1e-3, float("nan")]),
        )


def test_sweep_optimizer_injects_float32_learning_rate():
    opt = sweep_optimizer(optax.sgd)
    state = opt.init({"w": jnp.zeros(2, jnp.float32)})
    assert state.hyperparams["learning_rate"].dtype == jnp.float32


@pytest.mark.slow
def test_train_seeds_of_the_train_command_equal_train_one(data):
    from blocklab.experiments import activations as cmd

    opts = dict(num_hiddens=16, num_heads=2, num_blks=1, batch_size=BATCH, lr=1e-2)
    runs = cmd.train_seeds("relu", [0, 1], 4, data=data, progress=False, **opts)
    for seed, run in zip([0, 1], runs, strict=True):
        ref = cmd.train_one("relu", seed, 4, data=data, progress=False, **opts)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5)
        assert run.val_loss == pytest.approx(ref.val_loss, rel=1e-5)
