"""Streaming text: `IncrementalDecoder` and `stream_text`.

The reference for every piece is the tokenizer decoding all the ids at once:
the pieces joined are `decode(context + ids)` after `decode(context)`. The
tokenizers are built here with `tokenizers` alone (nothing downloads, no
`transformers`), on an English text, so that any other character is several
tokens:

- `gpt2`: byte-level BPE (a character is its UTF-8 bytes, as GPT-2 writes it);
- `llama`: byte-fallback BPE with a `Metaspace` pre-tokenizer and the decoder
  `transformers` 5 writes for `LlamaTokenizer` (`▁` to space, bytes, fuse,
  strip the first space), BOS added by the post-processor.

The models: a random `DecoderLM` (unit-size embeddings, so that greedy
choices have no near-ties), checked against `blocklab.generate` and
`generate_text`; and a *chain* model, whose next token depends on the last
one only (attention and MLP outputs zeroed) and follows a cycle of ids set by
hand: greedy decoding then writes a chosen text whose characters span several
tokens (an emoji as 4 byte tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import blocklab as bl
from blocklab import ConfigError
from blocklab.text.generation import stream_text
from blocklab.text.streaming import IncrementalDecoder

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "the cat sat on the mat and the dog ran in the park",
    "Once upon a time there was a small house by the river.",
    "Hello world! How are you today? I am fine, thank you.",
    "She said that it was not far, and they walked on.",
    "[user] hi [assistant] hello",
] * 4

#: Text that is not in CORPUS: multi-byte characters (2, 3 and 4 bytes, a ZWJ
#: sequence, a flag), leading and inner spaces, special tokens written out.
TEXTS = [
    "Hello 🦀 crab",
    " naïve café — “quotes” ½ €",
    "日本語の文章 and Съешь",
    "emoji 🙂👍🏽 👩‍👩‍👧 🇫🇷!",
    "  two spaces  then  more",
    "<s> tokens </s> written <|endoftext|> out",
]

LLAMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)

FAMILIES = ("gpt2", "llama")

#: The models' max_len: tests that decode up to it share compiled programs
#: (one cache size).
MAX_LEN = 32


def write_tokenizer(folder: Path, family: str, *, vocab_size: int = 300) -> Path:
    """A GPT-2-style or Llama-style tokenizer folder (`tokenizer.json`,
    `tokenizer_config.json`), trained on CORPUS with `tokenizers` alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    folder.mkdir(parents=True, exist_ok=True)
    if family == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials, alphabet = ["<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet()
        config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
        alphabet = []
        config = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": LLAMA_CHAT,
        }
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if family == "llama":
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)]
        )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    return folder


def random_model(vocab: int, *, max_len: int = MAX_LEN, seed: int = 0) -> bl.DecoderLM:
    """A small Llama-style model with unit-size embeddings (logits of order
    1-10: no near-ties for argmax)."""
    cfg = bl.DecoderConfig.llama(vocab, 32, 4, 2, num_kv_heads=2, max_len=max_len)
    model = bl.DecoderLM(cfg, key=jax.random.key(seed))
    emb = jax.random.normal(jax.random.key(seed + 1), model.token_emb.weight.shape)
    return eqx.tree_at(lambda m: m.token_emb.weight, model, emb)


def chain_model(vocab: int, cycle, *, max_len: int = MAX_LEN) -> bl.DecoderLM:
    """A model whose greedy next token after `cycle[i]` is `cycle[i + 1]`
    (cyclically): attention and MLP write nothing (W_o = W_2 = 0), so the
    final stream is the last token's embedding $e_a$, and the head row of
    the next id is $10\\, e_a / |e_a|$ (the others are small): its logit
    $10 |e_a|$ beats $10\\, e_a \\cdot e_b / |e_a|$ of every other row."""
    assert len(set(cycle)) == len(cycle), cycle  # a function of the last token
    model = random_model(vocab, max_len=max_len)
    model = eqx.tree_at(
        lambda m: (m.stack.blocks.attention.W_o.weight, m.stack.blocks.ffn.W_2.weight),
        model,
        (
            jnp.zeros_like(model.stack.blocks.attention.W_o.weight),
            jnp.zeros_like(model.stack.blocks.ffn.W_2.weight),
        ),
    )
    emb = np.asarray(model.token_emb.weight)
    head = 0.01 * np.asarray(model.head.weight)
    for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True):
        head[b] = 10 * emb[a] / np.linalg.norm(emb[a])
    return eqx.tree_at(lambda m: m.head.weight, model, jnp.asarray(head))


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, bl.interop.tokenizer.Tokenizer]:
    root = tmp_path_factory.mktemp("streaming")
    return {f: bl.load_tokenizer(write_tokenizer(root / f, f)) for f in FAMILIES}


