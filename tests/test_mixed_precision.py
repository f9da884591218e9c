"""Mixed precision (`precision="bf16"`): float32 parameters and optimizer state,
bfloat16 matrix products, float32 gradients and loss, tracking the float32 run."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from regression import Linear, mse

from blocklab import (
    CharLM,
    DecoderConfig,
    DecoderLM,
    RunConfig,
    TimeMachine,
    lm_loss,
    make_train_step,
    train_lm,
    train_model,
)
from blocklab.nn.functional import linear
from blocklab.training.step import init_state

STEPS = 40


@pytest.fixture(scope="module")
def data():
    return TimeMachine(seq_len=16, num_train=5000, num_val=100)


@pytest.fixture(scope="module")
def model():
    # The chapter's protocol (CharLM, 2 blocks, AdamW) at reduced size.
    return CharLM(28, 32, 2, 2, max_len=16, key=jax.random.key(0))


@pytest.fixture(scope="module")
def runs(model, data):
    run = dict(key=jax.random.key(1), batch_size=16, progress=False, steps_per_call=40)
    opt = optax.adamw(1e-2, weight_decay=0.0)
    f32 = train_lm(model, data, opt, STEPS, **run)
    bf16 = train_lm(model, data, opt, STEPS, precision="bf16", **run)
    return f32, bf16


def floats(tree):
    return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_inexact_array))


def test_bf16_losses_track_the_float32_losses(runs):
    """Tolerances. bfloat16 keeps 8 significant bits: each matrix product's
    output is rounded with a relative error up to 2^-9 ~ 0.002. At step 0 the
    logits are O(0.1), so the loss (~log 28 = 3.33) moves by ~1e-4 at most:
    we allow 2e-3. After that the two runs take slightly different steps and
    drift apart as any two training runs do whose weights differ at the
    rounding level. The scale of that drift was measured on float32 alone: a
    float32 run whose initial weights are multiplied by 1 + 2^-9 N(0, 1) ends
    40 steps up to 0.03, 0.09 and 0.12 away from the unperturbed one on its
    worst step (three seeds), 0.005-0.012 on average, and 0.02-0.07 apart on
    validation. "Tracking" means the bf16 run drifts no further than that:
    every step within 0.2, the average within 0.025, validation within 0.1
    (the bf16 run: 0.107, 0.011 and 0.05 on a 2-core CPU with YNNPACK fusions
    off; 0.063 with them on). A float32 run in place of the bf16 one gives
    exactly 0, and dropping the float32 promotion of the logits (or running the
    statistics in bf16) moves step 0 by more than 2e-3."""
    f32, bf16 = runs
    assert f32.stopped is None and bf16.stopped is None
    gap = np.abs(bf16.losses - f32.losses)
    assert gap[0] <= 2e-3, gap[0]
    assert gap.max() <= 0.2, gap.max()
    assert gap.mean() <= 0.025, gap.mean()
    assert bf16.losses[-1] < bf16.losses[0] - 0.3  # and it does learn
    assert abs(bf16.val_loss - f32.val_loss) <= 0.1


def test_parameters_and_optimizer_state_stay_float32(runs):
    _, bf16 = runs
    dtypes = {leaf.dtype for leaf in floats(bf16.state)}
    assert dtypes == {np.dtype("float32")}, dtypes


def dot_operand_dtypes(jaxpr) -> set:
    """The operand dtypes of every matrix product in a jaxpr (and its sub-jaxprs)."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.add(tuple(str(v.aval.dtype) for v in eqn.invars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= dot_operand_dtypes(inner)
    return found


@pytest.mark.parametrize("precision", ["bf16", "float32"])
def test_every_matrix_product_of_the_step_runs_in_the_policy_dtype(
    model, data, precision
):
    """Forward and backward: no matrix product has two float32 operands under
    "bf16". (The attention's weights-times-values product takes the float32
    softmax weights with bf16 values, so it appears as (float32, bfloat16).)"""
    opt = optax.adam(1e-3)
    step = make_train_step(opt, data, batch_size=4, precision=precision)
    state = init_state(model, opt)
    jaxpr = jax.make_jaxpr(lambda s, k: step(s, k))(state, jax.random.key(0)).jaxpr
    dtypes = dot_operand_dtypes(jaxpr)
    if precision == "float32":
        assert dtypes == {("float32", "float32")}, dtypes
    else:
        assert ("bfloat16", "bfloat16") in dtypes
        assert all("bfloat16" in pair for pair in dtypes), dtypes


