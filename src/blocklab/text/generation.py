r"""Text in, text out: `generate_text` continues prompts through a tokenizer.

`blocklab.generate` works on token ids; `generate_text` encodes the prompts
with a tokenizer, continues them with `generate` and decodes the result. A
tokenizer is any object with `encode(str) -> list[int]` and `decode(ids) ->
str`: for a character-level `CharLM`, the character vocabulary
`blocklab.data.VOCAB` (also `TimeMachine(...).vocab`); for a character
`TokenDataset.from_text(...)`, the dataset itself.

The context is the last `max_len` tokens. While a text fits the model's
`max_len`, its tokens come from `generate` (cached, one compiled program);
beyond, every further token re-encodes the last `max_len` tokens (one
compiled `lax.scan`): with learned positions the context's positions shift
at every token, so no cache can be kept.

`stream_text` is the same generation as an iterator of text pieces, as the
tokens arrive (what `blocklab generate` prints): the prompt is prefilled
into a cache, each step is one compiled call of the cached decoding step
(`blocklab.models.decoding`), and an `IncrementalDecoder`
(`blocklab.text.streaming`) turns each new token into the text that no
later token can change. It stops at the tokenizer's stop ids, and at the
model's `max_len` (it does not re-encode past it). Within `max_len` and
without stop ids, its tokens are those of `generate_text` (greedy: those of
`blocklab.generate`; sampled: the same draws), and
`tokenizer.decode(prompt ids) + "".join(pieces)` is `generate_text`'s text.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._validate import ConfigError, check_bool, check_int
from ..models import CharLM, DecoderLM
from ..models.decode_loop import (
    GenerationConfig,
    check_sampling,
    choose,
    sample_logits,
)
from ..models.decoding import model_limits
from ..models.generation import UNROLL_MAX_LAYERS, generate, start, step_fn
from ._checks import check_ids_in_vocab, check_text_list
from .streaming import IncrementalDecoder

__all__ = ["generate_text", "stream_text", "TextStream"]

_OWNER = "generate_text"


def generate_text(
    model: eqx.Module,
    tokenizer: Any,
    prompts: str | Sequence[str],
    max_new_tokens: int,
    *,
    key: Any = None,
    config: GenerationConfig | None = None,
    chat: bool = False,
) -> str | list[str]:
    r"""Continue each prompt by `max_new_tokens` tokens and decode the text.

    Prompt $b$ is encoded to ids $p_b$ (its context: the last `max_len` of
    them), continued by `blocklab.generate` while the longest context plus
    the new tokens fit the model's `max_len`, then one token at a time on the
    last `max_len` tokens, and `tokenizer.decode` of $p_b$ followed by its new
    tokens is returned. The tokens are chosen as `generate` chooses them:
    greedy without `key`, else drawn from `filter_logits(z, temperature,
    top_k, top_p)` (`config`'s). A list of prompts is one batch (ragged prompts,
    right-padded): greedy, it gives the text of one call per prompt; sampled,
    draws from the same distributions, but not the same draws.

    It is `stream_text` as one function (the text of `blocklab generate`):
    while the context fits `max_len`, `tokenizer.decode(prompt ids)` followed
    by the pieces `stream_text(..., stop_ids=())` yields is this text.

    Args:
        model: a `DecoderLM` (any family) or a `CharLM`.
        tokenizer: `encode(str) -> list[int]` with ids in the model's
            vocabulary, and `decode(ids) -> str` (`blocklab.data.VOCAB` for
            a character-level `CharLM`).
        prompts: one prompt (a non-empty `str`; returns a `str`) or a
            non-empty list (or tuple) of them (returns a list, in order).
        max_new_tokens: tokens to add to each prompt, >= 0.
        key: `None` for greedy decoding; a PRNG key (`jax.random.key`) to
            sample. The key of the cached part is `split(key)[0]`, that of
            the token-by-token part `split(key)[1]`.
        config: a `blocklab.GenerationConfig`: `temperature`, `top_k`,
            `top_p` (sampling) and `unroll_layers` as for `generate`; its
            `eos_id` is refused (a text ends at `stream_text`'s `stop_ids`).
        chat: render each prompt as one user message through the
            tokenizer's chat template (`apply_chat_template(...,
            add_generation_prompt=True)`) and encode that text without the
            post-processor (the template writes BOS itself).

    Returns:
        The decoded prompt and continuation: a `str` for a `str` prompt, a
        list of `str` for a list. (For `VOCAB`, the prompt is the
        preprocessed one: lower case, runs of non-letters as one space.)

    Raises:
        ConfigError: naming the argument: a model of another type, a
            tokenizer without `encode`/`decode`, `prompts` that is not a
            non-empty `str` or a non-empty list of them, a prompt that
            encodes to no ids or to ids outside the model's vocabulary, and
            the sampling arguments as `generate` refuses them; with `chat`,
            a tokenizer without a chat template.
    """
    a = _Checked(
        _OWNER, model, tokenizer, prompts, max_new_tokens, key, config, chat
    )  # fmt: skip
    single, ids, new, max_len = a.single, a.ids, a.new, a.max_len
    key, temperature, top_k, top_p = a.key, a.temperature, a.top_k, a.top_p
    sampling = key is not None
    contexts = [p[-max_len:] for p in ids]
    lengths = np.array([len(c) for c in contexts], np.int32)
    width = int(lengths.max())
    cached = min(new, max_len - width)
    cached_key, sliding_key = jax.random.split(key) if sampling else (None, None)
    config = a.config
    batch = np.zeros((len(ids), width), np.int32)
    for b, c in enumerate(contexts):
        batch[b, : len(c)] = c
    cols = lengths[:, None] + np.arange(cached)
    out = np.zeros((len(ids), new), np.int32)
    if cached > 0:
        full = generate(
            model, batch, cached, key=cached_key, config=config, lengths=lengths
        )
        out[:, :cached] = np.take_along_axis(np.asarray(full), cols, axis=1)
    if new > cached:
        # Past max_len every position would shift: each further token
        # re-encodes the last max_len tokens (no cache can be kept).
        buf = np.zeros((len(ids), max_len), np.int32)
        for b, c in enumerate(contexts):
            ctx = np.concatenate([c, out[b, :cached]])[-max_len:]
            buf[b, : len(ctx)] = ctx
        filled = np.minimum(lengths + cached, max_len).astype(np.int32)
        out[:, cached:] = np.asarray(
            _slide(
                model, jnp.asarray(buf), jnp.asarray(filled), sliding_key,
                new - cached, jnp.float32(temperature), top_k,
                None if top_p is None else jnp.float32(top_p),
            )
        )  # fmt: skip
    texts = [tokenizer.decode([*p, *o.tolist()]) for p, o in zip(ids, out, strict=True)]
    return texts[0] if single else texts


def stream_text(
    model: eqx.Module,
    tokenizer: Any,
    prompts: str | Sequence[str],
    max_new_tokens: int,
    *,
    key: Any = None,
    config: GenerationConfig | None = None,
    stop_ids: Sequence[int] | None = None,
    chat: bool = False,
) -> TextStream:
    r"""Continue prompts token by token, yielding the text as it is generated.

    The prompts are encoded as `generate_text` encodes them (the context: the
    last `max_len` ids), prefilled into a cache in one compiled call, and each
    further token is one compiled call of the cached decoding step, which
    runs while the previous token goes to the host (so the host's work, the
    detokenization included, overlaps the next step). Tokens are chosen as
    `generate` chooses them: greedy without `key`, else drawn from
    `filter_logits(z, temperature, top_k, top_p)` (`config`'s) with the key
    of step $i$
    `fold_in(split(key)[0], i)` (`generate_text`'s key for `generate`): the
    greedy tokens of one prompt are `blocklab.generate`'s, and a sampled
    batch draws `generate_text`'s tokens.

    A text ends at the first of: a token of `stop_ids` (counted in
    `TextStream.new_ids`, not written in the text), `max_new_tokens` tokens,
    or the model's `max_len` (prompt and new tokens together; `generate_text`
    continues past it by re-encoding, this does not). Each new token's text
    comes from an `IncrementalDecoder`: a character that spans several tokens
    comes out whole, once its last token arrives, and the pieces of a prompt
    join to `tokenizer.decode(prompt ids + new ids)` minus the prompt's text
    (without the stop token).

    Args:
        model: a `DecoderLM` (any family) or a `CharLM`.
        tokenizer: `encode(str) -> list[int]` and `decode(ids) -> str`, as for
            `generate_text` (`blocklab.load_tokenizer(path)`).
        prompts: one prompt (a non-empty `str`: the stream yields `str`
            pieces) or a non-empty list of them (one batch, decoded together:
            the stream yields `(index, piece)` pairs, in step order).
        max_new_tokens: tokens to add to each prompt at most, >= 0.
        key: `None` for greedy decoding, else a PRNG key to sample.
        config: a `blocklab.GenerationConfig`: `temperature`, `top_k`,
            `top_p` (sampling) and `unroll_layers` as for `generate`; its
            `eos_id` is refused (a text ends at `stream_text`'s `stop_ids`).
        stop_ids: ids that end a text; `None` takes `tokenizer.stop_ids`
            (EOS and the end-of-turn ids of `generation_config.json`; none
            for a tokenizer without that attribute); `()` never stops early.
        chat: render each prompt as one user message through the tokenizer's
            chat template, with `add_generation_prompt=True` (as
            `generate_text`).

    Returns:
        A `TextStream`: iterate over it for the pieces; its attributes hold
        the texts, ids, stop reasons and timings so far.

    Raises:
        ConfigError: as `generate_text` (checked here, before any work), and
            `stop_ids` that are not ids in the model's vocabulary.
    """
    owner = "stream_text"
    a = _Checked(
        owner, model, tokenizer, prompts, max_new_tokens, key, config, chat
    )  # fmt: skip
    if stop_ids is None:
        stop_ids = tuple(getattr(tokenizer, "stop_ids", None) or ())
        name = "tokenizer.stop_ids"
    else:
        name = "stop_ids"
    if isinstance(stop_ids, (str, bytes)) or not isinstance(
        stop_ids, (Sequence, np.ndarray)
    ):
        raise ConfigError(
            f"{owner}: stop_ids must be a list of token ids (or None for the "
            f"tokenizer's), got {type(stop_ids).__name__}."
        )
    stops = frozenset(
        check_int(owner, f"{name}[{i}]", s, min=0, max=a.vocab - 1)
        for i, s in enumerate(stop_ids)
    )
    return TextStream(model, tokenizer, a, stops)


class TextStream:
    """The iterator `stream_text` returns: the text pieces as the tokens come.

    Iterating yields `str` pieces for one prompt, `(index, piece)` pairs for
    a list. No device work starts before the first `next`. The attributes
    grow as it runs (each list has one entry per prompt, in order):

    Attributes:
        prompt_ids: the ids of each prompt (the context is their last
            `max_len`).
        new_ids: the new ids of each prompt so far (a stop token included).
        texts: the text of each prompt's new ids so far (the pieces joined;
            complete once the prompt's stop reason is set).
        stop_reasons: `None` while a prompt runs, then why it ended:
            `"stop_id"`, `"max_new_tokens"` or `"max_len"` (its context
            filled the model's `max_len`).
        first_token_seconds: from the first `next` to the first token on the
            host: compiling (the first call for these shapes) and prefill.
        seconds: from the first `next` to the last token so far.
    """

    def __init__(self, model, tokenizer, checked: _Checked, stops: frozenset[int]):
        a = checked
        self._single = a.single
        self.prompt_ids = [p.tolist() for p in a.ids]
        self.new_ids: list[list[int]] = [[] for _ in a.ids]
        self.texts = ["" for _ in a.ids]
        self.stop_reasons: list[str | None] = [None for _ in a.ids]
        self.first_token_seconds: float | None = None
        self.seconds = 0.0
        self._model, self._stops, self._max_new = model, stops, a.new
        contexts = [p[-a.max_len :] for p in a.ids]
        lengths = np.array([len(c) for c in contexts], np.int32)
        width = int(lengths.max())
        # tokens each prompt may add: its context and they fit max_len
        self._limits = [min(a.new, a.max_len - int(n)) for n in lengths]
        self._decoders = [IncrementalDecoder(tokenizer, c) for c in contexts]
        batch = np.zeros((len(contexts), width), np.int32)
        for b, c in enumerate(contexts):
            batch[b, : len(c)] = c
        self._batch, self._lengths = batch, lengths
        # as generate sizes its cache (T + new), at most max_len
        self._cache_len = min(a.max_len, width + a.new)
        self._key = None if a.key is None else jax.random.split(a.key)[0]
        self._options = (
            None if a.key is None else jnp.float32(a.temperature),
            None if a.key is None else a.top_k,
            None if a.key is None or a.top_p is None else jnp.float32(a.top_p),
        )
        unroll = a.config.unroll_layers
        self._unroll = (
            model.stack.num_blks <= UNROLL_MAX_LAYERS if unroll is None else unroll
        )
        self._queue: deque = deque()
        self._step = 0  # the index of the next token to read
        self._pending = None  # the device token of step `_step`
        self._carry = None  # the cache (and step count) after `_pending`
        self._params = self._decode = None
        self._t0: float | None = None
        for b, limit in enumerate(self._limits):
            if limit <= 0:
                self._end(b, "max_len" if a.new > 0 else "max_new_tokens")

    @property
    def tokens_per_second(self) -> float | None:
        """The decoding rate: the new tokens after each prompt's first (stop
        tokens included), over the seconds after the first token (compiling
        and prefill left out); `None` before a second token."""
        later = sum(max(len(n) - 1, 0) for n in self.new_ids)
        span = self.seconds - (self.first_token_seconds or 0.0)
        return later / span if later > 0 and span > 0 else None

    def __iter__(self) -> Iterator[str] | Iterator[tuple[int, str]]:
        return self

    def __next__(self) -> str | tuple[int, str]:
        while not self._queue:
            if all(r is not None for r in self.stop_reasons):
                self._pending = self._carry = self._params = None  # free the cache
                raise StopIteration
            self._advance()
        b, piece = self._queue.popleft()
        return piece if self._single else (b, piece)

    def _advance(self) -> None:
        """Read the next token of every running prompt (dispatching the step
        after it first, so that the device runs while the host reads)."""
        model, (temperature, top_k, top_p) = self._model, self._options
        if self._pending is None:
            self._t0 = time.perf_counter()
            self._pending, self._carry, blocks = _start(
                model, jnp.asarray(self._batch), jnp.asarray(self._lengths),
                self._cache_len, self._unroll, self._key, temperature, top_k, top_p,
            )  # fmt: skip
            params, static = eqx.partition((model, blocks), eqx.is_array)
            self._params, treedef = jax.tree_util.tree_flatten(params)
            self._decode = _decoder(treedef, static, top_k)
        token = self._pending
        reasons = self.stop_reasons
        running = [n for n, r in zip(self._limits, reasons, strict=True) if r is None]
        if self._step + 1 < max(running):  # the next step runs meanwhile
            self._pending, self._carry = self._decode(
                self._params, self._carry, token, self._key, temperature, top_p
            )
        tokens = np.asarray(token)
        self.seconds = time.perf_counter() - self._t0
        if self.first_token_seconds is None:
            self.first_token_seconds = self.seconds
        for b, t in enumerate(tokens.tolist()):
            if self.stop_reasons[b] is not None:
                continue
            self.new_ids[b].append(t)
            if t in self._stops:
                self._end(b, "stop_id")
                continue
            self._emit(b, self._decoders[b].push(t))
            if len(self.new_ids[b]) == self._limits[b]:
                full = self._limits[b] < self._max_new
                self._end(b, "max_len" if full else "max_new_tokens")
        self._step += 1

    def _emit(self, b: int, piece: str) -> None:
        if piece:
            self.texts[b] += piece
            self._queue.append((b, piece))

    def _end(self, b: int, reason: str) -> None:
        self._emit(b, self._decoders[b].flush())
        self.stop_reasons[b] = reason


class _Checked:
    """The arguments of `generate_text` and `stream_text`, checked (by name,
    `owner` first in each message), and the prompts' ids."""

    def __init__(
        self, owner, model, tokenizer, prompts, max_new_tokens, key, config, chat
    ):
        if not isinstance(model, (DecoderLM, CharLM)):
            raise ConfigError(
                f"{owner}: model must be a DecoderLM or a CharLM, got "
                f"{type(model).__name__}."
            )
        self.vocab, self.max_len = model_limits(model)
        methods = ("encode", "decode")
        if not all(callable(getattr(tokenizer, m, None)) for m in methods):
            raise ConfigError(
                f"{owner}: tokenizer must have encode(str) -> list[int] and "
                f"decode(ids) -> str methods, got {type(tokenizer).__name__}; for "
                "a character-level CharLM pass blocklab.data.VOCAB."
            )
        self.single = isinstance(prompts, str)
        self.texts = (
            [prompts] if self.single else check_text_list(owner, "prompts", prompts)
        )
        self.new = check_int(owner, "max_new_tokens", max_new_tokens, min=0)
        config = GenerationConfig() if config is None else config
        if not isinstance(config, GenerationConfig):
            raise ConfigError(
                f"{owner}: config must be a GenerationConfig, got "
                f"{type(config).__name__}."
            )
        if config.eos_id is not None:
            raise ConfigError(
                f"{owner}: config.eos_id={config.eos_id} does not apply to text: "
                "stream_text ends a text at its stop_ids (the tokenizer's by "
                "default); generate_text adds max_new_tokens tokens."
            )
        self.config = config
        self.key, self.temperature, self.top_k, self.top_p = check_sampling(
            owner, key, config.temperature, config.top_k, config.top_p, self.vocab
        )
        chat = check_bool(owner, "chat", chat)
        if chat and not callable(getattr(tokenizer, "apply_chat_template", None)):
            raise ConfigError(
                f"{owner}: chat=True needs a tokenizer with a chat template "
                f"(apply_chat_template), got {type(tokenizer).__name__}; load the "
                "checkpoint folder's with blocklab.load_tokenizer."
            )
        n = len(self.texts)
        names = ["prompts"] if self.single else [f"prompts[{b}]" for b in range(n)]
        self.ids = [
            _encode(owner, tokenizer, t, name, self.vocab, chat)
            for t, name in zip(self.texts, names, strict=True)
        ]


def _encode(
    owner: str, tokenizer: Any, text: str, name: str, vocab: int, chat: bool
) -> np.ndarray:
    """The ids of `text` (rendered as a user message by the chat template
    first, with `chat`): non-empty int32 ids in `[0, vocab)`, else refused."""
    if not text:
        raise ConfigError(f"{owner}: {name} is empty; give at least one character.")
    call = f"tokenizer.encode({name})"
    if chat:
        message = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(message, add_generation_prompt=True)
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False))
        call = f"the chat template's text of {name}"
    else:
        ids = np.asarray(tokenizer.encode(text))
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(
            f"{owner}: {call} must give a non-empty list of int token ids, got "
            f"dtype {ids.dtype}, shape {ids.shape}."
        )
    return check_ids_in_vocab(owner, call, ids, vocab)


@eqx.filter_jit
def _slide(model, buf, filled, key, num_new, temperature, top_k, top_p):
    """`num_new` tokens per row, each from the logits at the end of its
    context `buf[b, :filled[b]]` (right-padded to max_len); a full context
    drops its first token."""
    rows = jnp.arange(buf.shape[0])
    size = buf.shape[1]

    def step(carry, k):
        buf, n = carry
        # Causal: the padding after position n - 1 does not affect its logits.
        z = model(buf)[rows, n - 1]
        if key is None:
            token = sample_logits(z, None)
        else:
            token = sample_logits(
                z, k, temperature=temperature, top_k=top_k, top_p=top_p
            )
        full = n == size
        buf = jnp.where(full[:, None], jnp.roll(buf, -1, axis=1), buf)
        buf = buf.at[rows, jnp.where(full, n - 1, n)].set(token.astype(buf.dtype))
        return (buf, jnp.minimum(n + 1, size)), token

    keys = jnp.arange(num_new) if key is None else jax.random.split(key, num_new)
    _, new = jax.lax.scan(step, (buf, filled), keys)
    return new.T


@eqx.filter_jit
def _start(model, ids, lengths, width, unroll, key, temperature, top_k, top_p):
    """`generate`'s start (`blocklab.models.generation.start`: the prompts
    `ids` (B, T) prefilled into a cache of `width` positions) and its choice
    of the first token. Returns it, the decoding state (with the step count
    1) and the blocks: when `unroll`, as `generate`'s loop runs them, the
    blocks sliced out of the stack once (for every step) and per-layer
    caches; else `None` and the stacked cache."""
    last, (blocks, state) = start(model, ids, lengths, width, unroll)
    token = choose(last, 0, key, temperature, top_k, top_p)
    return token, (state, jnp.int32(1)), blocks


@functools.lru_cache(maxsize=16)
def _decoder(treedef, static, top_k):
    """The compiled decoding step of a model structure (`treedef` of the
    arrays of `(model, blocks)`, `static` the rest) and `top_k`: a plain
    `jax.jit` of the arrays as a flat list (`eqx.filter_jit` compares the
    model's static structure at every call: 2 ms a token, more than the step
    itself on a CPU). It feeds each sequence's last token and chooses the
    next; the cache (`carry`) is donated, so XLA updates it in place."""

    def step(params, carry, token, key, temperature, top_p):
        arrays = jax.tree_util.tree_unflatten(treedef, params)
        model, blocks = eqx.combine(arrays, static)
        state, i = carry
        logits, (_, state) = step_fn(model)(token, (blocks, state))
        token = choose(logits, i, key, temperature, top_k, top_p)
        return token, (state, i + 1)

    return jax.jit(step, donate_argnums=1)