def spans_tokens(tok, text: str) -> bool:
    """Whether some character of `text` spans several of its tokens (some
    single token decodes to an incomplete character)."""
    return any("\ufffd" in tok.decode([i]) for i in tok.encode(text))


def pieces_of(decoder: IncrementalDecoder, ids) -> list[str]:
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# -- IncrementalDecoder -------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_text_decoded_at_once(toks, family, text):
    """At every split of the ids into a context (text: it ends after a
    character) and pushed ids, the pieces join to decode(all) after
    decode(context), and no piece holds a U+FFFD (the text is valid: every
    partial character is completed later)."""
    tok = toks[family]
    ids = tok.encode(text)
    assert spans_tokens(tok, text) or text.isascii()
    splits = [k for k in range(len(ids)) if not tok.decode(ids[:k]).endswith("\ufffd")]
    assert len(splits) > len(text) // 2, splits
    for k in splits:
        context, new = ids[:k], ids[k:]
        pieces = pieces_of(IncrementalDecoder(tok, context), new)
        whole = tok.decode(ids)
        assert "".join(pieces) == whole[len(tok.decode(context)) :], (k, pieces)
        assert not any("\ufffd" in p for p in pieces), (k, pieces)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_character_of_four_tokens_comes_out_whole(toks, family):
    """Byte-level: the emoji comes with its 4th byte. Byte fallback: with the
    token that ends the run of byte tokens (a later byte could still turn the
    run into U+FFFD), here `▁o`."""
    tok = toks[family]
    context = tok.encode("Hello")
    crab = tok.encode(" 🦀", add_special_tokens=False)  # a space, then 4 bytes
    ok = tok.encode(" on", add_special_tokens=False)
    assert [tok.decode([i]) for i in crab[1:]] == ["\ufffd"] * 4
    assert tok.decode(context + crab + ok) == tok.decode(context) + " 🦀 on"
    pieces = pieces_of(IncrementalDecoder(tok, context), crab + ok)
    assert "".join(pieces) == " 🦀 on" and pieces[0] == " "
    if family == "gpt2":
        assert pieces[1:5] == ["", "", "", "🦀"]
    else:
        assert pieces[1:5] == ["", "", "", ""] and pieces[5].startswith("🦀")


@pytest.mark.parametrize("family", FAMILIES)
def test_an_incomplete_character_at_the_end_is_written_by_flush(toks, family):
    """Ids that end inside a character: held back, then `flush` writes what
    decode writes (U+FFFD), so the pieces still join to decode(all)."""
    tok = toks[family]
    context = tok.encode("Hi")
    partial = tok.encode(" 🦀", add_special_tokens=False)[:-2]
    decoder = IncrementalDecoder(tok, context)
    pushed = [decoder.push(i) for i in partial]
    assert "\ufffd" not in "".join(pushed)
    rest = decoder.flush()
    want = tok.decode(context + partial)[len(tok.decode(context)) :]
    assert "".join(pushed) + rest == want and want.endswith("\ufffd")


def test_a_byte_that_breaks_a_run_of_bytes_turns_it_all_into_u_fffd(toks):
    """Byte fallback decodes a run of byte tokens whole: `é` (C3 A9) then FF
    (never valid UTF-8) is three U+FFFD, so `é` may not come out before the
    run ends; the pieces are still the text decoded at once."""
    tok = toks["llama"]
    context = tok.encode("Hello")
    run = [tok._backend.token_to_id(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0xFF)]
    ids = [*run, *tok.encode(" on", add_special_tokens=False)]
    assert tok.decode(context + run[:2]).endswith("é")
    want = tok.decode(context + ids)[len(tok.decode(context)) :]
    assert want == "\ufffd" * 3 + " on"
    assert "".join(pieces_of(IncrementalDecoder(tok, context), ids)) == want


def test_the_first_new_token_keeps_its_space_after_the_context(toks):
    """A sentencepiece decoder drops the leading space of the first token it
    decodes: decoded alone, `▁crab` is `crab`; after the context, ` crab`."""
    tok = toks["llama"]
    ids = tok.encode("sat on the")
    assert tok.decode(ids[-1:]) == "the"  # alone: the space is dropped
    pieces = pieces_of(IncrementalDecoder(tok, ids[:-1]), ids[-1:])
    assert "".join(pieces) == " the"


