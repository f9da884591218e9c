"""CharLM: its forward pass, causality, tied head, init, errors, and its text
(`generate_text` with the character vocabulary `VOCAB`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab import CharLM, count_params, generate_text
from blocklab.data import VOCAB, decode, encode
from blocklab.nn.ffn import ffn_width

V, D, H, L = 28, 16, 2, 8


@pytest.fixture(scope="module")
def model():
    return CharLM(V, D, H, 2, act="swiglu", max_len=L, key=jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (6,), 0, V)


def test_logits_equal_hand_composition(model, tokens):
    """Embeddings + causal loop over the blocks + RMS norm + E^T, written out."""
    T = tokens.shape[0]
    E = np.asarray(model.token_emb.weight, np.float64)
    h = np.asarray(model.token_emb.weight[tokens] + model.pos_emb.weight[:T])
    for i in range(model.num_blks):
        blk = eqx.filter_jit(model.stack.block(i))
        h = np.asarray(blk(jnp.asarray(h), jnp.arange(1, T + 1)))
    h = h.astype(np.float64)
    gain = np.asarray(model.norm.weight, np.float64)
    normed = h / np.sqrt(np.mean(h**2, axis=-1, keepdims=True) + 1e-6) * gain
    logits = eqx.filter_jit(model)(tokens)
    np.testing.assert_allclose(logits, normed @ E.T, rtol=1e-4, atol=1e-5)


def test_causal_a_token_changes_only_later_logits(model, tokens):
    fn = eqx.filter_jit(model)
    changed = tokens.at[3].set((tokens[3] + 1) % V)
    a, b = fn(tokens), fn(changed)
    np.testing.assert_allclose(a[:3], b[:3], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[3], b[3])


def test_parameter_count_is_tied_head_plus_parts(model):
    ffn = 3 * D * ffn_width(D, "swiglu")  # gate, up, down; no bias
    block = 4 * D * D + ffn + 2 * D  # attention, FFN, two RMSNorm gains
    expected = V * D + L * D + 2 * block + D  # no separate output matrix
    assert count_params(model) == expected


def test_embeddings_are_normal_002():
    lm = CharLM(V, 128, 4, 1, max_len=512, key=jax.random.key(3))
    pos = np.asarray(lm.pos_emb.weight)
    assert abs(pos.mean()) < 3 * 0.02 / np.sqrt(pos.size)
    np.testing.assert_allclose(pos.std(), 0.02, rtol=0.02)  # 65536 draws


def test_too_long_input_raises(model):
    with pytest.raises(
        ValueError, match="1 to max_len=8 token ids, got tokens.shape=\\(9,\\)"
    ):
        model(jnp.zeros(9, jnp.int32))


@pytest.mark.parametrize("bad", [28, -1])
def test_token_outside_vocab_raises_eagerly_naming_it(model, bad):
    with pytest.raises(
        ValueError,
        match=rf"token ids must lie in \[0, vocab_size=28\), got tokens\[1\]={bad}",
    ):
        model(jnp.array([1, bad, 2]))
    with pytest.raises(ValueError, match=rf"got tokens\[1, 0\]={bad}"):
        model(jnp.array([[1, 2], [bad, 3]]))


@pytest.mark.parametrize("transform", ["filter_jit", "jax.jit", "vmap"])
@pytest.mark.parametrize("bad", [28, -1])
def test_token_outside_vocab_raises_under_transforms(model, transform, bad):
    """Traced ids are checked with `eqx.error_if`: EquinoxRuntimeError under
    `eqx.filter_jit`; plain `jax.jit` wraps it in a JaxRuntimeError whose
    message still carries blocklab's text."""
    fn = {
        "filter_jit": eqx.filter_jit(model),
        "jax.jit": jax.jit(lambda t: model(t)),
        "vmap": eqx.filter_jit(jax.vmap(model)),
    }[transform]
    tokens = jnp.array([1, bad, 2])
    error = (
        jax.errors.JaxRuntimeError
        if transform == "jax.jit"
        else eqx.EquinoxRuntimeError
    )
    with pytest.raises(
        error, match=r"CharLM: token ids must lie in \[0, vocab_size=28\)"
    ):
        jax.block_until_ready(fn(tokens[None] if transform == "vmap" else tokens))


def test_bad_config_raises():
    with pytest.raises(ValueError, match=r"vocab_size must lie in \[1, inf\], got 0"):
        CharLM(0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="act must be one of"):
        CharLM(V, D, H, act="tanh", key=jax.random.key(0))


def greedy_reference(model, prompt, n):
    """Python loop: full forward on the last max_len ids, argmax of the last row."""
    ids, fn = list(encode(prompt)), eqx.filter_jit(model)
    for _ in range(n):
        ctx = jnp.asarray(ids[-model.max_len :])
        ids.append(int(jnp.argmax(fn(ctx)[-1])))
    return decode(ids)


@pytest.mark.parametrize("prompt", ["the ", "the time machine"])  # 16 > max_len
def test_text_near_zero_temperature_is_greedy(model, prompt):
    key = jax.random.key(0)
    cold = bl.GenerationConfig(temperature=1e-6)
    out = generate_text(model, VOCAB, prompt, 3, key=key, config=cold)
    assert out == greedy_reference(model, prompt, 3)
    assert generate_text(model, VOCAB, prompt, 3) == out  # key=None: greedy


def test_text_samples_from_the_vocab_and_is_keyed(model):
    def text(seed):
        return generate_text(model, VOCAB, "It was", 20, key=jax.random.key(seed))

    a = text(1)
    assert a.startswith("it was") and len(a) == 26  # preprocessed, as the corpus
    assert set(a) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert a == text(1)
    assert a != text(2)


def test_text_bad_arguments(model):
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"temperature must lie in \(0.0, inf\]"):
        generate_text(model, VOCAB, "a", 3, key=key, config=bl.GenerationConfig(0.0))
    with pytest.raises(
        ValueError, match=r"max_new_tokens must lie in \[0, inf\], got -1"
    ):
        generate_text(model, VOCAB, "a", -1, key=key)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate_text(model, VOCAB, "", 3, key=key)


def test_constant_ids_closed_over_inside_jit():
    """Ids that are a constant inside `jit` run (the eager id check uses NumPy)."""
    model = CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(0))
    ids = np.array([1, 2, 3])
    np.testing.assert_allclose(
        jax.jit(lambda: model(ids))(), model(jnp.asarray(ids)), rtol=1e-6, atol=1e-6
    )
