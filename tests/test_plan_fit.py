"""`plan_step` and `blocklab plan --fit` (issue 36): the measured bytes are
the compiled step's (an independent compile of the step `train_model` runs,
on real arrays), the choice is the fastest option within the budget, a
budget below every option is refused naming the smallest need, and the
command prints JSON on every exit path."""

from __future__ import annotations

import json

import jax
import optax
import pytest
from _procs import blocklab

from blocklab import ConfigError, DecoderConfig, DecoderLM
from blocklab.nn.remat import with_remat
from blocklab.training.plan import parse_bytes, plan_step, step_flops
from blocklab.training.step import init_state, make_train_step

CFG = DecoderConfig.llama(
    vocab_size=32, num_hiddens=16, num_heads=2, num_blks=2, max_len=16
)
B, T = 4, 8


def _compiled_bytes(remat, k):
    """Bytes of the step as `train_model` builds it, on real arrays."""
    model = with_remat(DecoderLM(CFG, key=jax.random.key(0)), remat)

    def source(key):
        X = jax.random.randint(key, (B, T + 1), 0, CFG.vocab_size)
        return X[:, :-1], X[:, 1:]

    tx = optax.adamw(1e-4)
    step = make_train_step(tx, source, microbatches=k)
    state = init_state(model, tx)
    m = (
        jax.jit(lambda s, key: step(s, key), donate_argnums=0)
        .lower(state, jax.random.key(0))
        .compile()
        .memory_analysis()
    )
    out = max(m.output_size_in_bytes - m.alias_size_in_bytes, 0)
    return m.argument_size_in_bytes + m.temp_size_in_bytes + out, m.temp_size_in_bytes


@pytest.mark.slow  # CI time: the default suite keeps the cheaper checks of this feature
def test_measured_bytes_agree_with_the_compiled_step():
    plan = plan_step(
        CFG, (B, T), "1GiB", policies=["none", "full"], microbatches=[2],
        measure=True, peak_flops=1e11,
    )  # fmt: skip
    for option in plan.options:
        assert option.measured
        want, temp = _compiled_bytes(option.remat, option.microbatches)
        assert abs(option.bytes - want) <= 0.1 * want
        assert abs(option.temp_bytes - temp) <= 0.1 * temp
    assert plan.choice.remat == "none"  # fewest FLOPs, and it fits
    assert "<- chosen" in plan.table()


def test_the_choice_is_the_fastest_that_fits_and_too_small_is_refused():
    kw = dict(microbatches=[1, 2], measure=False, peak_flops=1e11)
    plan = plan_step(CFG, (B, T), 2**40, **kw)
    by = {(o.remat, o.microbatches): o for o in plan.options}
    assert by["none", 1].seconds < by["dots", 1].seconds < by["full", 1].seconds
    assert by["full", 1].seconds < by["nested", 1].seconds
    assert by["none", 1].flops == step_flops(CFG, B, T, "none")
    assert plan.choice == by["none", 1]
    # a budget just below "none" but above "full" picks a remat policy
    budget = max(by["full", 2].bytes, by["dots", 2].bytes, by["dots", 1].bytes)
    if budget < by["none", 2].bytes:
        tight = plan_step(CFG, (B, T), budget, **kw)
        assert tight.choice.bytes <= budget and tight.choice.remat != "none"
    least = min(o.bytes for o in plan.options)
    with pytest.raises(ConfigError, match=rf"smallest need is {least} bytes"):
        plan_step(CFG, (B, T), least - 1, **kw)
    with pytest.raises(ConfigError, match="microbatches=3 does not divide"):
        plan_step(CFG, (B, T), 2**40, microbatches=[3], measure=False)


def test_budgets_parse_with_units():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes(1000) == 1000 and parse_bytes("2e9") == 2 * 10**9
    for bad in ("lots", "-1GiB", True, "3 parsecs"):
        with pytest.raises(ConfigError, match="memory_budget"):
            parse_bytes(bad)


def test_fit_refusals_print_json():
    rc, out, _ = blocklab(
        "plan", "--config", "llama", "--fit", "--budget", "1GiB", "--batch", "4",
        "--microbatches", "3", "--json",
    )  # fmt: skip
    assert rc != 0 and "--microbatches 3" in json.loads(out)["error"]


@pytest.mark.slow  # compiles the step twice in a child process
def test_fit_command_chooses_and_refuses():
    args = ["plan", "--config", "llama", "--fit", "--batch", "2", "--seq-len",
            "16", "--policies", "full", "--microbatches", "1", "--peak-flops",
            "1e11"]  # fmt: skip
    rc, out, _ = blocklab(*args, "--budget", "1GiB", "--json")
    assert rc == 0
    fit = json.loads(out)["fit"]
    assert fit["choice"]["remat"] == "full" and fit["choice"]["fits"]
    rc, out, _ = blocklab(*args, "--budget", "100", "--json")
    assert rc != 0 and "smallest need" in json.loads(out)["error"]
