r"""Cached generation for `DecoderLM` and `CharLM`: `generate` and its sampling.

`generate` prefills the prompt into a `DecoderCache` (`blocklab.models.decoding`) and
then decodes one token per sequence per step: prefill and the decode loop (one
`lax.while_loop`) are one compiled program. Each new token's logits are those
of the uncached model at its position.

The decode loop runs the blocks in one of two ways (`unroll_layers`):

- scanned: the cache goes through the scanned stack as data, so neither
  compile time nor program size grows with depth; but each step slices every
  block's weights and cache out of the stacked arrays, and on a CPU, where
  XLA hands products of more than one row to YNNPACK (which takes whole
  buffers), that copies every layer's cache, and every weight, per token;
- unrolled: the blocks are sliced once, before the loop (`Stack.unstack`),
  and the loop runs them one after another on per-layer caches, written in
  place: no copy per step, and a program that grows with depth.

Measured on a 2-core CPU (`benchmarks/generate.py`: Llama-style, d = 256,
batch 8, 64 new tokens), the unrolled loop runs 1.4-1.5x faster at 4, 16 and
48 blocks, and compiles in 1.3, 3.4 and 8.7 s against a flat 0.9 s: it pays
when the compiled program is reused (it is cached per model structure,
shapes and options). The default unrolls stacks of up to
`UNROLL_MAX_LAYERS` blocks (about 1 s more compile time at most).

The sampling rules (`filter_logits`) are those of `transformers`' logits
warpers, in their order: temperature, then top-k, then top-p.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, Shaped

from .._validate import ConfigError, check_bool, check_float, check_int, check_key
from . import decoding as _cache
from .charlm import CharLM
from .decoder import DecoderLM

__all__ = ["generate", "filter_logits", "sample_logits", "UNROLL_MAX_LAYERS"]

_OWNER = "generate"

#: `generate(unroll_layers=None)` unrolls its decode loop's blocks up to this
#: depth (about 0.17 s of compile time per block on a 2-core CPU), and scans
#: deeper stacks (flat compile time).
UNROLL_MAX_LAYERS = 8


def filter_logits(
    logits: Float[ArrayLike, "*batch vocab"],
    *,
    temperature: float | Array = 1.0,
    top_k: int | None = None,
    top_p: float | Array | None = None,
) -> Float[Array, "*batch vocab"]:
    r"""The scores a token is sampled from: temperature, top-k, then top-p.

    With $z$ the float32 logits and $\tau$ the temperature, $s = z / \tau$;
    top-k keeps the $k$ largest scores, $s_j \ge s_{(k)}$ (ties with the
    $k$-th are kept); top-p (nucleus, Holtzman et al., 2020) sorts what is
    left in decreasing order, $s_{(1)} \ge s_{(2)} \ge \ldots$, with
    probabilities $\pi = \mathrm{softmax}(s)$ and keeps $s_{(j)}$ iff the mass
    ranked above it is below $p$: $\sum_{i<j} \pi_{(i)} < p$ (the smallest
    set of top tokens whose mass reaches $p$; the top token always stays).
    Removed scores become $-\infty$. This is `transformers`'
    `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper` in
    that order. Arguments are not checked here (`generate` checks them).
    """
    z = jnp.asarray(logits, jnp.float32) / jnp.asarray(temperature, jnp.float32)
    if top_k is not None and top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    if top_p is not None:
        order = jnp.argsort(-z, axis=-1, stable=True)
        zs = jnp.take_along_axis(z, order, axis=-1)
        probs = jax.nn.softmax(zs, axis=-1)
        above = jnp.cumsum(probs, axis=-1) - probs  # mass ranked above each
        above = above.at[..., 0].set(0.0)
        keep = above < jnp.asarray(top_p, jnp.float32)
        threshold = jnp.min(jnp.where(keep, zs, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z >= threshold, z, -jnp.inf)
    return z


def sample_logits(
    logits: Float[ArrayLike, "*batch vocab"],
    key: PRNGKeyArray | None,
    *,
    temperature: float | Array = 1.0,
    top_k: int | None = None,
    top_p: float | Array | None = None,
) -> Int[Array, "*batch"]:
    """One token per row: $\\arg\\max z$ when `key` is `None` (greedy; the
    first index on ties, as `torch.argmax`), else a draw from
    $\\mathrm{softmax}$(`filter_logits(...)`)."""
    if key is None:
        return jnp.argmax(jnp.asarray(logits), axis=-1).astype(jnp.int32)
    z = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)


def check_sampling(
    owner: str, key: Any, temperature: Any, top_k: Any, top_p: Any, vocab: int
) -> tuple[Any, float, int | None, float | None]:
    """The sampling arguments of `generate`, checked: `key` (`None` is greedy),
    `temperature` (> 0 when sampling, >= 0 otherwise), `top_k` in
    `[1, vocab]` and `top_p` in `(0, 1]` (each optional)."""
    sampling = key is not None
    if sampling:
        key = check_key(owner, "key", key)
        legacy = not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        if key.shape[: key.ndim - legacy]:
            raise ConfigError(
                f"{owner}: key must be one PRNG key, got a batch of keys of shape "
                f"{tuple(key.shape)}; pass one (e.g. jax.random.split(key)[0]), or "
                "jax.vmap the call over the keys."
            )
    temperature = check_float(
        owner, "temperature", temperature, min=0.0, min_open=sampling
    )
    top_k = check_int(owner, "top_k", top_k, min=1, max=vocab, optional=True)
    top_p = check_float(
        owner, "top_p", top_p, min=0.0, min_open=True, max=1.0, optional=True
    )
    return key, temperature, top_k, top_p


def generate(
    model: eqx.Module,
    ids: Shaped[ArrayLike, "*batch T"],
    max_new_tokens: int,
    *,
    key: Any = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    lengths: Shaped[ArrayLike, " B"] | None = None,
    unroll_layers: bool | None = None,
) -> Int[Array, "*batch L"]:
    r"""Continue prompts by `max_new_tokens` tokens each, with a key/value cache.

    The prompt goes through the model once (`prefill`), then each step feeds
    the last token of every sequence (`decode_step`) at that sequence's own
    next position, $\ell_b, \ell_b + 1, \ldots$, and picks the next token from
    its logits $z$: $\arg\max z$ without `key` (greedy), else a draw from
    $\mathrm{softmax}(s)$ with $s$ = `filter_logits(z, temperature, top_k,
    top_p)` (the key of step $i$ is `jax.random.fold_in(key, i)`). The logits
    equal the uncached model's at every step. Prefill and the decode loop (a
    `lax.while_loop`, which stops early once every sequence has emitted
    `eos_id`) are one compiled program, compiled once per model structure,
    shapes, `max_new_tokens`, `top_k`, `eos_id`, greedy or not, and whether
    `top_p` is set.

    Args:
        model: a `DecoderLM` (any family, converted ones included) or a
            `CharLM`.
        ids: `(T,)` token ids of one prompt, or `(B, T)` prompts. Text goes
            through a tokenizer: `blocklab.generate_text(model, tokenizer,
            prompts, max_new_tokens)`.
        max_new_tokens: tokens to add, >= 0; $T$ + `max_new_tokens` must not
            exceed the model's `max_len`.
        key: `None` for greedy decoding; a PRNG key (`jax.random.key`) to
            sample (anything else is refused with a `ConfigError`).
        temperature: $\tau > 0$ when sampling (ignored by greedy decoding).
        top_k: keep the $k$ most likely tokens, $1 \le k \le$ vocabulary.
        top_p: nucleus sampling, $0 < p \le 1$.
        eos_id: after a sequence emits it, that sequence emits only it.
        lengths: `(B,)` prompt lengths in $[1, T]$ for ragged prompts in one
            batch: `ids` is right-padded, row $b$ holds `lengths[b]` tokens.
            Always one length per row (per sequence), also when `B == T`:
            unlike attention's `valid_lens` there is no per-query reading.
        unroll_layers: run the decode loop's blocks one after another on
            per-layer caches (`True`: faster steps, compile time growing with
            depth) or through the scanned stack (`False`: flat compile time);
            `None` unrolls stacks of at most `UNROLL_MAX_LAYERS` blocks. The
            tokens are the same either way.

    Returns:
        int32 `(B, T + max_new_tokens)` (or `(T + max_new_tokens,)` for a
        prompt `(T,)`): row $b$ holds its `lengths[b]` prompt tokens (all
        $T$ without `lengths`), then its `max_new_tokens` new tokens, then
        padding up to the full width. The padding value is `eos_id` when it
        is given, else 0.

    Raises:
        ConfigError: naming the argument: a model of another type, text
            (a `str` or `bytes`) for `ids`, ids that are not integers in
            `[0, vocab)` of shape `(T,)` or `(B, T)`, a prompt longer than
            `max_len` (or with `max_new_tokens` more),
            `max_new_tokens < 0`, `top_k` outside `[1, vocab]`, `top_p`
            outside $(0, 1]$, `temperature` $\le 0$ when sampling, `eos_id`
            outside the vocabulary, `lengths` of the wrong shape or outside
            $[1, T]$, `unroll_layers` not a bool or None.
    """
    if isinstance(ids, (str, bytes)):
        raise ConfigError(
            f"{_OWNER}: ids must be token ids, got a {type(ids).__name__}; for "
            "text in and text out call blocklab.generate_text(model, tokenizer, "
            "prompts, max_new_tokens) (for a character-level CharLM the tokenizer "
            "is blocklab.data.VOCAB)."
        )
    if not isinstance(model, (DecoderLM, CharLM)):
        raise ConfigError(
            f"{_OWNER}: model must be a DecoderLM or a CharLM, got "
            f"{type(model).__name__}."
        )
    vocab, max_len = _cache.model_limits(model)
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ConfigError(
            f"{_OWNER}: ids must be integer token ids, got dtype {ids.dtype}."
        )
    if ids.ndim not in (1, 2) or ids.shape[-1] < 1:
        raise ConfigError(
            f"{_OWNER}: ids must be one prompt (T,) or a batch (B, T) with T >= 1, "
            f"got shape {tuple(ids.shape)}."
        )
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
        _OWNER, key, temperature, top_k, top_p, vocab
    )
    sampling = key is not None
    eos_id = check_int(_OWNER, "eos_id", eos_id, min=0, max=vocab - 1, optional=True)
    if unroll_layers is None:
        unroll = model.stack.num_blks <= UNROLL_MAX_LAYERS
    else:
        unroll = check_bool(_OWNER, "unroll_layers", unroll_layers)
    single = ids.ndim == 1
    batch = ids[None] if single else ids
    B = batch.shape[0]
    if lengths is None:
        lens = jnp.full((B,), T, jnp.int32)
    else:
        lens = jnp.asarray(lengths)
        if single or not jnp.issubdtype(lens.dtype, jnp.integer) or lens.shape != (B,):
            raise ConfigError(
                f"{_OWNER}: lengths must be integers of shape (B,) = ({B},) for "
                f"ids of shape (B, T) = {tuple(ids.shape)}, got dtype {lens.dtype}, "
                f"shape {tuple(lens.shape)}"
                + (" (a single prompt (T,) takes no lengths)" if single else "")
                + "."
            )
        lens = _checked(
            lens, (lens < 1) | (lens > T), f"lengths must lie in [1, T={T}]", "lengths"
        ).astype(jnp.int32)
    batch = _checked(
        batch, (batch < 0) | (batch >= vocab),
        f"token ids must lie in [0, vocab_size={vocab})", "ids",
    ).astype(jnp.int32)  # fmt: skip
    pad = 0 if eos_id is None else eos_id
    if max_new == 0:
        out = jnp.where(jnp.arange(T) < lens[:, None], batch, pad)
    else:
        out = _generate(
            model, batch, lens, key,
            None if not sampling else jnp.float32(temperature),
            None if top_p is None or not sampling else jnp.float32(top_p),
            max_new, top_k if sampling else None,
            None if eos_id is None else jnp.int32(eos_id), jnp.int32(pad), unroll,
        )  # fmt: skip
    return out[0] if single else out


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


@eqx.filter_jit
def _generate(
    model, ids, lengths, key, temperature, top_p, max_new, top_k, eos_id, pad, unroll
):
    """Prefill `ids` (B, T) and decode `max_new` (>= 1) tokens: one program."""
    B, T = ids.shape
    width = T + max_new
    rows, col = jnp.arange(B), jnp.arange(width)
    cache = _cache.init_cache(model, (B,), width, owner=_OWNER)
    logits, cache = _cache.extend(model, ids, cache, lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    out = jnp.where(
        col < lengths[:, None], jnp.pad(ids, ((0, 0), (0, max_new))), pad
    ).astype(jnp.int32)

    def choose(z, i):
        if key is None:
            return sample_logits(z, None)
        k = jax.random.fold_in(key, i)
        return sample_logits(z, k, temperature=temperature, top_k=top_k, top_p=top_p)

    def emit(out, done, token, i):
        if eos_id is not None:
            token = jnp.where(done, eos_id, token)
            done = done | (token == eos_id)
        return out.at[rows, lengths + i].set(token), done, token

    out, done, token = emit(out, jnp.zeros(B, bool), choose(last, 0), 0)

    def cond(state):
        i, _, _, _, done = state
        more = i < max_new
        return more if eos_id is None else more & ~jnp.all(done)

    if unroll:  # blocks and caches sliced once, here, outside the loop
        blocks, carry = _cache.unstack(model, cache)

        def advance(token, state):
            return _cache.decode_blocks(model, blocks, token, state)
    else:
        carry = cache

        def advance(token, cache):
            return _cache.extend(model, token, cache)

    def body(state):
        i, token, carry, out, done = state
        logits, carry = advance(token[:, None], carry)
        out, done, token = emit(out, done, choose(logits[:, 0], i), i)
        return i + 1, token, carry, out, done

    i, _, _, out, done = jax.lax.while_loop(
        cond, body, (jnp.int32(1), token, carry, out, done)
    )
    if eos_id is not None:  # the steps skipped once every sequence had ended
        end = lengths[:, None]
        skipped = done[:, None] & (col >= end + i) & (col < end + max_new)
        out = jnp.where(skipped, eos_id, out)
    return out