def test_the_forward_runs_in_bf16_and_the_loss_is_float32(model, data):
    """The step's loss is float32 and equals `lm_loss` of the model cast to bf16
    by hand (an independent cast) up to bf16 rounding (2^-9: fusion under the
    gradient may round intermediate products at other points)."""
    key = jax.random.key(2)
    X, Y = data.train_batch(key, 16)
    opt = optax.sgd(1.0)
    step = make_train_step(opt, data, batch_size=16, precision="bf16")
    new, loss = eqx.filter_jit(step)(init_state(model, opt), key)
    cast = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model
    )
    ref = eqx.filter_jit(lm_loss)(cast, X, Y)
    assert loss.dtype == jnp.float32 and ref.dtype == jnp.float32
    assert abs(float(loss) - float(ref)) <= 2.0**-9 * abs(float(ref))

    # SGD at rate 1: the update is minus the gradient, in float32 on float32
    # weights, finite, and close in direction to the float32 gradient.
    g16 = [o - n for o, n in zip(floats(model), floats(new.model), strict=True)]
    ref_step = make_train_step(opt, data, batch_size=16)
    new32, _ = eqx.filter_jit(ref_step)(init_state(model, opt), key)
    g32 = [o - n for o, n in zip(floats(model), floats(new32.model), strict=True)]
    assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all()) for g in g16)
    a = np.concatenate([np.ravel(g) for g in g16]).astype(np.float64)
    b = np.concatenate([np.ravel(g) for g in g32]).astype(np.float64)
    cosine = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    # bf16 rounding of activations perturbs each gradient entry by ~1%
    assert cosine > 0.99, cosine
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.1


def test_bf16_mixed_precision_keeps_float32_master_weights():
    # At lr 1e-4 each update (~1e-4) is below half a bf16 ulp of weights
    # ~0.5-2 (~2e-3-8e-3): rounding the master weights through bf16 would
    # lose every update. The float32 masters move as the float32 run does.
    def source(key):  # y = x . w_true, no noise
        x = jax.random.normal(key, (4, 3))
        return x, x @ jnp.array([1.0, -2.0, 0.5])

    w_start = jnp.array([0.7, -1.3, 1.9])
    runs = {
        p: train_model(
            Linear(w_start),
            source,
            optax.sgd(1e-4),
            3,
            key=jax.random.key(1),
            loss_fn=mse,
            run=RunConfig(precision=p, progress=False),
        )  # fmt: skip
        for p in ("float32", "bf16")
    }
    moved = {p: np.asarray(r.model.w) - np.asarray(w_start) for p, r in runs.items()}
    assert runs["bf16"].model.w.dtype == jnp.float32
    assert np.abs(moved["float32"]).min() > 1e-5
    rel = np.linalg.norm(moved["bf16"] - moved["float32"]) / np.linalg.norm(
        moved["float32"]
    )
    assert rel < 0.05, rel


@pytest.mark.float64
def test_out_dtype_accumulates_bf16_products_in_float32():
    """`linear(..., out_dtype=float32)` on bf16 operands: float32 sums of the
    exact products (vs a float64 NumPy product of the same bf16 values), ten
    times closer than the bf16-rounded product; float64 operands stay float64."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 512)), jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    wide = linear(x, w, out_dtype=jnp.float32)
    narrow = linear(x, w)
    assert wide.dtype == jnp.float32 and narrow.dtype == jnp.bfloat16
    err_wide = np.abs(np.asarray(wide, np.float64) - exact).max()
    err_narrow = np.abs(np.asarray(narrow, np.float64) - exact).max()
    assert err_wide <= 1e-5 * np.abs(exact).max(), err_wide
    assert err_narrow > 10 * err_wide
    # (the float64 marker enables float64)
    x64 = jnp.asarray(rng.normal(size=(3, 4)), jnp.float64)
    w64 = jnp.asarray(rng.normal(size=(2, 4)), jnp.float64)
    y = linear(x64, w64, out_dtype=jnp.float32)
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(y, np.asarray(x64) @ np.asarray(w64).T, rtol=1e-14)


@pytest.mark.parametrize("family", ["charlm", "gpt2"])
def test_a_bf16_models_logits_are_float32_not_bf16_rounded(family):
    """The head of a bf16 model accumulates in float32: its logits are float32
    and do not all lie on the bfloat16 grid (a bf16 product's would)."""
    key = jax.random.key(0)
    if family == "charlm":
        model = CharLM(28, 32, 2, 1, max_len=16, key=key)
    else:
        model = DecoderLM(DecoderConfig.gpt2(96, 32, 2, 1, max_len=16), key=key)
    cast = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model
    )
    tokens = jnp.arange(12) % 28
    logits = np.asarray(cast(tokens))
    assert logits.dtype == np.float32
    on_grid = logits == logits.astype(jnp.bfloat16).astype(np.float32)
    assert on_grid.mean() < 0.5, on_grid.mean()


@pytest.mark.parametrize("bad", ["float32x", jnp.int32, bool])
def test_out_dtype_must_be_a_floating_dtype(bad):
    x, w = jnp.ones((2, 3)), jnp.ones((4, 3))
    with pytest.raises(ValueError, match="linear: out_dtype must be a floating dtype"):
        linear(x, w, out_dtype=bad)
