"""`generate`'s two decode loops (`unroll_layers`): the blocks scanned, or
run one after another on per-layer caches (`cache.unstack`,
`cache.decode_blocks`), and the weight-first output projection of a decoding
step.

References: loops of uncached full forwards (the tokens), the scanned public
`decode_step` (the logits and the cache it leaves), NumPy (the projection),
and the compiled program itself (what the unrolled loop must not do at every
step: slice weights or copy caches).
"""

from __future__ import annotations

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# the models and references of the cached-generation tests: every family, at
# widths, head ratios and windows that are not the presets' defaults, with
# embeddings of unit size (a wrong cache row changes the argmax)
from decoding import V, greedy_reference, model_of

from blocklab import ConfigError, DecoderConfig, DecoderLM, GenerationConfig, generate
from blocklab.models import decoding as _cache
from blocklab.models import generation
from blocklab.nn.functional import dense, dense_weight_first
from blocklab.nn.kv_cache import write_cache


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "name",
    ["gemma3-window3", "olmo2-mqa", pytest.param("gpt2", marks=pytest.mark.slow),
     pytest.param("charlm", marks=pytest.mark.slow)],
)  # fmt: skip
def test_both_loops_give_the_uncached_greedy_tokens(name, batch):
    """Ragged prompts, 11 new tokens (past gemma3's window of 3), one
    sequence (held without its batch axis in the unrolled loop) and three."""
    model = model_of(name)
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, V, (batch, 6)).astype(np.int32)
    lengths = np.array([6, 2, 4][:batch], np.int32)
    ref = greedy_reference(model, prompts, lengths, 11)
    for unroll in (True, False):
        cfg = GenerationConfig(unroll_layers=unroll)
        out = generate(model, prompts, 11, lengths=lengths, config=cfg)
        assert np.array_equal(out, ref), unroll


def test_sampling_and_eos_agree_between_the_loops():
    model = model_of("gemma3-window3")
    prompts = np.random.default_rng(5).integers(0, V, (4, 5)).astype(np.int32)
    kw = dict(key=jax.random.key(3), lengths=np.array([5, 1, 3, 5]))
    sampling = GenerationConfig(temperature=1.3, top_k=15)
    free = generate(model, prompts, 9, config=sampling, **kw)
    eos = int(free[0, 7])
    for extra in ({}, {"eos_id": eos}):
        outs = [
            generate(
                model,
                prompts,
                9,
                **kw,
                config=dataclasses.replace(sampling, unroll_layers=u, **extra),
            )  # fmt: skip
            for u in (True, False)
        ]
        assert np.array_equal(outs[0], outs[1])
    assert (np.asarray(outs[0][0, 7:]) == eos).all()


@eqx.filter_jit
def _unrolled_steps(model, prompts, lengths, forced):
    cache = model.init_cache(prompts.shape[:-1], prompts.shape[-1] + forced.shape[-1])
    _, cache = model.prefill(prompts, cache, lengths=lengths)
    blocks, state = _cache.unstack(model, cache)

    def step(state, tokens):
        logits, state = _cache.decode_blocks(model, blocks, tokens[..., None], state)
        return state, logits[..., 0, :]

    state, logits = jax.lax.scan(step, state, jnp.moveaxis(forced, -1, 0))
    return jnp.moveaxis(logits, 0, -2), state


@eqx.filter_jit
def _scanned_steps(model, prompts, lengths, forced):
    cache = model.init_cache(prompts.shape[:-1], prompts.shape[-1] + forced.shape[-1])
    _, cache = model.prefill(prompts, cache, lengths=lengths)

    def step(cache, tokens):
        logits, cache = model.decode_step(tokens, cache)
        return cache, logits

    cache, logits = jax.lax.scan(step, cache, jnp.moveaxis(forced, -1, 0))
    return jnp.moveaxis(logits, 0, -2), cache


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_blocks_equal_decode_step_and_leave_its_cache(batch):
    """Teacher-forced past the window: the logits of every step, and the
    per-layer caches once the last pending rows are written, equal the
    scanned `decode_step`'s (float32, 1e-5 of the logits' size)."""
    model = model_of("gemma3-window3")
    rng = np.random.default_rng(10 + batch)
    prompts = rng.integers(0, V, (batch, 5)).astype(np.int32)
    lengths = np.array([5, 1, 3][:batch], np.int32)
    forced = rng.integers(0, V, (batch, 9)).astype(np.int32)
    ours, state = _unrolled_steps(model, prompts, lengths, forced)
    ref, cache = _scanned_steps(model, prompts, lengths, forced)
    scale = float(np.abs(ref).max())
    assert scale > 1.0
    assert float(np.abs(np.asarray(ours) - np.asarray(ref)).max()) <= 1e-5 * scale
    assert np.array_equal(np.reshape(state.length, -1), np.asarray(cache.length))
    one = batch == 1  # held without its batch axis
    for i, (layer, rows) in enumerate(zip(state.layers, state.pending, strict=True)):
        done = write_cache(layer, rows, state.length - 1)
        for name in ("k", "v"):
            got = np.asarray(getattr(done, name))
            want = np.asarray(getattr(cache.layers, name)[i])
            want = want[0] if one else want
            # only the written positions: the rest is unwritten padding
            for b in range(batch):
                n = lengths[b] + 9
                axis = -1 if name == "k" else -2
                g = np.take(got[b] if not one else got, np.arange(n), axis=axis)
                w = np.take(want[b] if not one else want, np.arange(n), axis=axis)
                assert np.allclose(g, w, rtol=0, atol=1e-6), (i, name, b)


