"""Cached generation: `blocklab.generate`, `DecoderLM.init_cache / prefill /
decode_step`, the sampling rules, and greedy parity with `transformers`.

References: the uncached model's logits at every position (one forward of the
whole right-padded sequences; causal, so the padding cannot matter), Python
loops of full forwards for the greedy and sampled tokens, NumPy for the
sampling filters, and `transformers`' own `generate(do_sample=False)` on
random-weight models built from configs (nothing is downloaded).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from decoding import V, forward, greedy_reference, model_of
from hf_models import mixtral_config, randomize

import blocklab as bl
from blocklab import ConfigError, DecoderConfig, DecoderLM, GenerationConfig, generate
from blocklab.models.decode_loop import filter_logits, sample_logits
from blocklab.models.decoding import DecoderCache

#: The options GenerationConfig holds (the rest are generate's arguments).
CONFIG_FIELDS = ("temperature", "top_k", "top_p", "eos_id", "unroll_layers")


@eqx.filter_jit
def _teacher_forced(model, prompts, lengths, forced):
    """Prefill ragged prompts, then decode the given tokens one per step."""
    width = prompts.shape[-1] + forced.shape[-1]
    cache = model.init_cache(prompts.shape[:-1], width)
    logits, cache = model.prefill(prompts, cache, lengths=lengths)

    def step(cache, tokens):
        out, cache = model.decode_step(tokens, cache)
        return cache, out

    cache, steps = jax.lax.scan(step, cache, jnp.moveaxis(forced, -1, 0))
    return logits, jnp.moveaxis(steps, 0, -2), cache.length


def _sequences(prompts, lengths, forced):
    """Each row's prompt (its first lengths[b] ids) then its forced ids, padded."""
    B, T = prompts.shape
    out = np.zeros((B, T + forced.shape[1]), np.int32)
    for b in range(B):
        row = np.concatenate([prompts[b, : lengths[b]], forced[b]])
        out[b, : len(row)] = row
    return out


def _assert_close(ours, ref, rtol=1e-5):
    ours, ref = np.asarray(ours), np.asarray(ref)
    scale = np.abs(ref).max()
    assert scale > 1.0  # logits of real size
    err = np.abs(ours - ref).max()
    assert err <= rtol * scale, (err, scale)


#: Two families in the default run (learned positions; windows, GQA, RoPE,
#: QK-norm, sandwich norms); the others with the slow tests.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "gemma3-window3",
        pytest.param("llama-gqa", marks=_SLOW),
        pytest.param("olmo2-mqa", marks=_SLOW),
        pytest.param("mixtral-window5", marks=_SLOW),
        pytest.param("charlm", marks=_SLOW),
    ],
)
def test_cached_logits_equal_uncached_with_ragged_prompts(name):
    """Every prefill row and every decode step equals the uncached forward at
    that position, with ragged prompts and past the window (gemma3: 3,
    mixtral: 5; total length 19)."""
    model = model_of(name)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, V, (3, 7)).astype(np.int32)
    lengths = np.array([7, 2, 5], np.int32)
    forced = rng.integers(0, V, (3, 12)).astype(np.int32)
    logits, steps, length = _teacher_forced(model, prompts, lengths, forced)
    assert np.array_equal(length, lengths + 12)
    ref = np.asarray(forward(model, _sequences(prompts, lengths, forced)))
    for b in range(3):
        n = lengths[b]
        _assert_close(logits[b, :n], ref[b, :n])
        _assert_close(steps[b], ref[b, n : n + 12])


@pytest.mark.slow
def test_single_sequence_cache_and_chunked_prefill():
    """A single sequence (T,), prefilled in two chunks, then decoded: RoPE
    positions continue from the cache's length."""
    model = model_of("llama-gqa")
    ids = np.random.default_rng(1).integers(0, V, 16).astype(np.int32)

    @eqx.filter_jit
    def chunked(model, ids):
        cache = model.init_cache((), 20)
        a, cache = model.prefill(ids[:5], cache)
        b, cache = model.prefill(ids[5:11], cache)

        def step(cache, token):
            out, cache = model.decode_step(token, cache)
            return cache, out

        cache, steps = jax.lax.scan(step, cache, ids[11:])
        return jnp.concatenate([a, b, steps]), cache

    logits, cache = chunked(model, ids)
    assert isinstance(cache, DecoderCache) and cache.batch_shape == ()
    assert int(cache.length) == 16
    _assert_close(logits, forward(model, ids))


