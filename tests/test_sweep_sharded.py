"""The sharded sweep on 4 simulated CPU devices gives the numbers of 1 device."""

import textwrap

import numpy as np
import pytest
from _procs import script_json

pytestmark = pytest.mark.slow  # two fresh JAX processes, each compiling a sweep

# Runs in a subprocess: the device count is fixed when JAX starts.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np
    from blocklab import CharLM, TimeMachine
    from blocklab.training.sweep import sharded_map, train_sweep
    from blocklab import RunConfig, SweepConfig

    data = TimeMachine(seq_len=16, num_train=2000, num_val=40)
    K = 6  # not a multiple of 4: padded to 8, padding dropped
    res = train_sweep(
        lambda k: CharLM(28, 16, 2, 1, max_len=16, key=k), data, 6,
        model_keys=list(range(K)), data_keys=list(range(10, 10 + K)),
        run=RunConfig(batch_size=4, steps_per_call=3, progress=False),
        sweep=SweepConfig(learning_rates=[1e-3, 3e-3, 1e-2, 3e-2, 1e30, 1e-2]),
    )
    mapped = sharded_map(
        lambda key, s: s * jax.random.normal(key, (3,)), [5, 6, 7], np.ones(3)
    )
    w = res.state.model.token_emb.weight
    print(json.dumps({
        "devices": len(jax.devices()),
        "state_devices": len(w.sharding.device_set),
        "losses": res.losses.tolist(),
        "diverged_at": res.diverged_at.tolist(),
        "val_loss": res.val_loss.tolist(),
        "emb": np.asarray(w).tolist(),
        "mapped": np.asarray(mapped).tolist(),
    }))
    """
)


@pytest.fixture(scope="module")
def runs():
    return (
        script_json(SCRIPT, devices=1, timeout=600),
        script_json(SCRIPT, devices=4, timeout=600),
    )


def test_four_devices_are_visible_and_hold_the_members(runs):
    one, four = runs
    assert (one["devices"], one["state_devices"]) == (1, 1)
    # K = 6 is padded to 8 members over 4 devices; the result keeps 6.
    assert (four["devices"], four["state_devices"]) == (4, 4)
    assert np.asarray(four["losses"]).shape == (6, 6)
    assert np.asarray(four["emb"]).shape[0] == 6


def test_four_devices_give_the_numbers_of_one(runs):
    one, four = runs
    # Different devices batch the matmuls differently: float32 rounding only.
    tolerances = {"losses": 1e-5, "val_loss": 1e-5, "mapped": 1e-6}
    for name, rtol in tolerances.items():
        a = np.asarray(one[name], np.float64)
        b = np.asarray(four[name], np.float64)
        np.testing.assert_allclose(b, a, rtol=rtol, equal_nan=True, err_msg=name)
    # Weights of size ~0.02 after a few Adam steps: absolute float32 rounding.
    np.testing.assert_allclose(four["emb"], one["emb"], rtol=0, atol=1e-6)
    assert four["diverged_at"] == one["diverged_at"]
    # Only the member with the absurd learning rate diverges.
    assert [d > 0 for d in one["diverged_at"]] == [False] * 4 + [True, False]
