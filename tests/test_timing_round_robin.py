"""`time_round_robin`: the names timed in turn, in blocks, with pauses; the
medians and bests of each name's calls (a fake clock: hand-worked values)."""

import pytest

import blocklab.experiments.timing as timing


@pytest.fixture
def clock(monkeypatch):
    """A clock that only the thunks and the pauses advance; the calls logged."""
    state = {"now": 0.0, "log": []}

    def perf_counter():
        return state["now"]

    def sleep(seconds):
        state["log"].append(("sleep", seconds))
        state["now"] += seconds

    monkeypatch.setattr(timing.time, "perf_counter", perf_counter)
    monkeypatch.setattr(timing.time, "sleep", sleep)
    return state


def _thunk(clock, name, durations):
    it = iter(durations)

    def fn():
        clock["log"].append(name)
        clock["now"] += next(it)

    return fn


def test_one_call_per_round_in_turn(clock):
    fns = {
        "a": _thunk(clock, "a", [3.0, 1.0, 2.0]),
        "b": _thunk(clock, "b", [10.0, 30.0, 20.0]),
    }
    out = timing.time_round_robin(fns, 3)
    assert clock["log"] == ["a", "b", "a", "b", "a", "b"]
    assert out["a"] == timing.Timing(median=2.0, best=1.0, reps=3)
    assert out["b"] == timing.Timing(median=20.0, best=10.0, reps=3)


def test_blocks_and_pauses(clock):
    # reps 5 in blocks of 2: ceil(5 / 2) = 3 rounds, 6 calls a name; the pause
    # before each name's block is not timed.
    fns = {
        "a": _thunk(clock, "a", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        "b": _thunk(clock, "b", [7.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    }
    out = timing.time_round_robin(fns, 5, block=2, pause=0.5)
    one_round = [("sleep", 0.5), "a", "a", ("sleep", 0.5), "b", "b"]
    assert clock["log"] == one_round * 3
    assert out["a"] == timing.Timing(median=3.5, best=1.0, reps=6)
    assert out["b"] == timing.Timing(median=1.0, best=1.0, reps=6)
