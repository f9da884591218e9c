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

from blocklab import DecoderConfig, DecoderLM
from blocklab._validate import ConfigError
from blocklab.functional import layer_norm, rms_norm

PRESETS = {
    "gpt2": DecoderConfig.gpt2(64, 32, 4, 2, max_len=16),
    "llama": DecoderConfig.llama(64, 32, 4, 2, num_kv_heads=2, max_len=16),
    "olmo2": DecoderConfig.olmo2(64, 32, 4, 2, max_len=16),
    "gemma3": DecoderConfig.gemma3(
        64, 32, 4, 3, num_kv_heads=1, head_dim=8, window=4, global_every=3, max_len=16
    ),
}


def _model(name, key=0):
    return DecoderLM(PRESETS[name], key=jax.random.key(key))


def _perturb(model, key=1):
    """Random norm gains and biases, so no wiring error hides behind 1s and 0s."""
    leaves, tree = jax.tree_util.tree_flatten(model)
    keys = jax.random.split(jax.random.key(key), len(leaves))
    out = [
        leaf + 0.1 * jax.random.normal(k, leaf.shape, leaf.dtype)
        if eqx.is_inexact_array(leaf) and leaf.ndim <= 2 and leaf.shape[-1] <= 64
        else leaf
        for leaf, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree_util.tree_unflatten(tree, out)


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
    model = _perturb(_model(name))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, 12))
    out = eqx.filter_jit(lambda m, x: m(x))(model, ids)
    assert out.shape == (12, 64) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _reference(model, ids), rtol=2e-5, atol=2e-5)


def test_batch_equals_each_sequence():
    model = _perturb(_model("gemma3"))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (3, 10)))
    forward = eqx.filter_jit(lambda m, x: m(x))
    batched = forward(model, ids)
    assert batched.shape == (3, 10, 64)
    single = eqx.filter_jit(jax.vmap(lambda x: model(x)))(ids)  # one sequence each
    np.testing.assert_allclose(batched, single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal(name):
    """Changing the token at position j leaves every logit before j unchanged."""
    model = _model(name)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, 10))
    changed = ids.at[6].set((ids[6] + 1) % 64)
    a, b = model(ids), model(changed)
    np.testing.assert_array_equal(a[:6], b[:6])
    assert np.abs(np.asarray(a[6:] - b[6:])).max() > 1e-4


def test_local_layer_receptive_field():
    """One local layer of window w: token 0 reaches positions 0..w-1 only."""
    cfg = dataclasses.replace(PRESETS["gemma3"], num_blks=1, global_layers=())
    model = DecoderLM(cfg, key=jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 64, 12))
    diff = np.abs(np.asarray(model(ids) - model(ids.at[0].set((ids[0] + 1) % 64))))
    per_pos = diff.max(-1)
    assert np.all(per_pos[:4] > 1e-5) and np.all(per_pos[4:] == 0.0)


def test_per_layer_data_in_one_scan():
    """Gemma-style layers differ in data, not structure: one stacked pytree."""
    model = _model("gemma3")
    att = model.stack.blocks.attention
    assert att.window.shape == (3,) and att.window.dtype == jnp.int32
    np.testing.assert_array_equal(att.window, [4, 4, 0])
    thetas = jax.lax.bitcast_convert_type(att.rope_theta, jnp.float32)
    np.testing.assert_array_equal(thetas, np.float32([1e4, 1e4, 1e6]))


def test_positions_shift_for_learned_table():
    model = _model("gpt2")
    ids = jnp.arange(8) % 64
    shifted = model(ids, positions=jnp.arange(3, 11))
    manual = eqx.tree_at(
        lambda m: m.pos_emb.weight, model, jnp.roll(model.pos_emb.weight, -3, 0)
    )
    np.testing.assert_allclose(shifted, manual(ids), rtol=1e-6, atol=1e-6)


def test_rope_positions_relative():
    """With RoPE only position differences matter: a common offset changes nothing."""
    model = _model("llama")
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 64, 8))
    np.testing.assert_allclose(
        model(ids), model(ids, positions=jnp.arange(5, 13)), rtol=1e-4, atol=1e-4
    )


def test_config_round_trip_and_presets():
    for name, cfg in PRESETS.items():
        model = DecoderLM(cfg, key=jax.random.key(0))
        again = DecoderLM(**model.config(), key=jax.random.key(0))
        assert again.cfg == cfg, name
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
    model = _model("gpt2")
    with pytest.raises(ValueError, match="max_len=16"):
        model(jnp.zeros(17, jnp.int32))
    with pytest.raises((ValueError, TypeError), match="ids"):
        model(jnp.zeros(4))  # floats (the jaxtyping hook may refuse them first)
    with pytest.raises((ValueError, TypeError), match="positions"):
        model(jnp.zeros(4, jnp.int32), positions=jnp.arange(5))
