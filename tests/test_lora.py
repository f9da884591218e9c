"""LoRA adapters (issue 33): the adapted projection against NumPy, adapters
stacked in the scanned stack, merge / unmerge, training only the adapters,
generation and capture on the adapted model, and the refusals."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blocklab as bl
from blocklab import LoRAConfig, RunConfig, SweepConfig
from blocklab._validate import ConfigError
from blocklab.interp.capture import capture
from blocklab.models.decoder import DecoderLM
from blocklab.models.decoder_config import DecoderConfig
from blocklab.models.generation import generate
from blocklab.nn.functional import dense, dense_weight_first
from blocklab.nn.lora import (
    LoRALinear,
    lora,
    lora_filter,
    lora_layers,
    lora_optimizer,
    merge_lora,
    unmerge_lora,
)
from blocklab.training.step import init_state, make_train_step

ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def _model(num_blks=2, **kw):
    cfg = DecoderConfig.llama(64, 32, 4, num_blks, num_kv_heads=2, **kw)
    return DecoderLM(cfg, key=jax.random.key(0))


def _random_B(model, key):
    """Every adapter's B drawn at random (B = 0 at init would hide the term)."""
    layers = lora_layers(model)
    keys = jax.random.split(key, len(layers))
    for (path, node), k in zip(layers.items(), keys, strict=True):
        B = 0.3 * jax.random.normal(k, node.B.shape, jnp.float32)

        def get(m, path=path):
            for name in path.split("."):
                m = getattr(m, name)
            return m.B

        model = eqx.tree_at(get, model, B)
    return model


def _np_merged(model, use_rslora=False):
    """The base model with each adapted weight replaced by W + s B A computed
    in NumPy (float64, then float32), s = alpha / r or alpha / sqrt(r): an
    independent merge."""
    base, _ = unmerge_lora(model)
    for path, node in lora_layers(model).items():
        W = np.asarray(node.base.weight, np.float64)
        A = np.asarray(node.A, np.float64)
        B = np.asarray(node.B, np.float64)
        s = node.alpha / (np.sqrt(node.rank) if use_rslora else node.rank)
        new = (W + s * np.einsum("...mr,...rn->...mn", B, A)).astype(np.float32)

        def get(m, path=path):
            for name in path.split("."):
                m = getattr(m, name)
            return m.weight

        base = eqx.tree_at(get, base, jnp.asarray(new))
    return base


IDS = jnp.asarray(np.arange(12) * 5 % 64)


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("weight_first", [False, True])
def test_adapted_layer_equals_numpy(use_rslora, weight_first):
    model = _random_B(
        lora(
            _model(),
            LoRAConfig(rank=4, alpha=6.0, targets=["q", "up"], use_rslora=use_rslora),
            key=jax.random.key(1),
        ),
        jax.random.key(2),
    )
    node = model.stack.blocks.attention.W_q
    layer0 = jax.tree.map(lambda a: a[0], node)
    x = np.random.default_rng(0).normal(size=(5, 32)).astype(np.float32)
    apply = dense_weight_first if weight_first else dense
    got = apply(layer0, jnp.asarray(x))
    s = 6.0 / np.sqrt(4) if use_rslora else 6.0 / 4
    W, A, B = (
        np.asarray(a, np.float64) for a in (layer0.base.weight, layer0.A, layer0.B)
    )
    want = x @ W.T + s * (x @ A.T) @ B.T
    assert layer0.scale == s
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "use_rslora", [pytest.param(False, marks=pytest.mark.slow), True]
)
def test_adapted_model_equals_numpy_merge(use_rslora):
    """The whole scanned model with random adapters on every projection has
    the logits of the base with W + s B A merged in NumPy."""
    model = _random_B(
        lora(
            _model(),
            LoRAConfig(rank=4, alpha=8.0, targets=ALL, use_rslora=use_rslora),
            key=jax.random.key(1),
        ),  # fmt: skip
        jax.random.key(2),
    )
    want = _np_merged(model, use_rslora)(IDS)
    np.testing.assert_allclose(model(IDS), want, rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(model(IDS) - _model()(IDS)))) > 1e-2


def test_adapters_start_as_identity_and_are_stacked():
    base = _model(num_blks=3)
    model = lora(
        base, LoRAConfig(rank=4, alpha=8.0, targets=ALL), key=jax.random.key(1)
    )
    np.testing.assert_array_equal(model(IDS), base(IDS))
    layers = lora_layers(model)
    assert len(layers) == 7  # one node per projection, all layers in it
    node = layers["stack.blocks.attention.W_k"]
    assert node.A.shape == (3, 4, 32) and node.B.shape == (3, 16, 4)
    assert node.A.dtype == node.B.dtype == jnp.float32
    np.testing.assert_array_equal(node.B, 0.0)
    assert layers["stack.blocks.ffn.W_2"].A.shape[0] == 3
    # A is Kaiming-uniform like PEFT's: within 1/sqrt(in)
    assert float(jnp.max(jnp.abs(node.A))) <= 1 / np.sqrt(32)


