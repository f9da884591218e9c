"""`generate_text`: text in, text out, through any tokenizer.

References: `blocklab.generate` on the tokenizer's ids, decoded by hand (the
id path is checked against uncached forwards in `test_generation.py`); a
Python loop of full forwards on the last `max_len` ids (past the position
table); one call per prompt for a batch of prompts.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jaxtyping
import numpy as np
import pytest

from blocklab import (
    CharLM,
    ConfigError,
    DecoderConfig,
    DecoderLM,
    GenerationConfig,
    generate,
    generate_text,
)
from blocklab.data import VOCAB, TokenDataset

V, MAX_LEN = 40, 12


class Letters:
    """A tokenizer of V symbols: id i is ALPHABET[i] (encode gives a list)."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,!"

    def encode(self, text):
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.ALPHABET[int(i)] for i in ids)


TOK = Letters()


@pytest.fixture(scope="module")
def llama():
    model = DecoderLM(
        DecoderConfig.llama(V, 32, 4, 2, num_kv_heads=2, max_len=MAX_LEN),
        key=jax.random.key(0),
    )
    # unit-size embeddings: logits of order 1-10, no near-ties for argmax
    emb = jax.random.normal(jax.random.key(1), model.token_emb.weight.shape)
    return eqx.tree_at(lambda m: m.token_emb.weight, model, emb)


@pytest.fixture(scope="module")
def charlm():
    return CharLM(28, 16, 2, 2, max_len=8, key=jax.random.key(0))


def loop_reference(model, max_len, ids, n):
    """Greedy: a full forward on the last max_len ids, argmax of its last row."""
    ids, forward = list(ids), eqx.filter_jit(model)
    for _ in range(n):
        logits = forward(np.asarray(ids[-max_len:], np.int32))
        ids.append(int(np.argmax(logits[-1])))
    return ids


def test_greedy_text_is_generate_decoded_by_hand(llama):
    prompt = "the cat sat"
    ids = np.asarray(TOK.encode(prompt), np.int32)
    want = TOK.decode(np.asarray(generate(llama, ids, 1)))
    assert generate_text(llama, TOK, prompt, 1) == want
    assert want.startswith(prompt) and len(want) == len(prompt) + 1


def test_sampled_text_is_generate_with_the_first_split_key(llama):
    prompt, key = "a dog", jax.random.key(3)
    ids = np.asarray(TOK.encode(prompt), np.int32)
    kw = dict(temperature=0.8, top_k=10, top_p=0.9)
    config = GenerationConfig(**kw)
    want = generate(llama, ids, 6, key=jax.random.split(key)[0], config=config)
    got = generate_text(llama, TOK, prompt, 6, key=key, config=config)
    assert got == TOK.decode(np.asarray(want))
    other = generate_text(llama, TOK, prompt, 6, key=jax.random.key(4), config=config)
    assert got != other


@pytest.mark.parametrize(
    ("prompt", "n"),
    [("hello", 11), ("the cat sat on the mat", 4)],  # past max_len; longer than it
)
def test_greedy_text_past_max_len_is_a_loop_of_full_forwards(llama, prompt, n):
    ids = loop_reference(llama, MAX_LEN, TOK.encode(prompt), n)
    assert generate_text(llama, TOK, prompt, n) == TOK.decode(ids)


@pytest.mark.parametrize(
    ("prompts", "n"),
    [
        (["a", "hi there", "abc"], 4),  # ragged, all cached
        (["a", "hi there", "abc"], 7),  # cached while the longest fits, then not
        (["a", "the cat sat on the mat", "hi there"], 7),  # one > max_len
    ],
)
def test_a_batch_of_prompts_is_one_call_per_prompt(llama, prompts, n):
    got = generate_text(llama, TOK, prompts, n)
    assert isinstance(got, list) and len(got) == len(prompts)
    assert got == [generate_text(llama, TOK, p, n) for p in prompts]
    assert got == [TOK.decode(loop_reference(llama, MAX_LEN, TOK.encode(p), n))
                   for p in prompts]  # fmt: skip


