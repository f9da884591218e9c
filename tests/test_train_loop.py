"""`blocklab.training.loop.run_chunks`: the loop `train_model` and `train_sweep` share.

A fake `advance` (host arrays, no compilation) stands in for a compiled
chunk: its losses are a hand-written table, so the chunk boundaries, the
divergence steps and the stop are checked against hand-worked values.
"""

import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.training.loop import run_chunks

# Two members, seven steps; member 1's loss is first non-finite at step 5.
TABLE = np.array(
    [[7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0], [9.0, 8.0, 7.0, 6.0, np.nan, 0.0, 0.0]],
    np.float32,
)


def _fake(table):
    calls = []

    def advance(state, start, n):
        calls.append((start, n))
        chunk = table[..., start : start + n]
        aux = {"step": np.broadcast_to(np.arange(start, start + n), chunk.shape)}
        return state + n, chunk, aux

    return advance, calls


def test_chunks_cover_every_step_once_with_a_short_last_chunk():
    advance, calls = _fake(TABLE)
    seen = []
    out = run_chunks(
        advance, 0, 7, 3, has_aux=True, members=(2,), progress=False,
        after_chunk=lambda state, done: seen.append((state, done)),
    )  # fmt: skip
    assert calls == [(0, 3), (3, 3), (6, 1)]
    assert seen == [(3, 3), (6, 6), (7, 7)]
    assert out.state == 7 and out.steps_run == 7
    np.testing.assert_array_equal(out.losses, TABLE)
    # The aux is stacked along the step axis, after the member axis.
    np.testing.assert_array_equal(out.aux["step"], np.tile(np.arange(7), (2, 1)))
    # Member 1 diverged at step 5 (1-based); member 0 never.
    np.testing.assert_array_equal(out.diverged_at, [0, 5])
    assert np.isnan(out.val_loss).all() and out.val_loss.shape == (2,)


def test_one_run_stops_at_its_divergence_and_members_do_not():
    advance, calls = _fake(TABLE[1])
    out = run_chunks(
        advance, 0, 7, 2, has_aux=False, stop_on_divergence=True, progress=False
    )
    # Steps 5-6 are chunk 3; the loop stops after it, chunk 4 never runs.
    assert calls == [(0, 2), (2, 2), (4, 2)]
    assert out.steps_run == 6 and int(out.diverged_at) == 5
    np.testing.assert_array_equal(out.losses[:4], TABLE[1, :4])
    assert np.isnan(out.losses[6])  # never run
    # Members: one finite member keeps the sweep going to the end.
    advance, calls = _fake(TABLE)
    out = run_chunks(
        advance, 0, 7, 2, has_aux=False, members=(2,), stop_on_divergence=True,
        progress=False,
    )  # fmt: skip
    assert out.steps_run == 7 and len(calls) == 4


def test_validate_sees_the_final_model():
    class State:
        def __init__(self, model):
            self.model = model

    def advance(state, start, n):
        return State(state.model + n), np.zeros(n, np.float32), None

    out = run_chunks(
        advance, State(0.0), 5, 2, has_aux=False, progress=False,
        validate=lambda model: model * 10,
    )  # fmt: skip
    assert float(out.val_loss) == 50.0


@pytest.mark.parametrize("name, value", [("num_steps", 0), ("steps_per_call", 0)])
def test_bad_sizes_are_config_errors(name, value):
    kwargs = {"num_steps": 3, "steps_per_call": 1, name: value}
    with pytest.raises(ConfigError, match=name):
        run_chunks(_fake(TABLE[0])[0], 0, has_aux=False, progress=False, **kwargs)
