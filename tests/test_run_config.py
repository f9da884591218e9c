"""One run config, one LoRA config, private `owner` (issue 43, item 7).

References: `RunConfig` / `SweepConfig` / `LoRAConfig` refuse each bad field
by name (the message names the field, the value and the valid choices);
`train_model(run=RunConfig(...))` against a hand-rolled loop of
`make_train_step` on the same keys (`fold_in(key, s)` for step s);
`train_lm`'s chapter keywords against the same `RunConfig`; a sweep's
`RunConfig.remat` against the same sweep without it (remat never changes
the numbers); `lora_config` against the config the adapters were built
from; the public run functions' signatures counted with `inspect`.
"""

import dataclasses
import importlib
import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blocklab as bl
from blocklab import LoRAConfig, RunConfig, SweepConfig
from blocklab._validate import ConfigError
from blocklab.nn.lora import lora_config
from blocklab.training.step import init_state, make_train_step

# blocklab's own errors, as in a user's program (the suite's type-checking
# hook would refuse a wrong type by its annotation first)
pytestmark = pytest.mark.usefixtures("plain_python")

# -- RunConfig ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("batch_size", 0, r"batch_size must lie in \[1, inf\], got 0"),
        ("batch_size", 2.5, r"batch_size must be an int, got 2.5"),
        ("precision", "fp8", r"precision must be one of \['float32', 'bf16'\]"),
        ("steps_per_call", 0, r"steps_per_call must lie in \[1, inf\], got 0"),
        ("microbatches", 0, r"microbatches must lie in \[1, inf\], got 0"),
        ("microbatches", True, r"microbatches must be an int, got True"),
        ("remat", "sometimes", r"remat.*'sometimes'"),
        ("mesh", "data=8", r"mesh must be a jax.sharding.Mesh or None, got 'data=8'"),
        ("rules", "zero3", r"rules must be a mapping or presets from .*'fsdp'"),
        ("rules", 3, r"rules must be None, a preset from"),
        ("progress", "yes", r"progress must be a bool \(True or False\), got 'yes'"),
    ],
)
def test_run_config_refuses_each_bad_field_by_name(field, value, says):
    with pytest.raises(ConfigError, match=rf"^RunConfig: {says}"):
        RunConfig(**{field: value})


def test_run_config_is_a_frozen_value():
    run = RunConfig(batch_size=8, remat="dots")
    assert (run.batch_size, run.remat, run.steps_per_call) == (8, "dots", 25)
    assert dataclasses.replace(run, progress=False).progress is False
    assert run == RunConfig(batch_size=np.int64(8), remat="dots")  # ints normalized
    assert type(RunConfig(batch_size=np.int64(8)).batch_size) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch_size = 4  # type: ignore[misc]
    # replace re-checks: a bad value cannot be smuggled in afterwards
    with pytest.raises(ConfigError, match="RunConfig: steps_per_call"):
        dataclasses.replace(run, steps_per_call=-1)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("validate", "no", r"validate must be a bool"),
        ("memory_analysis", 1, r"memory_analysis must be a bool"),
        ("hyperparams", [0.1], r"hyperparams must be a mapping"),
        ("optimizer", "adam", r"optimizer must be an optax transformation"),
        ("probe", 3, r"probe must be callable"),
        ("adapters", {"rank": 2}, r"adapters must be a blocklab.LoRAConfig"),
        ("adapters", [], r"adapters must be a blocklab.LoRAConfig"),
    ],
)
def test_sweep_config_refuses_each_bad_field_by_name(field, value, says):
    with pytest.raises(ConfigError, match=rf"^SweepConfig: {says}"):
        SweepConfig(**{field: value})