def test_spaces_before_punctuation_are_held_where_the_tokenizer_cleans_them(
    tmp_path,
):
    """A WordPiece folder with `clean_up_tokenization_spaces`: `do n ##' ##t`
    decodes to `don't`, so the ` n` written after `do` is held back (sent
    early, the space could not be taken back)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "do", "n", "##'", "##t", "hello", ",", ".", "a"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"clean_up_tokenization_spaces": True, "unk_token": "[UNK]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    tok = bl.load_tokenizer(tmp_path)
    ids = [5, 6, 1, 2, 3, 4, 8, 7]  # hello , do n ' t a .
    assert tok.decode(ids) == "hello, don't a."
    pieces = pieces_of(IncrementalDecoder(tok, ids[:1]), ids[1:])
    assert "".join(pieces) == ", don't a."
    assert pieces[2:5] == ["", "", "n't"]  # ` n` and ` n'` held back


def test_a_character_vocabulary_streams_one_character_per_token():
    from blocklab.data import VOCAB

    ids = VOCAB.encode("the time machine")
    pieces = pieces_of(IncrementalDecoder(VOCAB, ids[:3]), ids[3:])
    assert pieces == [*" time machine", ""]


# -- stream_text --------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_model(toks):
    return random_model(toks["gpt2"].vocab_size)


def test_greedy_tokens_are_generate_and_the_text_is_generate_text(toks, gpt2_model):
    tok, prompt = toks["gpt2"], "Once upon a 🦀 time"
    ids = tok.encode(prompt)
    n = MAX_LEN - len(ids)
    stream = stream_text(gpt2_model, tok, prompt, n, stop_ids=())
    pieces = list(stream)
    want = np.asarray(bl.generate(gpt2_model, np.asarray(ids, np.int32), n))
    assert stream.new_ids == [want[len(ids) :].tolist()]
    assert stream.stop_reasons == ["max_new_tokens"]
    assert "".join(pieces) == stream.texts[0]
    whole = tok.decode(want)
    assert stream.texts[0] == whole[len(tok.decode(ids)) :]
    assert bl.generate_text(gpt2_model, tok, prompt, n) == tok.decode(ids) + "".join(
        pieces
    )
    assert stream.first_token_seconds > 0 and stream.tokens_per_second > 0


def test_a_sampled_batch_draws_generate_texts_tokens(toks, gpt2_model):
    """Sampled, a batch (ragged prompts) draws `generate_text`'s tokens: the
    key of step i is fold_in(split(key)[0], i), as generate_text's
    `generate` call. The stream yields (index, piece) pairs."""
    tok, prompts, key = toks["gpt2"], ["Hello 🦀", "the dog ran in"], jax.random.key(7)
    kw = dict(
        key=key, config=bl.GenerationConfig(temperature=0.9, top_k=50, top_p=0.95)
    )
    stream = stream_text(gpt2_model, tok, prompts, 10, stop_ids=(), **kw)
    pairs = list(stream)
    assert {b for b, _ in pairs} == {0, 1}
    for b in (0, 1):
        assert "".join(p for i, p in pairs if i == b) == stream.texts[b]
    want = bl.generate_text(gpt2_model, tok, prompts, 10, **kw)
    decoded = [tok.decode(tok.encode(p)) for p in prompts]
    assert want == [p + t for p, t in zip(decoded, stream.texts, strict=True)]


@pytest.fixture(scope="module")
def chained(toks):
    """Per family: the chain model whose greedy text after `prompt` is, over
    and over, "🦀ж" (6 byte tokens; with byte fallback, `▁` first) and the
    prompt's last token (`at`)."""
    out = {}
    for family, tok in toks.items():
        prompt = "the cat sat"
        last = tok.encode(prompt)[-1]
        cycle = [last, *tok.encode("🦀ж", add_special_tokens=False)]
        out[family] = (prompt, cycle, chain_model(tok.vocab_size, cycle))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_generated_characters_of_several_tokens_stream_whole(toks, chained, family):
    """The chain model writes an emoji as 4 tokens and `ж` as 2: each comes out
    whole (byte-level: with its last byte; byte fallback: the run with the
    token after it), and the pieces join to the decoded ids."""
    tok, (prompt, cycle, model) = toks[family], chained[family]
    stream = stream_text(model, tok, prompt, 100, stop_ids=())
    pieces = list(stream)
    ids = tok.encode(prompt)
    # it ends where the context fills max_len
    assert stream.stop_reasons == ["max_len"]
    assert stream.new_ids[0] == [*cycle[1:], *cycle * 5][: MAX_LEN - len(ids)]
    whole = tok.decode(ids + stream.new_ids[0])
    assert "".join(pieces) == whole[len(tok.decode(ids)) :]
    cycles = {"gpt2": ["🦀", "ж", "at"], "llama": [" ", "🦀жat"]}[family] * 3
    assert pieces[: len(cycles)] == cycles
    assert "".join(cycles) == {"gpt2": "🦀жat", "llama": " 🦀жat"}[family] * 3


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stop_id_ends_the_text_without_its_token(toks, chained, family):
    """Stopping at the 4th byte of the emoji: the text is the decode of the
    tokens before it (3 bytes of a character: U+FFFD, written at the end)."""
    tok, (prompt, cycle, model) = toks[family], chained[family]
    stream = stream_text(model, tok, prompt, 100, stop_ids=[cycle[4]])
    pieces = list(stream)
    ids = tok.encode(prompt)
    assert stream.new_ids == [cycle[1:5]] and stream.stop_reasons == ["stop_id"]
    want = tok.decode(ids + cycle[1:4])[len(tok.decode(ids)) :]
    assert "".join(pieces) == stream.texts[0] == want and want.endswith("\ufffd")