def test_no_new_tokens_gives_the_decoded_prompt(llama):
    assert generate_text(llama, TOK, ["ab", "c"], 0) == ["ab", "c"]
    assert generate_text(llama, TOK, ("ab", "c"), 0) == ["ab", "c"]  # a tuple too


def test_the_chapter_vocab_preprocesses_the_prompt(charlm):
    out = generate_text(charlm, VOCAB, "It was, 1895!", 3)
    ids = loop_reference(charlm, 8, VOCAB.encode("It was, 1895!"), 3)
    assert out == VOCAB.decode(ids) and out.startswith("it was ")
    assert VOCAB.decode(VOCAB.encode("It was, 1895!")) == "it was "


def test_a_text_dataset_is_a_tokenizer():
    data = TokenDataset.from_text("abcdefghijklmnopqrstuvwxyz .<>", 4)  # 30 symbols
    model = CharLM(data.vocab_size, 16, 2, 1, max_len=8, key=jax.random.key(0))
    ids = loop_reference(model, 8, data.encode("a.b"), 4)
    assert generate_text(model, data, "a.b", 4) == data.decode(ids)


class NoDecode:
    def encode(self, text):
        return [0]


class Encodes:
    def __init__(self, ids):
        self.ids = ids

    def encode(self, text):
        return self.ids

    def decode(self, ids):
        return ""


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (dict(prompts=""), r"generate_text: prompts is empty"),
        (dict(prompts=["ab", ""]), r"generate_text: prompts\[1\] is empty"),
        (dict(prompts=[]), r"generate_text: prompts must be a non-empty str or a"),
        (
            dict(prompts=b"ab"),
            r"generate_text: prompts must be a non-empty str or a non-empty list "
            r"of str, got b'ab' of type bytes",
        ),
        (
            dict(prompts=["ab", 3]),
            r"generate_text: prompts\[1\] must be a str, got 3 of type int",
        ),
        (
            dict(tokenizer=NoDecode()),
            r"generate_text: tokenizer must have encode\(str\) -> list\[int\] and "
            r"decode\(ids\) -> str methods, got NoDecode",
        ),
        (
            dict(tokenizer=Encodes([])),
            r"generate_text: tokenizer.encode\(prompts\) must give a non-empty list "
            r"of int token ids, got dtype float64, shape \(0,\)",
        ),
        (
            dict(tokenizer=Encodes([1, V])),
            r"generate_text: tokenizer.encode\(prompts\) gave token id 40 at index 1, "
            r"outside the model's vocabulary \[0, vocab_size=40\)",
        ),
        (dict(max_new_tokens=-1), r"generate_text: max_new_tokens must lie in"),
        (
            dict(config=GenerationConfig(top_k=V + 1)),
            r"generate_text: top_k must lie in \[1, 40\], got 41",
        ),
        (
            dict(config=GenerationConfig(eos_id=1)),
            r"generate_text: config.eos_id=1 does not apply to text",
        ),
        (
            dict(config={"top_p": 0.5}),
            r"generate_text: config must be a GenerationConfig",
        ),
        (dict(key=5), r"generate_text: key must be a JAX PRNG key, got 5"),
        (
            dict(model=np.zeros(3)),
            r"generate_text: model must be a DecoderLM or a CharLM, got ndarray",
        ),
    ],
)
def test_bad_input_is_refused_by_name(llama, args, match, monkeypatch):
    # as in a user's program: no run-time annotation check answers first
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    kw = {**dict(model=llama, tokenizer=TOK, prompts="ab", max_new_tokens=2), **args}
    with pytest.raises(ConfigError, match=match):
        generate_text(
            kw.pop("model"), kw.pop("tokenizer"), kw.pop("prompts"),
            kw.pop("max_new_tokens"), **kw,
        )  # fmt: skip