def test_run_functions_refuse_options_that_are_not_configs():
    model = bl.CharLM(28, 8, 2, 1, max_len=8, key=jax.random.key(0))
    data = bl.TimeMachine(seq_len=8, num_train=100, num_val=0)
    opt = optax.sgd(0.1)
    with pytest.raises(ConfigError, match=r"train_model: run must be a blocklab"):
        bl.train_model(model, data, opt, 1, key=jax.random.key(0), run={"a": 1})
    with pytest.raises(ConfigError, match=r"train_sweep: sweep must be a blocklab"):
        bl.train_sweep(model, data, 1, data_keys=[0], sweep={"learning_rates": 1})
    with pytest.raises(
        ConfigError,
        match=r"train_lm: 'batchsize' is not an option of a run.*'batch_size'",
    ):
        bl.train_lm(model, data, opt, 1, key=jax.random.key(0), batchsize=4)


# -- the numbers did not move -------------------------------------------------


def _linear(key):
    return eqx.nn.Linear(3, 1, key=key)


def _source(key):
    x = jax.random.normal(key, (4, 3))
    return x, x @ jnp.array([1.0, -2.0, 0.5]) + 0.25


def _mse(model, batch, key):
    del key
    x, y = batch
    return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)


def test_train_model_with_a_run_config_equals_a_hand_rolled_loop():
    """Step s of `train_model(..., key=k, run=RunConfig(steps_per_call=3))`
    is `make_train_step(...)` on `fold_in(k, s)`: 7 steps in chunks 3, 3, 1
    against 7 single steps of the same step function."""
    model, opt, key, n = (
        _linear(jax.random.key(0)),
        optax.adam(0.05),
        jax.random.key(7),
        7,
    )
    res = bl.train_model(
        model, _source, opt, n, key=key, loss_fn=_mse,
        run=RunConfig(steps_per_call=3, progress=False),
    )  # fmt: skip
    step = eqx.filter_jit(make_train_step(opt, _source, loss_fn=_mse))
    state, losses = init_state(model, opt), []
    for s in range(n):
        state, loss = step(state, jax.random.fold_in(key, s))
        losses.append(float(loss))
    np.testing.assert_allclose(res.losses, losses, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(res.model.weight, state.model.weight, rtol=2e-6)
    assert int(res.state.step) == n


def test_train_lm_keywords_are_the_run_config():
    """The chapter's `train_lm(..., batch_size=4, progress=False)` is
    `run=RunConfig(batch_size=4, progress=False)`, and its default batch is
    64, that of `train_model` on a token dataset."""
    data = bl.TimeMachine(seq_len=8, num_train=300, num_val=20)
    model = bl.CharLM(28, 8, 2, 1, max_len=8, key=jax.random.key(0))
    opt, key = optax.adam(1e-2), jax.random.key(1)
    a = bl.train_lm(model, data, opt, 3, key=key, batch_size=4, progress=False)
    b = bl.train_lm(
        model, data, opt, 3, key=key, run=RunConfig(batch_size=4, progress=False)
    )
    c = bl.train_model(
        model, data, opt, 3, key=key, run=RunConfig(batch_size=4, progress=False)
    )
    np.testing.assert_array_equal(a.losses, b.losses)
    np.testing.assert_array_equal(a.losses, c.losses)
    assert a.val_loss == b.val_loss == c.val_loss


def test_a_sweeps_remat_changes_no_number():
    """`RunConfig(remat="full")` in a sweep rematerializes every member's
    stack (a new option of `train_sweep`); the losses are those without."""
    data = bl.TimeMachine(seq_len=8, num_train=300, num_val=20)

    def make(k):
        return bl.CharLM(28, 8, 2, 2, max_len=8, key=k)

    def sweep(remat):
        return bl.train_sweep(
            make, data, 2, model_keys=[0, 1], data_keys=[2, 3],
            run=RunConfig(batch_size=2, remat=remat, progress=False),
            sweep=SweepConfig(learning_rates=[1e-2, 3e-2], validate=False),
        )  # fmt: skip

    plain, full = sweep(None), sweep("full")
    np.testing.assert_allclose(full.losses, plain.losses, rtol=1e-6)
    assert full.state.model.stack.remat == "full"


# -- LoRAConfig ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"rank": 0}, r"rank must lie in \[1, inf\], got 0"),
        ({"rank": 2.0}, r"rank must be an int, got 2.0"),
        ({"alpha": math.nan}, r"alpha must be finite, got nan"),
        ({"alpha": "8"}, r"alpha must be a real number, got '8'"),
        ({"targets": ["x"]}, r"target 'x' is not a projection name"),
        ({"targets": ["experts"]}, r"target 'experts' is not supported yet"),
        ({"targets": []}, r"targets must be a non-empty list of names"),
        ({"use_rslora": 1}, r"use_rslora must be a bool"),
        ({"dropout": 0.1}, r"dropout=0.1 is not supported yet"),
        ({"dropout": 1.0}, r"dropout must lie in \[0.0, 1.0\), got 1.0"),
    ],
)
def test_lora_config_refuses_each_bad_field_by_name(changes, says):
    fields = {"rank": 2, "alpha": 4.0, "targets": ["q"], **changes}
    with pytest.raises(ConfigError, match=rf"^LoRAConfig: {says}"):
        LoRAConfig(**fields)


