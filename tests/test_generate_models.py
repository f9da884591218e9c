"""One decoding loop for every model that decodes (issue 43, item 2):
`bl.generate` on an encoder-decoder gives `greedy`'s tokens and an uncached
argmax loop's, samples as a loop over fold_in keys on uncached logits, takes
a decoder prompt and ragged sources; with `hooks=` it records the sites of
every step, equal to the rows of `capture` on the tokens it returns."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import blocklab as bl
from blocklab.models.decode_loop import sample_logits
from blocklab.nn.hooks import Hooks

SRC = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
LENS = np.array([4, 6])


def _t5(**kw):
    fields = dict(
        num_decoder_blks=3, attn_scale=1.0, act="geglu", relative_num_buckets=8,
        relative_max_distance=20, head_scale=16**-0.5, eos_token_id=None,
    )  # fmt: skip
    cfg = bl.EncoderDecoderConfig(40, 16, 4, 2, **{**fields, **kw})
    model = bl.EncoderDecoderLM(cfg, key=jax.random.key(0))
    # weights scaled up so that the tokens depend visibly on the context
    return jax.tree_util.tree_map(
        lambda a: a * 3 if eqx.is_inexact_array(a) and a.ndim == 2 else a, model
    )


def _uncached(model, src, n, lens, prompt, key=None, **sampling):
    """Token i from the logits of the whole target so far (no cache)."""
    tgt = prompt
    mask = np.arange(src.shape[-1]) < lens[:, None]
    for i in range(n):
        z = np.asarray(model(src, tgt, src_mask=mask))[:, -1]
        k = None if key is None else jax.random.fold_in(key, i)
        nxt = np.asarray(sample_logits(jnp.asarray(z), k, **sampling))
        tgt = np.concatenate([tgt, nxt[:, None]], axis=1)
    return tgt[:, prompt.shape[1] :]


def test_generate_on_t5_is_greedy_and_an_uncached_argmax_loop():
    m = _t5()
    n = 6
    got = np.asarray(bl.generate(m, SRC, n, lengths=LENS))
    assert got.shape == (2, n)
    start = np.zeros((2, 1), np.int64)  # decoder_start_token_id 0
    np.testing.assert_array_equal(got, _uncached(m, SRC, n, LENS, start))
    np.testing.assert_array_equal(got, m.greedy(SRC, n, src_lens=LENS))


def test_generate_on_t5_takes_a_decoder_prompt_and_samples():
    m = _t5()
    prompt = np.array([[0, 7, 3], [0, 2, 9]])
    got = bl.generate(m, (SRC, prompt), 5, lengths=LENS)
    np.testing.assert_array_equal(
        got, m.greedy(SRC, 5, src_lens=LENS, prompt_ids=prompt)
    )
    np.testing.assert_array_equal(got, _uncached(m, SRC, 5, LENS, prompt))
    key = jax.random.key(4)
    config = bl.GenerationConfig(temperature=1.7, top_k=12)
    sampled = bl.generate(m, (SRC, prompt), 5, key=key, config=config, lengths=LENS)
    want = _uncached(m, SRC, 5, LENS, prompt, key, temperature=1.7, top_k=12)
    np.testing.assert_array_equal(sampled, want)
    assert not np.array_equal(sampled, got)  # the key was used


def test_eos_on_t5_pads_with_the_pad_token():
    m = _t5()
    free = np.asarray(bl.generate(m, SRC, 6, lengths=LENS))
    eos = int(free[0, 2])
    config = bl.GenerationConfig(eos_id=eos)
    out = np.asarray(bl.generate(m, SRC, 6, lengths=LENS, config=config))
    for row, f in zip(out, free, strict=True):
        hits = np.flatnonzero(f == eos)
        end = hits[0] + 1 if hits.size else len(f)
        np.testing.assert_array_equal(row[:end], f[:end])
        assert (row[end:] == m.cfg.pad_token_id).all()


@pytest.mark.parametrize("family", ["llama", "charlm"])
def test_hooks_record_every_step_as_capture_does_on_the_tokens(family):
    if family == "charlm":
        model = bl.CharLM(20, 16, 4, 2, key=jax.random.key(1))
    else:
        cfg = bl.DecoderConfig.llama(30, 16, 4, 2, num_kv_heads=2, max_len=16)
        model = bl.DecoderLM(cfg, key=jax.random.key(1))
    prompt = np.array([[3, 4, 5, 6], [7, 8, 9, 1]])
    site = "blocks.*.hook_resid_post"
    S, T = 5, prompt.shape[1]
    tokens, prefill, steps = bl.generate(model, prompt, S, hooks=Hooks({site}))
    np.testing.assert_array_equal(tokens, bl.generate(model, prompt, S))
    _, whole = bl.capture(model, tokens, [site])
    whole = np.asarray(whole[site])  # (L, B, T + S, d)
    scale = np.abs(whole).max()
    np.testing.assert_allclose(prefill[site], whole[:, :, :T], atol=2e-5 * scale)
    got = np.asarray(steps[site])  # (S - 1, L, B, 1, d): the steps after the prefill
    assert got.shape == (S - 1, *whole.shape[:2], 1, whole.shape[-1])
    want = np.moveaxis(whole[:, :, T : T + S - 1], 2, 0)[..., None, :]
    np.testing.assert_allclose(got, want, atol=2e-5 * scale)


def test_bad_generation_options_are_refused_by_name(monkeypatch):
    # as in a user's program: no run-time annotation check answers first
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    for field, value in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.5)):
        with pytest.raises(bl.ConfigError, match=f"GenerationConfig: {field}"):
            bl.GenerationConfig(**{field: value})
    m = _t5()
    with pytest.raises(bl.ConfigError, match="config must be a GenerationConfig"):
        bl.generate(m, SRC, 2, config={"temperature": 0.5})
    with pytest.raises(bl.ConfigError, match="hooks must be a blocklab.nn.hooks.Hooks"):
        bl.generate(m, SRC, 2, hooks=["blocks.*.hook_resid_post"])
    with pytest.raises(bl.ConfigError, match="max_new_tokens"):
        bl.generate(m, SRC, 0)