@pytest.mark.parametrize(
    "name", ["charlm", pytest.param("gemma3-window3", marks=_SLOW)]
)
def test_greedy_generate_equals_a_loop_of_full_forwards(name):
    model = model_of(name)
    rng = np.random.default_rng(2)
    prompts = rng.integers(0, V, (3, 6)).astype(np.int32)
    lengths = np.array([6, 1, 4], np.int32)
    out = generate(model, prompts, 9, lengths=lengths)
    assert out.shape == (3, 15) and out.dtype == jnp.int32
    assert np.array_equal(out, greedy_reference(model, prompts, lengths, 9))
    # one prompt (T,) gives (T + n,): the first row alone
    one = generate(model, prompts[0], 9)
    assert one.shape == (15,) and np.array_equal(one, out[0])


def test_eos_ends_a_sequence_and_pads_with_it():
    model = model_of("llama-gqa")
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, V, (2, 5)).astype(np.int32)
    lengths = np.array([5, 3], np.int32)
    free = generate(model, prompts, 10, lengths=lengths)
    eos = int(free[0, 5 + 2])  # row 0's third new token
    out = generate(
        model, prompts, 10, lengths=lengths, config=GenerationConfig(eos_id=eos)
    )
    assert np.array_equal(out, greedy_reference(model, prompts, lengths, 10, eos))
    row0 = np.asarray(out[0])
    first = 5 + int(np.argmax(row0[5:] == eos))
    assert first <= 7 and (row0[first:] == eos).all()
    # every row ended early: the loop stopped, the rest is eos
    both = generate(
        model, prompts, 10, lengths=lengths,
        config=GenerationConfig(eos_id=int(free[1, 3])),
    )  # fmt: skip
    assert (np.asarray(both[1, 3:]) == int(free[1, 3])).all()
    assert np.array_equal(
        both, greedy_reference(model, prompts, lengths, 10, int(free[1, 3]))
    )


def test_zero_new_tokens_returns_the_prompts_padded():
    model = model_of("llama-gqa")
    prompts = np.arange(12, dtype=np.int32).reshape(2, 6)
    out = generate(
        model, prompts, 0, lengths=np.array([6, 2]), config=GenerationConfig(eos_id=9)
    )
    assert np.array_equal(out, [[0, 1, 2, 3, 4, 5], [6, 7, 9, 9, 9, 9]])


# ------------------------------------------------------------------ sampling
def _np_filter(z, temperature, top_k, top_p):
    """NumPy transcription of transformers' warpers (ascending-sort top-p)."""
    s = np.asarray(z, np.float64) / temperature
    if top_k is not None:
        kth = np.sort(s, axis=-1)[..., -top_k][..., None]
        s = np.where(s < kth, -np.inf, s)
    if top_p is not None:
        out = s.copy()
        V_ = s.shape[-1]
        rows = zip(out.reshape(-1, V_), s.reshape(-1, V_), strict=True)
        for row, srow in rows:
            order = np.argsort(srow, kind="stable")  # ascending
            p = np.exp(srow[order] - srow.max())
            p /= p.sum()
            remove = np.cumsum(p) <= 1 - top_p
            remove[-1] = False
            row[order[remove]] = -np.inf
        s = out
    return s


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, None, None),
        (0.7, 5, None),
        (1.3, None, 0.8),
        (0.9, 12, 0.5),
        (2.0, 1, 1.0),
    ],
)
def test_filter_logits_matches_a_numpy_transcription(temperature, top_k, top_p):
    z = np.random.default_rng(4).normal(0, 2, (4, 40)).astype(np.float32)
    ours = np.asarray(
        filter_logits(z, temperature=temperature, top_k=top_k, top_p=top_p)
    )
    ref = _np_filter(z, temperature, top_k, top_p)
    assert np.array_equal(np.isinf(ours), np.isinf(ref))
    kept = np.isfinite(ref)
    assert np.allclose(ours[kept], ref[kept], rtol=1e-6)


def test_samples_follow_the_filtered_distribution():
    """20000 draws against the probabilities (5-sigma bound per token)."""
    z = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    n = 20000
    keys = jax.random.split(jax.random.key(5), n)
    draw = jax.jit(
        jax.vmap(lambda k: sample_logits(z, k, temperature=0.8, top_k=6, top_p=0.9))
    )
    counts = np.bincount(np.asarray(draw(keys)), minlength=8)
    s = _np_filter(z, 0.8, 6, 0.9)
    p = np.exp(s - s.max())
    p /= p.sum()
    assert (counts[p == 0] == 0).all() and (p == 0).sum() >= 3
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) <= 5 * sigma + 1).all(), (counts, n * p)