def test_lora_config_normalizes_and_scales():
    c = LoRAConfig(rank=np.int64(4), alpha=8, targets=["v", "q", "v"])
    assert c == LoRAConfig(4, 8.0, ("v", "q"))  # a tuple, repeats dropped
    assert LoRAConfig(4, 8.0, "q").targets == ("q",)
    assert c.scale == 2.0  # alpha / r
    assert LoRAConfig(4, 8.0, "q", use_rslora=True).scale == 4.0  # alpha / sqrt r
    hash(c)  # a static value


def test_lora_takes_a_config_and_gives_it_back():
    cfg = bl.DecoderConfig(32, 16, 2, 2, max_len=8)
    base = bl.DecoderLM(cfg, key=jax.random.key(0))
    config = LoRAConfig(rank=3, alpha=5.0, targets=("v", "q", "down"), use_rslora=True)
    adapted = bl.lora(base, config, key=jax.random.key(1))
    node = adapted.stack.blocks.attention.W_q
    assert node.A.shape == (2, 3, 16) and node.scale == 5.0 / math.sqrt(3)
    # read back from the leaves, targets in LORA_TARGETS order
    assert lora_config(adapted) == dataclasses.replace(
        config, targets=("q", "v", "down")
    )
    with pytest.raises(
        ConfigError, match=r"lora: config must be a blocklab.LoRAConfig"
    ):
        bl.lora(base, {"rank": 2}, key=jax.random.key(1))
    with pytest.raises(ConfigError, match=r"lora_config: the model has no adapters"):
        lora_config(base)


# -- signatures ---------------------------------------------------------------

RUN_FUNCTIONS = [
    bl.train_model,
    bl.train_sweep,
    bl.train_lm,
    bl.lora,
    bl.save_adapter,
    bl.load_adapter,
]


@pytest.mark.parametrize("fn", RUN_FUNCTIONS, ids=lambda f: f.__name__)
def test_run_functions_take_at_most_8_parameters(fn):
    params = inspect.signature(fn).parameters
    assert len(params) <= 8, list(params)
    assert "owner" not in params


OWNERLESS = [
    "blocklab.training." + m
    for m in (
        "checkpoint distributed hyperparams launcher loop losses member_axis "
        "mesh_training optimizers placement plan run run_config "
        "sharded_checkpoint sources step sweep"
    ).split()
] + ["blocklab.training", "blocklab.nn.lora", "blocklab.interop.peft"]


def _public_callables(module):
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            yield f"{name}.__init__", obj.__init__
            for attr, fn in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(fn):
                    yield f"{name}.{attr}", fn
        elif callable(obj):
            yield name, obj


@pytest.mark.parametrize("module", OWNERLESS)
def test_no_public_function_takes_an_owner(module):
    """`owner` (the name in error messages) is private: `_owner=` or a
    private helper the public function wraps."""
    mod = importlib.import_module(module)
    with_owner = []
    for name, fn in _public_callables(mod):
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        if "owner" in params:
            with_owner.append(name)
    assert not with_owner, with_owner