def test_merge_equals_adapted_and_unmerge_returns_base():
    base = _model()
    model = _random_B(
        lora(base, LoRAConfig(rank=4, alpha=8.0, targets=ALL), key=jax.random.key(1)),
        jax.random.key(2),
    )
    merged = merge_lora(model)
    assert not lora_layers(merged)
    assert isinstance(merged.stack.blocks.attention.W_q, eqx.nn.Linear)
    np.testing.assert_allclose(merged(IDS), model(IDS), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        merged.stack.blocks.ffn.W_g.weight,
        _np_merged(model).stack.blocks.ffn.W_g.weight,
        rtol=1e-6,
        atol=1e-6,
    )
    got_base, adapters = unmerge_lora(model)
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(a, b)),
        eqx.filter(got_base, eqx.is_array),
        eqx.filter(base, eqx.is_array),
    )
    assert all(jax.tree.leaves(same))
    assert jax.tree.structure(eqx.filter(got_base, eqx.is_array)) == jax.tree.structure(
        eqx.filter(base, eqx.is_array)
    )
    assert len(jax.tree.leaves(adapters)) == 14  # A and B of 7 projections


@pytest.mark.slow
def test_bf16_base_keeps_float32_adapters():
    base = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, _model()
    )
    model = lora(
        base, LoRAConfig(rank=4, alpha=8.0, targets=["q"]), key=jax.random.key(1)
    )
    node = model.stack.blocks.attention.W_q
    assert node.base.weight.dtype == jnp.bfloat16 and node.A.dtype == jnp.float32
    np.testing.assert_array_equal(model(IDS), base(IDS))


def _batches(key):
    ids = jax.random.randint(key, (4, 9), 0, 64)
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.slow
def test_only_adapters_train():
    base = _model()
    model = lora(
        base, LoRAConfig(rank=4, alpha=8.0, targets=ALL), key=jax.random.key(1)
    )
    opt = lora_optimizer(optax.adamw(1e-2, weight_decay=0.1))
    step = eqx.filter_jit(make_train_step(opt, _batches))
    state = init_state(model, opt)
    for i in range(3):
        state, loss = step(state, jax.random.key(10 + i))
    trained = state.model
    got_base, _ = unmerge_lora(trained)
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(a, b)),
        eqx.filter(got_base, eqx.is_array),
        eqx.filter(base, eqx.is_array),
    )
    assert all(jax.tree.leaves(same))  # base weights, norms, embeddings frozen
    B = trained.stack.blocks.ffn.W_2.B
    assert float(jnp.max(jnp.abs(B))) > 0.0  # the adapters moved
    assert not np.array_equal(trained(IDS), base(IDS))