def test_decode_blocks_from_an_empty_cache():
    """No prefill: the first step rewrites row 0 (still empty) and then the
    tokens go in one by one; the logits equal `decode_step`'s."""
    model = model_of("olmo2-mqa")
    tokens = np.random.default_rng(4).integers(0, V, (2, 7)).astype(np.int32)

    @eqx.filter_jit
    def both(model, tokens):
        cache = model.init_cache((2,), 7)
        blocks, state = _cache.unstack(model, cache)

        def ours(state, t):
            logits, state = _cache.decode_blocks(model, blocks, t[:, None], state)
            return state, logits[:, 0]

        def ref(cache, t):
            logits, cache = model.decode_step(t, cache)
            return cache, logits

        return (
            jax.lax.scan(ours, state, tokens.T)[1],
            jax.lax.scan(ref, cache, tokens.T)[1],
        )

    ours, ref = both(model, tokens)
    scale = float(np.abs(ref).max())
    assert float(np.abs(np.asarray(ours) - np.asarray(ref)).max()) <= 1e-5 * scale


class _Traced(Exception):
    """Raised by the spy: the unrolled loop was chosen (nothing to compile)."""


def test_auto_unrolls_stacks_up_to_the_limit(monkeypatch):
    calls = []

    def spy(*args, **kwargs):  # stop at tracing: compiling 8 unrolled blocks
        calls.append(len(args[1]))  # would prove nothing more, slowly
        raise _Traced

    monkeypatch.setattr(_cache, "decode_blocks", spy)
    limit = generation.UNROLL_MAX_LAYERS
    prompts = np.ones((2, 3), np.int32)
    for depth, unroll, used in (
        (limit, None, True),
        (limit + 1, None, False),
        (limit + 1, True, True),
        (2, False, False),
    ):
        cfg = DecoderConfig.llama(V + depth, 8, 2, depth, ffn_width=8, max_len=8)
        model = DecoderLM(cfg, key=jax.random.key(0))
        calls.clear()
        try:
            generate(model, prompts, 2, config=GenerationConfig(unroll_layers=unroll))
        except _Traced:
            pass
        assert (calls == [depth]) if used else not calls, (depth, unroll, calls)


def _loop_body(hlo: str) -> str:
    """The text of the (only) while loop's body computation."""
    name = re.search(r"\bwhile\(.*?body=%([\w.-]+)", hlo).group(1)
    start = hlo.index(f"%{name} ")
    return hlo[start : hlo.index("\n}", start)]


@pytest.mark.parametrize("batch", [1, 3])
def test_unrolled_loop_neither_slices_weights_nor_copies_caches(batch):
    """The point of the unrolled loop: no `dynamic-slice` (the scanned loop
    takes one per weight per layer per step) and no copy of a cache-sized
    buffer in the loop body (a unit batch axis made XLA copy every cache at
    every step, until `unstack` held one sequence without it)."""
    model = model_of("gemma3-window3")
    width = 29  # the cache length, a size no weight has
    cache = model.init_cache((batch,), width)
    _, cache = model.prefill(np.ones((batch, 4), np.int32), cache)
    tokens = jnp.ones((6, batch), jnp.int32)

    @jax.jit
    def run(model, tokens, cache):
        blocks, state = _cache.unstack(model, cache)

        def step(state, t):
            return _cache.decode_blocks(model, blocks, t[..., None], state)[::-1]

        return jax.lax.scan(step, state, tokens)

    body = _loop_body(run.lower(model, tokens, cache).compile().as_text())
    assert "dynamic-slice(" not in body
    cache_copies = re.findall(rf"= f32\[[\d,]*\b{width}\b[\d,]*\]\S* copy\(", body)
    assert not cache_copies, cache_copies

    @jax.jit
    def scanned(model, tokens, cache):
        return jax.lax.scan(lambda c, t: model.decode_step(t, c)[::-1], cache, tokens)

    # the check can fail: the scanned loop does slice its weights per step
    hlo = scanned.lower(model, tokens, cache).compile().as_text()
    assert "dynamic-slice(" in hlo


def test_weight_first_projection_equals_dense():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 1, 12)).astype(np.float32)
    for bias in (True, False):
        layer = eqx.nn.Linear(12, 5, use_bias=bias, key=jax.random.key(1))
        ref = x @ np.asarray(layer.weight).T + (np.asarray(layer.bias) if bias else 0)
        for f in (dense_weight_first, dense):
            assert np.allclose(np.asarray(f(layer, jnp.asarray(x))), ref, atol=1e-5)
    one = jnp.asarray(x[0, 0])  # a single row (no leading axes)
    assert dense_weight_first(layer, one).shape == (5,)


def test_unstack_gives_each_block():
    model = model_of("gpt2")
    blocks = model.stack.unstack()
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        a = jax.tree_util.tree_leaves(block)
        b = jax.tree_util.tree_leaves(model.stack.block(i))
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_unroll_layers_must_be_a_bool_or_none():
    # (under the test suite's type checker the annotation refuses it first)
    with pytest.raises((ConfigError, TypeError), match="unroll_layers"):
        GenerationConfig(unroll_layers="yes")
