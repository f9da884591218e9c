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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._validate import ConfigError, check_int
from ..nn import CharLM, DecoderLM
from ..nn.cache import model_limits
from ..nn.generation import check_sampling, generate, sample_logits

__all__ = ["generate_text"]

_OWNER = "generate_text"


def generate_text(
    model: eqx.Module,
    tokenizer: Any,
    prompts: str | Sequence[str],
    max_new_tokens: int,
    *,
    key: Any = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> str | list[str]:
    r"""Continue each prompt by `max_new_tokens` tokens and decode the text.

    Prompt $b$ is encoded to ids $p_b$ (its context: the last `max_len` of
    them), continued by `blocklab.generate` while the longest context plus
    the new tokens fit the model's `max_len`, then one token at a time on the
    last `max_len` tokens, and `tokenizer.decode` of $p_b$ followed by its new
    tokens is returned. The tokens are chosen as `generate` chooses them:
    greedy without `key`, else drawn from `filter_logits(z, temperature,
    top_k, top_p)`. A list of prompts is one batch (ragged prompts,
    right-padded): greedy, it gives the text of one call per prompt; sampled,
    draws from the same distributions, but not the same draws.

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
        temperature: $\tau > 0$ when sampling (ignored by greedy decoding).
        top_k: keep the $k$ most likely tokens, $1 \le k \le$ vocabulary.
        top_p: nucleus sampling, $0 < p \le 1$.

    Returns:
        The decoded prompt and continuation: a `str` for a `str` prompt, a
        list of `str` for a list. (For `VOCAB`, the prompt is the
        preprocessed one: lower case, runs of non-letters as one space.)

    Raises:
        ConfigError: naming the argument: a model of another type, a
            tokenizer without `encode`/`decode`, `prompts` that is not a
            non-empty `str` or a non-empty list of them, a prompt that
            encodes to no ids or to ids outside the model's vocabulary, and
            the sampling arguments as `generate` refuses them.
    """
    if not isinstance(model, (DecoderLM, CharLM)):
        raise ConfigError(
            f"{_OWNER}: model must be a DecoderLM or a CharLM, got "
            f"{type(model).__name__}."
        )
    vocab, max_len = model_limits(model)
    if not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
        raise ConfigError(
            f"{_OWNER}: tokenizer must have encode(str) -> list[int] and "
            f"decode(ids) -> str methods, got {type(tokenizer).__name__}; for "
            "a character-level CharLM pass blocklab.data.VOCAB."
        )
    single = isinstance(prompts, str)
    texts = [prompts] if single else _prompt_list(prompts)
    new = check_int(_OWNER, "max_new_tokens", max_new_tokens, min=0)
    key, temperature, top_k, top_p = check_sampling(
        _OWNER, key, temperature, top_k, top_p, vocab
    )
    sampling = key is not None
    names = ["prompts"] if single else [f"prompts[{b}]" for b in range(len(texts))]
    ids = [
        _encode(tokenizer, t, name, vocab) for t, name in zip(texts, names, strict=True)
    ]
    contexts = [p[-max_len:] for p in ids]
    lengths = np.array([len(c) for c in contexts], np.int32)
    width = int(lengths.max())
    cached = min(new, max_len - width)
    cached_key, sliding_key = jax.random.split(key) if sampling else (None, None)
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = np.zeros((len(ids), width), np.int32)
    for b, c in enumerate(contexts):
        batch[b, : len(c)] = c
    cols = lengths[:, None] + np.arange(cached)
    out = np.zeros((len(ids), new), np.int32)
    if cached > 0:
        full = generate(
            model, batch, cached, key=cached_key, lengths=lengths, **options
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


def _prompt_list(prompts: Any) -> list[str]:
    """`prompts` as a list of str, refused by name otherwise."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError(
            f"{_OWNER}: prompts must be a non-empty str or a non-empty list of "
            f"str, got {prompts!r:.60} of type {type(prompts).__name__}."
        )
    for b, text in enumerate(prompts):
        if not isinstance(text, str):
            raise ConfigError(
                f"{_OWNER}: prompts[{b}] must be a str, got {text!r:.60} of type "
                f"{type(text).__name__}."
            )
    return list(prompts)


def _encode(tokenizer: Any, text: str, name: str, vocab: int) -> np.ndarray:
    """`tokenizer.encode(text)`: non-empty int32 ids in `[0, vocab)`, else refused."""
    if not text:
        raise ConfigError(f"{_OWNER}: {name} is empty; give at least one character.")
    ids = np.asarray(tokenizer.encode(text))
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(
            f"{_OWNER}: tokenizer.encode({name}) must give a non-empty list of "
            f"int token ids, got dtype {ids.dtype}, shape {ids.shape}."
        )
    outside = (ids < 0) | (ids >= vocab)
    if outside.any():
        i = int(np.argmax(outside))
        raise ConfigError(
            f"{_OWNER}: tokenizer.encode({name}) gave token id {int(ids[i])} at "
            f"index {i}, outside the model's vocabulary [0, vocab_size={vocab}); "
            "use the tokenizer the model was trained with."
        )
    return ids.astype(np.int32)


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