def _inexact(x):
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _nbytes(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def test_optimizer_state_is_adapters_only():
    """Rank 8 on every projection of a Llama with d = 1024: Adam's state for
    the adapters is at most 2% of full fine-tuning's (shapes only)."""
    cfg = DecoderConfig.llama(256, 1024, 8, 2, num_kv_heads=2)
    model = eqx.filter_eval_shape(DecoderLM, cfg, key=jax.random.key(0))
    adapted = eqx.filter_eval_shape(
        lambda m: lora(
            m, LoRAConfig(rank=8, alpha=16.0, targets=ALL), key=jax.random.key(1)
        ),
        model,
    )
    full = _nbytes(jax.eval_shape(optax.adam(1e-3).init, eqx.filter(model, _inexact)))
    ad_params = eqx.filter(adapted, _inexact)
    small = _nbytes(jax.eval_shape(lora_optimizer(optax.adam(1e-3)).init, ad_params))
    adapters = _nbytes(eqx.filter(adapted, lora_filter(adapted)))
    assert small == pytest.approx(2 * adapters, rel=1e-3)  # mu and nu, no more
    assert small / full <= 0.02, small / full


@pytest.mark.slow
def test_generate_with_adapters_equals_merged():
    model = _random_B(
        lora(
            _model(max_len=64),
            LoRAConfig(rank=4, alpha=8.0, targets=ALL),
            key=jax.random.key(1),
        ),  # fmt: skip
        jax.random.key(2),
    )
    merged = merge_lora(model)
    prompt = IDS[:5]
    greedy = generate(model, prompt, 30)
    np.testing.assert_array_equal(greedy, generate(merged, prompt, 30))
    base_greedy = generate(_model(max_len=64), prompt, 30)
    assert not np.array_equal(greedy, base_greedy)
    key = jax.random.key(7)
    sampled = generate(model, prompt, 30, key=key)
    np.testing.assert_array_equal(sampled, generate(merged, prompt, 30, key=key))
    assert sampled.shape[-1] == 35


def test_capture_sees_the_adapted_model():
    model = _random_B(
        lora(
            _model(),
            LoRAConfig(rank=4, alpha=8.0, targets=["q", "down"]),
            key=jax.random.key(1),
        ),  # fmt: skip
        jax.random.key(2),
    )
    sites = ["blocks.*.attn.hook_q", "blocks.*.hook_resid_post"]
    out, values = capture(model, IDS, sites)
    out_m, values_m = capture(merge_lora(model), IDS, sites)
    np.testing.assert_allclose(out, model(IDS), rtol=1e-6, atol=1e-6)
    for name in values_m:
        np.testing.assert_allclose(values[name], values_m[name], rtol=1e-4, atol=1e-4)
    _, values_b = capture(_model(), IDS, sites)
    name = next(n for n in values if "hook_q" in n)
    assert float(jnp.max(jnp.abs(values[name] - values_b[name]))) > 1e-3


def test_refusals():
    m = _model()
    k = jax.random.key(1)
    with pytest.raises(ConfigError, match="target 'x' is not a projection"):
        lora(m, LoRAConfig(rank=4, alpha=8.0, targets=["x"]), key=k)
    with pytest.raises(ConfigError, match="'gate' names no layer"):
        lora(_model(act="gelu"), LoRAConfig(rank=4, alpha=8.0, targets=["gate"]), key=k)
    with pytest.raises(ConfigError, match="rank must lie"):
        lora(m, LoRAConfig(rank=0, alpha=8.0, targets=["q"]), key=k)
    with pytest.raises(ConfigError, match=r"rank must lie in \[1, min"):
        lora(m, LoRAConfig(rank=17, alpha=8.0, targets=["k"]), key=k)  # k is 16 x 32
    with pytest.raises(ConfigError, match="alpha must be finite"):
        lora(m, LoRAConfig(rank=4, alpha=float("nan"), targets=["q"]), key=k)
    with pytest.raises(ConfigError, match="alpha must be finite"):
        lora(m, LoRAConfig(rank=4, alpha=float("inf"), targets=["q"]), key=k)
    once = lora(m, LoRAConfig(rank=4, alpha=8.0, targets=["q"]), key=k)
    with pytest.raises(ConfigError, match="adding adapters twice"):
        lora(once, LoRAConfig(rank=4, alpha=8.0, targets=["q", "v"]), key=k)
    with pytest.raises(ConfigError, match="'experts' is not supported yet"):
        lora(m, LoRAConfig(rank=4, alpha=8.0, targets=["experts"]), key=k)
    with pytest.raises(ConfigError, match="dropout"):
        lora(m, LoRAConfig(rank=4, alpha=8.0, targets=["q"], dropout=0.1), key=k)
    with pytest.raises(ConfigError, match="no adapters"):
        unmerge_lora(m)
    assert isinstance(once.stack.blocks.attention.W_q, LoRALinear)


@pytest.mark.slow
def test_train_model_trains_only_adapters():
    """`train_model` with `lora_optimizer`: the base is the same bit for bit,
    the adapters moved, and the result merges like any adapted model."""
    from blocklab.training.run import train_model

    base = _model()
    model = lora(
        base,
        LoRAConfig(rank=4, alpha=8.0, targets=["q", "v", "down"]),
        key=jax.random.key(1),
    )
    opt = lora_optimizer(optax.adam(1e-2))
    result = train_model(
        model,
        _batches,
        opt,
        4,
        key=jax.random.key(3),
        run=RunConfig(steps_per_call=2, progress=False),
    )
    trained = result.model
    got_base, _ = unmerge_lora(trained)
    leaves = jax.tree.leaves(eqx.filter(got_base, eqx.is_array))
    want = jax.tree.leaves(eqx.filter(base, eqx.is_array))
    assert all(np.array_equal(a, b) for a, b in zip(leaves, want, strict=True))
    assert float(jnp.max(jnp.abs(trained.stack.blocks.attention.W_v.B))) > 0.0
    np.testing.assert_allclose(
        merge_lora(trained)(IDS), trained(IDS), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_train_sweep_over_adapters_equals_single_runs():
    """`train_sweep` over adapters (2 learning rates x 2 seeds), with
    `lora_optimizer` inside `inject_hyperparams`: each member equals its own
    `train_model` run, and every member's base stays the original."""
    from blocklab.training.run import train_model
    from blocklab.training.sweep import train_sweep

    base = _model()

    def make(k):
        return lora(base, LoRAConfig(rank=4, alpha=8.0, targets=["q", "v"]), key=k)

    opt = optax.inject_hyperparams(
        lambda learning_rate: lora_optimizer(optax.adam(learning_rate)),
        hyperparam_dtype=jnp.float32,
    )(learning_rate=1.0)
    rates = [1e-2, 3e-2, 1e-2, 3e-2]
    result = train_sweep(
        make,
        _batches,
        3,
        model_keys=[0, 0, 1, 1],
        data_keys=[0, 0, 1, 1],
        run=RunConfig(progress=False),
        sweep=SweepConfig(learning_rates=rates, optimizer=opt, validate=False),
    )
    for k in (1, 2):
        one = train_model(
            make(jax.random.key(k // 2)),
            _batches,
            lora_optimizer(optax.adam(rates[k])),
            3,
            key=jax.random.key(k // 2),
            run=RunConfig(progress=False),
        )
        member = jax.tree.map(
            lambda a, k=k: a[k], eqx.filter(result.state.model, eqx.is_array)
        )
        for a, b in zip(jax.tree.leaves(member),
                        jax.tree.leaves(eqx.filter(one.model, eqx.is_array)),
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        got_base, _ = unmerge_lora(one.model)
        for a, b in zip(jax.tree.leaves(eqx.filter(got_base, eqx.is_array)),
                        jax.tree.leaves(eqx.filter(base, eqx.is_array)),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # kept out of the default run for CI time
def test_block_and_stack_take_adapters():
    """A lone `TransformerBlock` gets unstacked adapters `(r, n)`; a `Stack`
    gets stacked ones; both equal the NumPy merge."""
    from blocklab.nn.block import TransformerBlock
    from blocklab.nn.stack import Stack

    x = jnp.asarray(np.random.default_rng(1).normal(size=(6, 32)), jnp.float32)
    block = TransformerBlock(32, 4, key=jax.random.key(0))
    stack = Stack(lambda k: TransformerBlock(32, 4, key=k), 2, key=jax.random.key(0))
    for model, shape in ((block, (4, 32)), (stack, (2, 4, 32))):
        adapted = lora(
            model,
            LoRAConfig(rank=4, alpha=2.0, targets=["o", "up"]),
            key=jax.random.key(1),
        )
        assert lora_layers(adapted)[next(iter(lora_layers(adapted)))].A.shape == shape
        np.testing.assert_array_equal(adapted(x), model(x))
        adapted = _random_B(adapted, jax.random.key(2))
        np.testing.assert_allclose(
            adapted(x), _np_merged(adapted)(x), rtol=1e-4, atol=1e-4
        )


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_bf16_base_trains_float32_adapters(precision):
    """A bf16 base with float32 adapters trains under `train_model`: the
    adapters stay float32 and move, the bf16 base is the same bit for bit."""
    from blocklab.training.run import train_model

    base = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, _model()
    )
    model = lora(
        base,
        LoRAConfig(rank=4, alpha=8.0, targets=["q", "down"]),
        key=jax.random.key(1),
    )
    result = train_model(
        model,
        _batches,
        lora_optimizer(optax.adam(1e-2)),
        3,
        key=jax.random.key(2),
        run=RunConfig(precision=precision, progress=False),
    )
    trained = result.model
    assert trained.stack.blocks.attention.W_q.A.dtype == jnp.float32
    assert trained.stack.blocks.attention.W_q.base.weight.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(trained.stack.blocks.ffn.W_2.B))) > 0.0
    got_base, _ = unmerge_lora(trained)
    for a, b in zip(jax.tree.leaves(eqx.filter(got_base, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(base, eqx.is_array)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)


def test_adapters_take_the_logical_axes_of_the_weight_they_adapt():
    """Sharding follows the base: A (r, in) is split as the weight's input
    axis, B (out, r) as its output axis, the rank replicated (asserted on
    `logical_axes`, which `shard` turns into the arrays' shardings)."""
    from jax.sharding import PartitionSpec as P

    from blocklab.training.placement import logical_axes

    cfg = bl.DecoderConfig(64, 32, 4, 2, num_kv_heads=2, positions="rope")
    base = bl.DecoderLM(cfg, key=jax.random.key(0))
    model = bl.lora(
        base,
        bl.LoRAConfig(rank=4, alpha=8.0, targets=("q", "o", "up", "down")),
        key=jax.random.key(1),
    )
    axes = logical_axes(model)
    plain = logical_axes(base)
    for name, proj in (("W_q", "attention"), ("W_o", "attention"),
                       ("W_1", "ffn"), ("W_2", "ffn")):  # fmt: skip
        lin = getattr(getattr(axes.stack.blocks, proj), name)
        weight = getattr(getattr(plain.stack.blocks, proj), name).weight
        layer, out, inp = tuple(weight)
        assert lin.base.weight == weight
        assert lin.A == P(layer, None, inp) and lin.B == P(layer, out, None), name
