r"""The one generation loop: `generate`, its options and its sampling.

`generate` starts a model's decoding (a decoder's prompt prefilled into a
`DecoderCache`, `blocklab.models.decoding`; an encoder-decoder's source
encoded, its cross-attention keys and values computed once and the decoder's
prompt run as one cached step) and then decodes one token per sequence per
step. Start and loop are one compiled program. Each new token's logits are
those of the uncached model at its position. The loop (`decode_loop`) is the
only one: `EncoderDecoderLM.greedy`, `blocklab.interp.capture_generate`,
`blocklab.text.generate_text` call `generate`, and `blocklab.text.stream_text`
drives the same start and step (`start`, `step_fn`, `choose`) from the host,
one token at a time.

The decode loop runs the blocks in one of two ways (`unroll_layers`):

- scanned: the cache goes through the scanned stack as data, so neither
  compile time nor program size grows with depth; but each step slices every
  block's weights and cache out of the stacked arrays, and on a CPU, where
  XLA hands products of more than one row to YNNPACK (which takes whole
  buffers), that copies every layer's cache, and every weight, per token;
- unrolled: the blocks are sliced once, before the loop (`Stack.unstack`),
  and the loop runs them one after another on per-layer caches, written in
  place: no copy per step, and a program that grows with depth.

The unrolled loop pays when the compiled program is reused (it is cached per
model structure, shapes and options; `benchmarks/generate.py` measures both).
The default unrolls stacks of up to `UNROLL_MAX_LAYERS` blocks.

The sampling rules (`blocklab.models.decode_loop.filter_logits`) are those of
`transformers`' logits warpers, in their order: temperature, then top-k, then
top-p.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int, Shaped

from .._validate import ConfigError, check_int
from ..nn.hooks import Hooks
from . import decoding as _cache
from .charlm import CharLM
from .decode_loop import (
    GenerationConfig,
    check_sampling,
    choose,
    decode_loop,
    fresh,
    static_selection,
)
from .decoder import DecoderLM
from .encoder_decoder import EncoderDecoderLM, generate_seq2seq

__all__ = ["GenerationConfig", "UNROLL_MAX_LAYERS", "generate", "start", "step_fn"]

_OWNER = "generate"

#: `generate(unroll_layers=None)` unrolls its decode loop's blocks up to this
#: depth (about 0.17 s of compile time per block on a 2-core CPU), and scans
#: deeper stacks (flat compile time).
UNROLL_MAX_LAYERS = 8


def generate(
    model: eqx.Module,
    inputs: Any,
    max_new_tokens: int,
    *,
    key: Any = None,
    config: GenerationConfig | None = None,
    lengths: Shaped[ArrayLike, " B"] | None = None,
    hooks: Hooks | None = None,
) -> Int[Array, "*batch L"] | tuple[Array, dict, dict]:
    r"""Continue prompts (or decode from sources) by `max_new_tokens` tokens each.

    A decoder (`DecoderLM`, `CharLM`, MoE): the prompt goes through the model
    once (the prefill), then each step feeds the last token of every sequence
    at that sequence's own next position, $\ell_b, \ell_b + 1, \ldots$. An
    encoder-decoder (`EncoderDecoderLM`: T5, Whisper): the source is encoded
    once, the cross-attention keys and values are computed once, the
    decoder's prompt (default: the one token `decoder_start_token_id`) is one
    cached step, and each further step feeds one token. Each next token is
    chosen from its logits $z$: $\arg\max z$ without `key` (greedy), else a
    draw from $\mathrm{softmax}(s)$ with $s$ = `filter_logits(z, temperature,
    top_k, top_p)` (the key of new token $i$ is `jax.random.fold_in(key,
    i)`). The logits equal the uncached model's at every step. Start and loop
    (`decode_loop`: a `lax.while_loop` that stops once every sequence has
    emitted `eos_id`, or a `lax.scan` when capturing) are one compiled
    program, compiled once per model structure, shapes, `max_new_tokens` and
    options.

    Args:
        model: a `DecoderLM` (any family, MoE and converted ones included), a
            `CharLM` or an `EncoderDecoderLM`.
        inputs: a decoder's prompt ids, `(T,)` or `(B, T)` (text goes
            through a tokenizer: `blocklab.text.generate_text`); an
            encoder-decoder's source (token ids `(T,)`/`(B, T)`, or audio
            features), or `(source, decoder_prompt)` with the decoder's
            prompt ids `(P,)`/`(B, P)` (Whisper's start, language and task
            tokens).
        max_new_tokens: tokens to add, >= 0 (>= 1 for an encoder-decoder);
            a decoder's $T$ + `max_new_tokens` must not exceed its
            `max_len`.
        key: `None` for greedy decoding; a PRNG key (`jax.random.key`) to
            sample (anything else is refused with a `ConfigError`).
        config: a `GenerationConfig` (temperature, top-k, top-p, `eos_id`,
            `unroll_layers`); `None` is its defaults.
        lengths: `(B,)` lengths in $[1, T]$ of ragged inputs in one batch,
            right-padded (a decoder's prompts; an encoder-decoder's sources).
            Always one length per row, also when `B == T`.
        hooks: a `blocklab.nn.hooks.Hooks` selecting sites to record (full
            names, `blocks.*.` for the stack's) and edits to apply in the
            prefill and in every step (`blocklab.interp.capture_generate`
            resolves names and patterns into one). The loop then runs all
            `max_new_tokens` steps (no early stop) through the scanned stack.

    Returns:
        A decoder: int32 `(B, T + max_new_tokens)` (or `(T +
        max_new_tokens,)` for a prompt `(T,)`): row $b$ holds its
        `lengths[b]` prompt tokens (all $T$ without `lengths`), then its new
        tokens, then padding up to the full width (`eos_id` when it is
        given, else 0). An encoder-decoder: the new tokens alone, int32
        `(B, max_new_tokens)` (or `(max_new_tokens,)`), as
        `EncoderDecoderLM.greedy` returns them.

        With `hooks`: `(tokens, prefill_values, step_values)`, the values
        recorded in the start (a decoder's prefill: keyed and shaped as the
        forward's on the prompt) and in each of the $S - 1$ later steps,
        stacked on a new leading axis (each with its own one-token axis).

    Raises:
        ConfigError: naming the argument: a model of another type, text
            (a `str` or `bytes`) for `inputs`, ids that are not integers in
            `[0, vocab)` of shape `(T,)` or `(B, T)`, a prompt longer than
            `max_len` (or with `max_new_tokens` more), `max_new_tokens < 0`,
            `top_k` above the vocabulary, `eos_id` outside it, `lengths` of
            the wrong shape or outside $[1, T]$, `config` not a
            `GenerationConfig`, `hooks` not a `Hooks`.
    """
    if isinstance(inputs, (str, bytes)):
        raise ConfigError(
            f"{_OWNER}: inputs must be token ids, got a {type(inputs).__name__}; "
            "for text in and text out call blocklab.generate_text(model, "
            "tokenizer, prompts, max_new_tokens) (for a character-level CharLM "
            "the tokenizer is blocklab.data.VOCAB)."
        )
    if config is None:
        config = GenerationConfig()
    if not isinstance(config, GenerationConfig):
        raise ConfigError(
            f"{_OWNER}: config must be a GenerationConfig, got {type(config).__name__}."
        )
    if hooks is not None and not isinstance(hooks, Hooks):
        raise ConfigError(
            f"{_OWNER}: hooks must be a blocklab.nn.hooks.Hooks (or None), got "
            f"{type(hooks).__name__}; blocklab.interp.capture_generate takes site "
            "names and patterns."
        )
    selection = None if hooks is None else static_selection(hooks)
    if isinstance(model, EncoderDecoderLM):
        return generate_seq2seq(
            model,
            inputs,
            max_new_tokens,
            key=key,
            config=config,
            src_lens=lengths,
            selection=selection,
        )
    if not isinstance(model, (DecoderLM, CharLM)):
        raise ConfigError(
            f"{_OWNER}: model must be a DecoderLM, a CharLM or an "
            f"EncoderDecoderLM, got {type(model).__name__}."
        )
    vocab, max_len = _cache.model_limits(model)
    ids = _cache._prompt_ids(_OWNER, "ids", inputs)
    T = ids.shape[-1]
    max_new = check_int(_OWNER, "max_new_tokens", max_new_tokens, min=0)
    if T > max_len:
        raise ConfigError(
            f"{_OWNER}: ids holds prompts of T={T} tokens, longer than the "
            f"model's max_len={max_len}."
        )
    if T + max_new > max_len:
        raise ConfigError(
            f"{_OWNER}: max_new_tokens={max_new} does not fit: the prompt's "
            f"T={T} tokens plus max_new_tokens must not exceed the model's "
            f"max_len={max_len} (at most {max_len - T} new tokens)."
        )
    key, temperature, top_k, top_p = check_sampling(
        _OWNER, key, config.temperature, config.top_k, config.top_p, vocab
    )
    sampling = key is not None
    eos_id = check_int(
        _OWNER, "config.eos_id", config.eos_id, min=0, max=vocab - 1, optional=True
    )
    if selection is not None:
        unroll = False
    elif config.unroll_layers is None:
        unroll = model.stack.num_blks <= UNROLL_MAX_LAYERS
    else:
        unroll = config.unroll_layers
    single = ids.ndim == 1
    batch = ids[None] if single else ids
    lens = _lengths(lengths, batch.shape, single)
    batch = _checked(
        batch, (batch < 0) | (batch >= vocab),
        f"token ids must lie in [0, vocab_size={vocab})", "ids",
    ).astype(jnp.int32)  # fmt: skip
    pad = 0 if eos_id is None else eos_id
    out = _generate(
        model, batch, lens, key,
        None if not sampling else jnp.float32(temperature),
        None if top_p is None or not sampling else jnp.float32(top_p),
        max_new, top_k if sampling else None,
        None if eos_id is None else jnp.int32(eos_id), jnp.int32(pad), unroll,
        selection,
    )  # fmt: skip
    if selection is None:
        return out[0] if single else out
    tokens, prefill, steps = out
    if single:  # the values of one prompt without its batch axis of 1
        tokens = tokens[0]
        prefill, steps = _unbatch(prefill, 0), _unbatch(steps, 1)
    return tokens, prefill, steps


def _unbatch(values: dict, batch_axis: int) -> dict:
    """Drop the batch axis of size 1 (after a stacked site's layer axis)."""
    out = {}
    for name, v in values.items():
        axis = batch_axis + (1 if name.startswith("blocks.*.") else 0)
        out[name] = jnp.squeeze(v, axis)
    return out


def _lengths(lengths: Any, shape: tuple, single: bool) -> Array:
    B, T = shape
    if lengths is None:
        return jnp.full((B,), T, jnp.int32)
    lens = jnp.asarray(lengths)
    if single or not jnp.issubdtype(lens.dtype, jnp.integer) or lens.shape != (B,):
        raise ConfigError(
            f"{_OWNER}: lengths must be integers of shape (B,) = ({B},) for "
            f"inputs of shape (B, T) = {shape}, got dtype {lens.dtype}, "
            f"shape {tuple(lens.shape)}"
            + (" (a single prompt (T,) takes no lengths)" if single else "")
            + "."
        )
    return _checked(
        lens, (lens < 1) | (lens > T), f"lengths must lie in [1, T={T}]", "lengths"
    ).astype(jnp.int32)


def _checked(values: Array, bad: Array, message: str, name: str) -> Array:
    """Refuse bad values: concretely with their index, or `eqx.error_if` when traced."""
    if isinstance(values, jax.core.Tracer):
        return eqx.error_if(values, bad, f"{_OWNER}: {message}.")
    bad = np.asarray(bad)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ConfigError(
            f"{_OWNER}: {message}, got {name}{list(where)}="
            f"{int(np.asarray(values)[where])}."
        )
    return values


# The start and the step of each kind of model -------------------------------


def start(model, ids, lengths, width, unroll, hooks=None):
    """A decoder's start: `ids` (B, T) prefilled into a cache of `width`
    positions. Returns the logits each sequence's first new token is chosen
    from (B, vocab), the decoding state, and the step `step_fn(model, state,
    unroll)` runs it with."""
    cache = _cache.init_cache(model, (ids.shape[0],), width, owner=_OWNER)
    logits, cache = _cache.extend(model, ids, cache, lengths, hooks=hooks)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    if unroll:  # blocks and caches sliced once, here, outside the loop
        blocks, state = _cache.unstack(model, cache)
        return last, (blocks, state)
    return last, (None, cache)


def step_fn(model):
    """A decoder's step: `(token (B,), state, hooks) -> (logits (B, vocab),
    state)`, one token per sequence through the scanned stack, or (with
    per-layer blocks in the state) through the blocks one after another."""

    def step(token, state, hooks=None):
        blocks, inner = state
        if blocks is None:
            logits, inner = _cache.extend(model, token[:, None], inner, hooks=hooks)
        else:
            logits, inner = _cache.decode_blocks(model, blocks, token[:, None], inner)
        return logits[:, 0], (blocks, inner)

    return step


@eqx.filter_jit
def _generate(
    model, ids, lengths, key, temperature, top_p, max_new, top_k, eos_id, pad,
    unroll, selection,
):  # fmt: skip
    """A decoder's prompts `ids` (B, T) continued by `max_new` tokens: one program."""
    B, T = ids.shape
    width = T + max_new
    col = jnp.arange(width)
    hooks = fresh(selection)
    first, state = start(model, ids, lengths, width, unroll, hooks)
    prefill = None if hooks is None else hooks.values
    out = jnp.where(col < lengths[:, None], jnp.pad(ids, ((0, 0), (0, max_new))), pad)
    out = out.astype(jnp.int32)
    steps = {}
    if max_new > 0:

        def pick(z, i):
            return choose(z, i, key, temperature, top_k, top_p)

        new, steps = decode_loop(
            step_fn(model), state, first, max_new, pick, eos_id, pad, selection
        )
        at = lengths[:, None] + jnp.arange(max_new)
        out = out.at[jnp.arange(B)[:, None], at].set(new)
    if selection is None:
        return out
    return out, prefill, steps
