"""Capture while generating (`blocklab.interp.decoding.capture_generate`,
issue 32): the values recorded at each generated token equal those of the
same tokens run at once (`capture` on the whole sequence, an uncached
forward), the tokens equal `blocklab.generate`'s, an edit acts on every
step as `intervene` does on the same prefix, and bad requests are refused
by name."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decoding import sharpen

import blocklab as bl
from blocklab import CharLM, DecoderConfig, DecoderLM
from blocklab.interp import capture, intervene, steer
from blocklab.interp.decoding import capture_generate

V = 29
T, S = 5, 4

#: RoPE with grouped-query heads and a window (3, shorter than the sequence)
#: on its local layer 0 (layer 1 global), learned positions (GPT-2), and the
#: character model.
MODELS = {
    "rope-gqa-window3": lambda k: DecoderLM(
        DecoderConfig.llama(
            V, 32, 4, 2, num_kv_heads=2, window=3, global_layers=(1,), max_len=12
        ),
        key=k,
    ),
    "learned": lambda k: DecoderLM(DecoderConfig.gpt2(V, 32, 4, 2, max_len=12), key=k),
    "charlm": lambda k: CharLM(V, 32, 4, 2, max_len=12, key=k),
}

SITES = [
    "hook_embed",
    "blocks.*.hook_resid_post",
    "blocks.*.attn.hook_rot_k",
    "blocks.*.attn.hook_z",
    "blocks.1.mlp.hook_post",  # one layer of a stacked site
    "unembed.hook_out",
]


@functools.cache
def _model(name, x64):
    return sharpen(MODELS[name](jax.random.key(0)), 1)


def model_of(name):
    """Built once per module run (and precision: the cache keys on it)."""
    return _model(name, jax.config.jax_enable_x64)


#: The whole-sequence reference, compiled once per model structure and shape.
capture_at_once = jax.jit(capture, static_argnums=2)


def prompt_of(batch):
    rng = np.random.default_rng(7)
    return jnp.asarray(rng.integers(0, V, (2, T) if batch else (T,)), jnp.int32)


def token_axis(name, value):
    """The token axis of a value captured on a whole sequence."""
    # (..., T, heads, p) for the attention's sites, (..., T, width) otherwise
    return value.ndim - (3 if ".attn.hook_" in name else 2)


#: Sampling options (the draws differ from greedy decoding on these models).
SAMPLE = dict(key=jax.random.key(3), temperature=0.7, top_k=8, top_p=0.9)


@pytest.mark.parametrize(
    "name,batch,sample",
    [
        ("rope-gqa-window3", False, True),
        pytest.param("learned", True, False, marks=pytest.mark.slow),
        ("charlm", False, False),
    ],
)
def test_captures_while_generating_equal_the_whole_sequence(name, batch, sample):
    """Prefill values = the prompt's rows of `capture(tokens)` (an uncached
    forward of the generated tokens); step s = its row T - 1 + s. The tokens
    are `generate`'s with the same arguments; greedy ones are the argmax of
    the uncached logits of row T - 1 + s, sampled ones among their top_k."""
    model, prompt = model_of(name), prompt_of(batch)
    opts = SAMPLE if sample else {}
    tokens, pre, steps = capture_generate(model, prompt, S, SITES, **opts)
    assert tokens.shape == (*prompt.shape[:-1], T + S) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens[..., :T], prompt)
    _, ref = capture_at_once(model, tokens, tuple(SITES))
    assert set(pre) == set(steps) == set(ref)
    for site, whole in ref.items():
        whole = np.asarray(whole)
        axis = token_axis(site, whole)
        scale = np.abs(whole).max()
        want_pre = np.take(whole, np.arange(T), axis=axis)
        want_steps = np.moveaxis(
            np.take(whole, np.arange(T - 1, T - 1 + S), axis=axis), axis, 0
        )
        assert pre[site].shape == want_pre.shape, site
        assert steps[site].shape == want_steps.shape, site
        np.testing.assert_allclose(pre[site], want_pre, atol=2e-5 * scale, err_msg=site)
        np.testing.assert_allclose(
            steps[site], want_steps, atol=2e-5 * scale, err_msg=site
        )
    logits = np.asarray(ref["unembed.hook_out"])[..., T - 1 : T - 1 + S, :]
    new = np.asarray(tokens[..., T:])
    if sample:
        rank = (logits > np.take_along_axis(logits, new[..., None], -1)).sum(-1)
        assert np.all(rank < SAMPLE["top_k"])
        assert not np.array_equal(new, logits.argmax(-1))  # the key was used
    else:
        np.testing.assert_array_equal(new, logits.argmax(-1))
    if name != "charlm":
        config = bl.GenerationConfig(**{k: v for k, v in opts.items() if k != "key"})
        generated = bl.generate(model, prompt, S, key=opts.get("key"), config=config)
        np.testing.assert_array_equal(tokens, generated)


def test_steering_while_generating_equals_intervene_on_the_prefix():
    """A steering vector at layer 0's `hook_resid_post`, on every prompt row
    and every generated token: the logits of step s are those of
    `intervene` on the tokens up to T + s (its last row), and the tokens are
    their argmax; the steer changes the tokens."""
    model, prompt = model_of("rope-gqa-window3"), prompt_of(False)
    v = 3.0 * jax.random.normal(jax.random.key(11), (32,))
    edits = {"blocks.0.hook_resid_post": steer(v, scale=2.0)}
    tokens, _, steps = capture_generate(
        model, prompt, S, "unembed.hook_out", edits=edits
    )
    got = np.asarray(steps["unembed.hook_out"])
    # step by step: the edited model on the prefix, its last row
    for s in (2,):
        want = np.asarray(intervene(model, tokens[: T + s], edits))[-1]
        np.testing.assert_allclose(got[s], want, atol=2e-5 * np.abs(want).max())
    # all steps at once (the steer acts row by row, so causality holds)
    whole = np.asarray(intervene(model, tokens, edits))[T - 1 : T - 1 + S]
    np.testing.assert_allclose(got, whole, atol=2e-5 * np.abs(whole).max())
    np.testing.assert_array_equal(tokens[T:], whole.argmax(-1))
    # the edit acts while decoding: the plain model's choices differ
    plain = np.asarray(model(tokens))[T - 1 : T - 1 + S]
    assert not np.array_equal(plain.argmax(-1), whole.argmax(-1))


def test_refused_while_decoding(plain_python):
    """The scores and the pattern exist only on the whole sequence: refused
    by name, for capture and for edits, with the way out; an unknown site,
    `sites` of the wrong type and a model without a cache are named."""
    model, prompt = model_of("rope-gqa-window3"), prompt_of(False)
    for sites in ("blocks.*.attn.hook_pattern", ["blocks.1.attn.hook_attn_scores"]):
        with pytest.raises(bl.ConfigError, match="hook_(pattern|attn_scores)") as e:
            capture_generate(model, prompt, 2, sites)
        assert "whole sequence" in str(e.value) and "capture(" in str(e.value)
    with pytest.raises(bl.ConfigError, match="edits 'blocks.0.attn.hook_pattern'"):
        capture_generate(
            model, prompt, 2, "hook_embed",
            edits={"blocks.0.attn.hook_pattern": lambda a, layer: a},
        )  # fmt: skip
    with pytest.raises(bl.ConfigError, match="'blocks.*.hook_resid_pots' matches no"):
        capture_generate(model, prompt, 2, "blocks.*.hook_resid_pots")
    with pytest.raises(bl.ConfigError, match="sites must be a site name"):
        capture_generate(model, prompt, 2, 3)
    with pytest.raises(bl.ConfigError, match="model must be a DecoderLM or a CharLM"):
        capture_generate(model.stack, prompt, 2, "hook_embed")
    with pytest.raises(bl.ConfigError, match="max_new_tokens=8 exceed"):
        capture_generate(model, prompt, 8, "hook_embed")
    with pytest.raises(bl.ConfigError, match="prompt must be integer token ids"):
        capture_generate(model, prompt.astype(jnp.float32), 2, "hook_embed")
    with pytest.raises(bl.ConfigError, match="prompt"):
        capture_generate(model, prompt.at[1].set(V), 2, "hook_embed")
    with pytest.raises(bl.ConfigError, match="edits\\['hook_embed'\\] must be"):
        capture_generate(model, prompt, 2, "hook_embed", edits={"hook_embed": 1.0})