def test_the_tokenizer_stop_ids_are_the_default(toks, chained, tmp_path):
    tok, (prompt, cycle, model) = toks["llama"], chained["llama"]
    folder = write_tokenizer(tmp_path / "eos", "llama")
    generation = {"eos_token_id": [tok.eos_id, cycle[2]]}
    (folder / "generation_config.json").write_text(json.dumps(generation), "utf-8")
    stream = stream_text(model, bl.load_tokenizer(folder), prompt, 100)
    list(stream)
    assert stream.new_ids == [cycle[1:3]] and stream.stop_reasons == ["stop_id"]


def test_chat_renders_the_prompt_through_the_template(toks, chained):
    tok, (_, _, model) = toks["llama"], chained["llama"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi 🦀"}], add_generation_prompt=True
    )
    assert text == "<s>[user] hi 🦀</s>[assistant]"
    ids = tok.encode(text, add_special_tokens=False)
    n = MAX_LEN - len(ids)
    stream = stream_text(model, tok, "hi 🦀", n, stop_ids=(), chat=True)
    list(stream)
    assert stream.prompt_ids == [ids]
    got = bl.generate_text(model, tok, "hi 🦀", n, chat=True)
    assert got == text + stream.texts[0]


def test_a_charlm_streams_the_characters_of_generate_text():
    from blocklab.data import VOCAB

    model = bl.CharLM(28, 16, 2, 2, max_len=16, key=jax.random.key(0))
    stream = stream_text(model, VOCAB, "the time", 6)
    pieces = list(stream)
    assert len(pieces) == 6 and stream.stop_reasons == ["max_new_tokens"]
    assert bl.generate_text(model, VOCAB, "the time", 6) == "the time" + "".join(pieces)


def test_no_work_before_the_first_piece_and_none_for_no_tokens(toks, gpt2_model):
    stream = stream_text(gpt2_model, toks["gpt2"], "Hello", 0)
    assert stream.first_token_seconds is None
    assert list(stream) == [] and stream.stop_reasons == ["max_new_tokens"]
    assert stream.first_token_seconds is None and stream.tokens_per_second is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompts=""), "stream_text: prompts is empty"),
        (dict(prompts=["a", ""]), r"prompts\[1\] is empty"),
        (dict(max_new_tokens=-1), r"max_new_tokens must lie in \[0, inf\], got -1"),
        (dict(stop_ids=[10**6]), r"stop_ids\[0\] must lie in \[0, 299\]"),
        (dict(stop_ids="</s>"), "stop_ids must be a list of token ids"),
        (dict(config=bl.GenerationConfig(eos_id=3)), "config.eos_id=3 does not apply"),
        (dict(chat=True), "has no chat template"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_work(
    toks, gpt2_model, kwargs, match, monkeypatch
):
    # as in a user's program: no run-time annotation check answers first
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    args = dict(prompts="Hello", max_new_tokens=4) | kwargs
    with pytest.raises(ConfigError, match=match):
        stream_text(gpt2_model, toks["gpt2"], **args)
