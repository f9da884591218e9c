"""`DecoderConfig` and `DecoderLM` without torch: wiring, causality, windows, errors.

The logits of the converted families are checked against `transformers` in
test_huggingface.py; here each property is checked against an independent
composition of blocklab's own pieces (the blocks applied one by one in Python,
outside the scan) or against a closed-form consequence (causality, the
receptive field of a local layer).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab import DecoderConfig, DecoderLM, load_state_dict
from blocklab._validate import ConfigError
from blocklab.interop.porting import param_shapes
from blocklab.models.decoder import set_layer_data as _set_layer_data
from blocklab.nn.functional import layer_norm, rms_norm

PRESETS = {
    "gpt2": DecoderConfig.gpt2(64, 32, 4, 2, max_len=16),
    "llama": DecoderConfig.llama(64, 32, 4, 2, num_kv_heads=2, max_len=16),
    "olmo2": DecoderConfig.olmo2(64, 32, 4, 2, max_len=16),
    "gemma3": DecoderConfig.gemma3(
        64, 32, 4, 3, num_kv_heads=1, head_dim=8, window=4, global_every=3, max_len=16
    ),
}


#: One jitted forward for every test (compiled once per structure and shape).
forward = eqx.filter_jit(lambda model, ids, **kw: model(ids, **kw))


def _random_model(cfg, seed=0):
    """A `DecoderLM` of `cfg` with random weights, drawn on the host.

    Norm gains and biases are perturbed away from 1 and 0, so no wiring error
    hides behind them. Building from the abstract structure and NumPy draws
    avoids compiling the initializer (a few seconds per configuration); the
    constructor itself is tested in `test_per_layer_data_in_one_scan`.
    """
    if isinstance(cfg, str):
        cfg = PRESETS[cfg]
    skeleton = eqx.filter_eval_shape(DecoderLM, cfg, key=jax.random.key(0))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in param_shapes(skeleton).items():
        noise = rng.standard_normal(shape).astype(np.float32)
        if "norm" in name and name.endswith("weight"):
            offset = 0.0 if cfg.norm == "gemma_rms" else 1.0
            weights[name] = offset + 0.1 * noise
        elif len(shape) == 2:
            weights[name] = noise / np.sqrt(shape[-1])
        else:
            weights[name] = 0.1 * noise
    model = load_state_dict(skeleton, weights)
    return eqx.tree_at(lambda m: m.stack, model, _set_layer_data(model.stack, cfg))


@eqx.filter_jit
def _reference(model, ids):
    """The forward pass composed by hand: blocks one by one, no scan."""
    cfg = model.cfg
    T = ids.shape[-1]
    h = model.token_emb.weight[ids]
    if cfg.embed_scale is not None:
        h = h * jnp.float32(cfg.embed_scale)
    if cfg.positions == "learned":
        h = h + model.pos_emb.weight[:T]
    for i in range(cfg.num_blks):
        h = model.stack.block(i)(h, jnp.arange(1, T + 1))
    if cfg.norm == "layer":
        h = layer_norm(h, model.norm.weight, model.norm.bias, cfg.norm_eps)
    elif cfg.norm == "gemma_rms":
        h = rms_norm(h, 1.0 + model.norm.weight, cfg.norm_eps)
    else:
        h = rms_norm(h, model.norm.weight, cfg.norm_eps)
    return h @ model.head_weight.T


@pytest.mark.parametrize("name", list(PRESETS))
def test_forward_equals_blocks_applied_one_by_one(name):
    model = _random_model(name)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, 12))
    out = forward(model, ids)
    assert out.shape == (12, 64) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _reference(model, ids), rtol=2e-5, atol=2e-5)


def test_batch_equals_each_sequence():
    model = _random_model("gemma3")
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (3, 10)))
    batched = forward(model, ids)
    assert batched.shape == (3, 10, 64)
    single = eqx.filter_jit(jax.vmap(lambda x: model(x)))(ids)  # one sequence each
    np.testing.assert_allclose(batched, single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal(name):
    """Changing the token at position j leaves every logit before j unchanged."""
    model = _random_model(name)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, 10))
    changed = ids.at[6].set((ids[6] + 1) % 64)
    a, b = forward(model, ids), forward(model, changed)
    np.testing.assert_array_equal(a[:6], b[:6])
    assert np.abs(np.asarray(a[6:] - b[6:])).max() > 1e-4


def test_local_layer_receptive_field():
    """One local layer of window w: token 0 reaches positions 0..w-1 only."""
    cfg = dataclasses.replace(PRESETS["gemma3"], num_blks=1, global_layers=())
    model = _random_model(cfg)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 64, 12))
    other = ids.at[0].set((ids[0] + 1) % 64)
    diff = np.abs(np.asarray(forward(model, ids) - forward(model, other)))
    per_pos = diff.max(-1)
    assert np.all(per_pos[:4] > 1e-5) and np.all(per_pos[4:] == 0.0)


def test_per_layer_data_in_one_scan():
    """Gemma-style layers differ in data, not structure: one stacked pytree."""
    model = DecoderLM(PRESETS["gemma3"], key=jax.random.key(0))
    att = model.stack.blocks.attention
    assert att.window.shape == (3,) and att.window.dtype == jnp.int32
    np.testing.assert_array_equal(att.window, [4, 4, 0])
    thetas = jax.lax.bitcast_convert_type(att.rope_theta, jnp.float32)
    np.testing.assert_array_equal(thetas, np.float32([1e4, 1e4, 1e6]))


def test_positions_shift_for_learned_table():
    model = _random_model("gpt2")
    ids = jnp.arange(8) % 64
    shifted = forward(model, ids, positions=jnp.arange(3, 11))
    manual = eqx.tree_at(
        lambda m: m.pos_emb.weight, model, jnp.roll(model.pos_emb.weight, -3, 0)
    )
    np.testing.assert_allclose(shifted, forward(manual, ids), rtol=1e-6, atol=1e-6)


def test_rope_positions_relative():
    """With RoPE only position differences matter: a common offset changes nothing."""
    model = _random_model("llama")
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 64, 8))
    np.testing.assert_allclose(
        forward(model, ids),
        forward(model, ids, positions=jnp.arange(5, 13)),
        rtol=1e-4,
        atol=1e-4,
    )


def test_config_round_trip_and_presets():
    for name, cfg in PRESETS.items():
        again = DecoderConfig(**{**cfg.to_dict(), "global_layers": cfg.global_layers})
        assert again == cfg, name
    # The checkpoint convention: DecoderLM(**model.init_args(), key=...) rebuilds it
    # (the same configuration as test_per_layer_data_in_one_scan: no new compile).
    model = DecoderLM(PRESETS["gemma3"], key=jax.random.key(0))
    again = DecoderLM(**model.init_args(), key=jax.random.key(0))
    assert again.cfg == model.cfg
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(model), leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    g = DecoderConfig.gemma3(num_blks=12)
    assert g.global_layers == (5, 11) and g.attn_scale == 16**-0.5
    assert g.embed_scale == 8.0 and g.layer_windows()[5] == 0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(num_hiddens=30), "head_dim"),
        (dict(act="tanh"), "act"),
        (dict(norm="batch"), "norm"),
        (dict(qk_norm="yes"), "qk_norm"),
        (dict(positions="alibi"), "positions"),
        (dict(window=4, global_layers=(5,)), r"global_layers\[i\]"),
        (dict(window=4, global_layers=(1, 0)), "sorted"),
        (dict(global_layers=(0,)), "needs a window"),
        (dict(local_rope_theta=1e4), "needs local"),
        (dict(positions="learned", rope_theta=1e4), "needs positions='rope'"),
        (dict(max_len=0), "max_len"),
        (dict(num_blks=True), "num_blks"),
        (dict(norm_eps=float("nan")), "norm_eps"),
        (dict(head_dim=7), "even head_dim"),
    ],
)
def test_config_errors_name_the_field(kw, match):
    base = dict(vocab_size=64, num_hiddens=32, num_heads=4, num_blks=2)
    with pytest.raises(ConfigError, match=match):
        DecoderConfig(**{**base, **kw})


def test_call_errors():
    model = _random_model("gpt2")
    with pytest.raises(ValueError, match="max_len=16"):
        model(jnp.zeros(17, jnp.int32))
    with pytest.raises((ValueError, TypeError), match="ids"):
        model(jnp.zeros(4))  # floats (the jaxtyping hook may refuse them first)
    with pytest.raises((ValueError, TypeError), match="positions"):
        model(jnp.zeros(4, jnp.int32), positions=jnp.arange(5))


def test_import_does_not_load_torch():
    """torch and transformers are a test extra: `import blocklab` never imports them."""
    import subprocess
    import sys

    code = (
        "import sys, blocklab; "
        "blocklab.DecoderLM; blocklab.from_huggingface; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