def test_sampled_generate_equals_a_loop_with_the_same_keys():
    """Step i draws from the uncached logits with key fold_in(key, i)."""
    model = model_of("llama-gqa")
    rng = np.random.default_rng(6)
    prompts = rng.integers(0, V, (2, 4)).astype(np.int32)
    key = jax.random.key(7)
    kw = dict(temperature=1.5, top_k=20, top_p=0.9)
    config = GenerationConfig(**kw)
    out = generate(model, prompts, 6, key=key, config=config)
    seqs = np.zeros((2, 10), np.int32)
    seqs[:, :4] = prompts
    for i in range(6):
        logits = forward(model, seqs)[:, 3 + i]  # causal: the zeros after do not count
        nxt = sample_logits(logits, jax.random.fold_in(key, i), **kw)
        seqs[:, 4 + i] = np.asarray(nxt)
    assert np.array_equal(out, seqs)
    assert np.array_equal(out, generate(model, prompts, 6, key=key, config=config))
    other = generate(model, prompts, 6, key=jax.random.key(8), config=config)
    assert not np.array_equal(out, other)


# ------------------------------------------------------- one program, flat
def test_decode_program_does_not_grow_with_depth():
    """The cache is scanned with the stack: the traced step has the same size
    for 2 and 6 layers."""

    def size(num_blks):
        cfg = DecoderConfig.llama(V, 32, 4, num_blks)
        model = eqx.filter_eval_shape(DecoderLM, cfg, key=jax.random.key(0))
        cache = eqx.filter_eval_shape(model.init_cache, (2,), 16)
        tokens = jax.ShapeDtypeStruct((2,), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda m, t, c: m.decode_step(t, c))(
            model, tokens, cache
        )
        return len(str(jaxpr).splitlines())

    assert size(2) == size(6)


# ------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def small():
    return DecoderLM(
        DecoderConfig.llama(V, 32, 4, 1, max_len=12), key=jax.random.key(0)
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(ids=np.zeros(13, np.int32)),
            r"generate: ids holds prompts of T=13 tokens, longer than the model's "
            r"max_len=12",
        ),
        (
            dict(max_new_tokens=9),
            r"generate: max_new_tokens=9 does not fit: the prompt's T=4 tokens plus "
            r"max_new_tokens must not exceed the model's max_len=12 \(at most 8 new "
            r"tokens\)",
        ),
        (
            dict(max_new_tokens=-1),
            r"generate: max_new_tokens must lie in \[0, inf\], got -1",
        ),
        (dict(top_k=0), r"GenerationConfig: top_k must lie in \[1, inf\], got 0"),
        (dict(top_k=62), r"generate: top_k must lie in \[1, 61\], got 62"),
        (dict(top_p=0.0), r"GenerationConfig: top_p must lie in \(0.0, 1.0\], got 0.0"),
        (dict(top_p=1.5), r"GenerationConfig: top_p must lie in \(0.0, 1.0\], got 1.5"),
        (
            dict(key=jax.random.key(0), temperature=0.0),
            r"GenerationConfig: temperature must lie in \(0.0, inf\], got 0.0",
        ),
        (
            dict(key=jax.random.key(0), temperature=-1.0),
            r"GenerationConfig: temperature must lie in \(0.0, inf\]",
        ),
        (dict(eos_id=61), r"generate: config.eos_id must lie in \[0, 60\], got 61"),
        (
            dict(lengths=np.array([4, 5])),
            r"generate: lengths must lie in \[1, T=4\], got lengths\[1\]=5",
        ),
        (
            dict(lengths=np.array([0, 2])),
            r"generate: lengths must lie in \[1, T=4\], got lengths\[0\]=0",
        ),
        (
            dict(lengths=np.array([1, 2, 3])),
            r"generate: lengths must be integers of shape \(B,\) = \(2,\)",
        ),
        (
            dict(lengths=np.array([1.0, 2.0])),
            r"generate: lengths must be integers of shape \(B,\)",
        ),
        (
            dict(ids=np.array([[1, 2], [3, 61]])),
            r"generate: token ids must lie in \[0, vocab_size=61\), got ids\[1, 1\]=61",
        ),
        (
            dict(ids=np.ones((2, 3), np.float32)),
            r"generate: ids must be integer token ids, got dtype float32",
        ),
        (
            dict(ids=np.ones((2, 2, 3), np.int32)),
            r"generate: ids must be one prompt \(T,\) or a batch \(B, T\)",
        ),
        (dict(key=5), r"generate: key must be a JAX PRNG key, got 5"),
        (
            dict(model=bl.RMSNorm(4)),
            r"generate: model must be a DecoderLM, a CharLM or an EncoderDecoderLM, "
            r"got RMSNorm",
        ),
    ],
)
def test_bad_input_names_the_argument(small, kwargs, match):
    args = dict(model=small, ids=np.ones((2, 4), np.int32), max_new_tokens=3)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        options = {k: args.pop(k) for k in CONFIG_FIELDS if k in args}
        config = GenerationConfig(**options)  # the sampling options' own checks
        generate(
            args.pop("model"), args.pop("ids"), args.pop("max_new_tokens"),
            config=config, **args,
        )  # fmt: skip


