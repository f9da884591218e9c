"""The coordinate check and the transfer study (blocklab.experiments.mup).

References: NumPy least squares for the slope; a forward written out by hand
for the activation RMS; the measured slopes of standard vs μP for the check
(the expected direction: Adam under standard parametrization grows the
activations with width, μP keeps them flat); each member of a transfer sweep
against its own single run.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab.experiments import mup


def test_log_slope_against_numpy_polyfit():
    rng = np.random.default_rng(0)
    w = np.array([16, 32, 64, 128])
    y = 3.0 * w**0.37 * np.exp(0.01 * rng.standard_normal(4))
    want = np.polyfit(np.log(w), np.log(y), 1)[0]
    assert math.isclose(mup.log_slope(w, y), want, rel_tol=1e-12)
    assert math.isnan(mup.log_slope(w, [1.0, 0.0, 1.0, 1.0]))


def test_activation_rms_against_a_hand_written_forward():
    make = mup.decoder_factory("mup", 16, vocab_size=20, num_blks=1, max_len=8)
    model = make(32, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 20)
    got = mup.activation_rms(model, tokens)
    h0 = np.asarray(model.token_emb.weight)[np.asarray(tokens)]
    assert math.isclose(float(got["embedding"]), np.sqrt(np.mean(h0**2)), rel_tol=1e-5)
    logits = np.asarray(model(tokens), np.float64)
    assert math.isclose(float(got["logits"]), np.sqrt(np.mean(logits**2)), rel_tol=1e-5)
    # one block: its output is the stack's output, before the final norm
    h1 = np.asarray(model.stack(jnp.asarray(h0), jnp.arange(1, 9),
                                positions=jnp.arange(8)), np.float64)  # fmt: skip
    assert math.isclose(float(got["block_out"]), np.sqrt(np.mean(h1**2)), rel_tol=1e-4)
    # μP zero-initialises the query: the attention logits are exactly 0 at init
    assert float(got["attn_logits"]) == 0.0


def test_coord_check_rejects_bad_input():
    make = mup.decoder_factory("mup", 16)
    with pytest.raises(bl.ConfigError, match="two distinct widths"):
        mup.coord_check(make, [32, 32])
    with pytest.raises(bl.ConfigError, match="learning_rate"):
        mup.coord_check(make, [16, 32], learning_rate=-1.0)
    with pytest.raises(bl.ConfigError, match="parametrizations"):
        mup.run_transfer((16, 32), parametrizations=("ntk",))


def test_transfer_sweep_members_equal_their_own_runs():
    """One width of the transfer study (μP DecoderLM, `blocklab.optimizer` with
    warm-up, a vmapped `train_sweep`): each member, with its own rate, model seed
    and data seed, has the loss trajectory of its own `train_model` run with an
    optimizer built for that rate alone. The rates are stable ones; at chaotic
    rates the two sides part by float rounding amplified over the steps
    (benchmarks/README.md, transfer.py), which is not what this checks."""
    data = bl.TimeMachine(seq_len=8)
    make_w = mup.decoder_factory("mup", 16, vocab_size=data.vocab_size, num_blks=1,
                                 max_len=8)  # fmt: skip

    def make(key):
        return make_w(32, key)

    opt = bl.optimizer(eqx.filter_eval_shape(make, jax.random.key(0)), warmup_steps=2)
    rates, seeds = [3e-3, 1e-2], [0, 1]
    res = bl.train_sweep(
        make,
        data,
        5,
        model_keys=seeds,
        data_keys=[s + 7 for s in seeds],
        run=bl.RunConfig(batch_size=4, steps_per_call=5, progress=False),
        sweep=bl.SweepConfig(learning_rates=rates, optimizer=opt, validate=False),
    )
    for k, (lr, seed) in enumerate(zip(rates, seeds, strict=True)):
        model = make(jax.random.key(seed))
        one = bl.train_model(
            model,
            data,
            bl.optimizer(model, learning_rate=lr, warmup_steps=2),
            5,
            key=jax.random.key(seed + 7),
            run=bl.RunConfig(batch_size=4, steps_per_call=5, progress=False),
        )
        np.testing.assert_allclose(res.losses[k], one.losses, rtol=1e-5)
    # the two members differ (so a swap of rates or keys would show)
    assert np.max(np.abs(res.losses[0] - res.losses[1])) > 1e-2


@pytest.mark.slow
def test_coord_check_mup_flat_standard_grows():
    """Few steps, tiny widths (16..64, 3 Adam steps at 1e-2, one seed): under
    standard the in-block activations grow with width; μP's grow much less.
    Measured (this config, CPU): standard slopes attention logits +0.29,
    attention output +0.18, FFN output +0.67, block output +0.41; μP -0.37,
    +0.03, +0.35, +0.12 (noisy at these widths; flat from d = 64, see README)."""
    widths = (16, 32, 64)
    res = {
        p: mup.coord_check(
            mup.decoder_factory(p, 16, num_blks=1),
            widths,
            3,
            learning_rate=1e-2,
            seq_len=16,
            batch_size=4,
            probe_batch=4,
        )  # fmt: skip
        for p in ("mup", "standard")
    }
    s_mup = res["mup"].final_slopes()
    s_std = res["standard"].final_slopes()
    inner = ("attn_logits", "attn_out", "ffn_out", "block_out")
    mean_std = np.mean([s_std[a] for a in inner])
    mean_mup = np.mean([s_mup[a] for a in inner])
    assert s_std["block_out"] > 0.3 and mean_std > mean_mup + 0.2
    assert res["mup"].max_abs_final_slope() < res["standard"].max_abs_final_slope()
    assert abs(s_mup["logits"]) < 0.15 and abs(s_mup["embedding"]) < 0.1
    assert "slope" in res["mup"].table() and res["mup"].to_json()["widths"] == [
        16,
        32,
        64,
    ]


@pytest.mark.slow
def test_transfer_study_runs_and_finds_an_optimum():
    res = mup.run_transfer(
        (16, 32), (1e-3, 1e-2), seeds=(0,), steps=6, num_blks=1, seq_len=8,
        batch_size=4, warmup_steps=2,
    )  # fmt: skip
    for p in ("standard", "mup"):
        assert res.val_loss[p].shape == (2, 2, 1)
        mean = res.val_loss[p].mean(-1)
        np.testing.assert_array_equal(res.optimum[p], np.argmin(mean, -1))
    assert "shift" in res.table()