@pytest.mark.parametrize("text", ["the time", b"the time"])
def test_text_is_refused_pointing_to_generate_text(small, text, monkeypatch):
    # as in a user's program: no run-time annotation check answers first
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(
        ConfigError,
        match=rf"generate: inputs must be token ids, got a {type(text).__name__}; "
        r"for text in and text out call blocklab.generate_text\(model, "
        r"tokenizer, prompts, max_new_tokens\)",
    ):
        generate(small, text, 3)


@pytest.mark.parametrize(
    "keys",
    [
        jax.random.split(jax.random.key(0), 2),
        jax.random.split(jax.random.PRNGKey(0), 2),
    ],
    ids=["typed", "legacy"],
)
def test_a_batch_of_keys_is_refused_by_name(small, keys):
    """`key=jax.random.split(key, 2)` failed inside `fold_in`; one key (of
    either kind) is what `generate` draws from."""
    ids = np.ones((2, 4), np.int32)
    with pytest.raises(ConfigError, match=r"generate: key must be one PRNG key, got"):
        generate(small, ids, 3, key=keys)
    assert generate(small, ids, 3, key=keys[0]).shape == (2, 7)


def test_cache_api_refuses_what_does_not_fit(small):
    with pytest.raises(
        ConfigError,
        match=r"DecoderLM.init_cache: max_len must lie in \[1, 12\], got 13",
    ):
        small.init_cache((2,), 13)
    cache = small.init_cache((2,), 8)
    with pytest.raises(
        ConfigError,
        match=r"DecoderLM.prefill: ids of shape \(3, 4\) do not fit a cache for "
        r"batch_shape=\(2,\)",
    ):
        small.prefill(np.ones((3, 4), np.int32), cache)
    with pytest.raises(
        ConfigError, match=r"DecoderLM.decode_step takes one token per sequence"
    ):
        small.decode_step(np.ones((2, 1), np.int32), cache)
    with pytest.raises(
        ConfigError, match=r"DecoderLM.init_cache: batch_shape must be a tuple"
    ):
        small.init_cache((2, 0))


# ------------------------------------------------------- transformers parity
def _hf_family(name):
    transformers = pytest.importorskip("transformers")
    quiet = dict(
        vocab_size=V, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    rope = dict(max_position_embeddings=32, **quiet)
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=32, n_head=4, n_layer=2, n_positions=32, **quiet
        )
        return transformers.GPT2LMHeadModel(cfg)
    if name == "llama":  # grouped-query: 6 query heads on 2 kv heads
        cfg = transformers.LlamaConfig(
            hidden_size=48, intermediate_size=64, num_attention_heads=6,
            num_key_value_heads=2, num_hidden_layers=2, **rope,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg)
    if name == "olmo2":
        cfg = transformers.Olmo2Config(
            hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=2, **rope,
        )  # fmt: skip
        return transformers.Olmo2ForCausalLM(cfg)
    if name == "gemma3":  # window 4 < 5 + 12 tokens
        cfg = transformers.Gemma3TextConfig(
            hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
            num_hidden_layers=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], **rope,
        )  # fmt: skip
        return transformers.Gemma3ForCausalLM(cfg)
    return transformers.MixtralForCausalLM(mixtral_config(**rope))


@pytest.mark.parametrize(
    "name",
    [
        "gemma3",
        pytest.param("llama", marks=pytest.mark.slow),
        pytest.param("gpt2", marks=pytest.mark.slow),
        pytest.param("olmo2", marks=pytest.mark.slow),
        pytest.param("mixtral", marks=pytest.mark.slow),
    ],
)
def test_greedy_tokens_equal_transformers_generate(name):
    torch = pytest.importorskip("torch")
    gemma = name == "gemma3"
    # N(0, 0.3^2) matrices, small biases, perturbed norm gains: greedy
    # continuations that change from token to token (not one repeated id).
    hf = randomize(
        _hf_family(name),
        gemma=gemma,
        matrices=0.3,
        biases=0.02,
        embeddings=0.02 if gemma else 0.3,
    )
    ids = np.random.default_rng(0).integers(0, V, (2, 5))
    with torch.no_grad():
        ref = hf.generate(
            torch.as_tensor(ids), attention_mask=torch.ones(2, 5, dtype=torch.long),
            max_new_tokens=12, do_sample=False, eos_token_id=None,
        ).numpy()  # fmt: skip
    assert len(np.unique(ref[:, 5:])) >= 6  # a continuation, not one repeated id
    ours = generate(bl.from_huggingface(hf), ids, 12)
    assert np.array_equal(ours, ref)
