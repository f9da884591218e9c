r"""The one decoding loop, its options and its sampling.

`decode_loop` chooses tokens one step at a time from a model's `step`
(whatever the model: a decoder's cached step, an encoder-decoder's decoder
step), stopping early at the end-of-sequence token or, when capturing sites,
scanning all the steps. `GenerationConfig` holds the options, `choose` the
rule: greedy, or a draw from `filter_logits` (`transformers`' logits warpers,
in their order: temperature, then top-k, then top-p). `blocklab.generate`
(`blocklab.models.generation`) starts each kind of model and runs it;
`EncoderDecoderLM.greedy` and `blocklab.text.stream_text` use the same
pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_float, check_int, check_key
from ..nn.hooks import Hooks

__all__ = [
    "GenerationConfig",
    "check_sampling",
    "choose",
    "decode_loop",
    "filter_logits",
    "sample_logits",
    "static_selection",
]


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    r"""How `generate` chooses tokens and when it stops (checked once, here).

    Args:
        temperature: $\tau > 0$: tokens are drawn from
            $\mathrm{softmax}(z / \tau)$ when sampling (a `key` is given);
            ignored by greedy decoding.
        top_k: keep the $k$ most likely tokens ($k \ge 1$; at most the
            vocabulary, checked at the call).
        top_p: nucleus sampling, $0 < p \le 1$.
        eos_id: after a sequence emits it, it emits only padding (a decoder:
            `eos_id` itself; an encoder-decoder: its `pad_token_id`), and the
            loop stops once every sequence has. `None`: a decoder never stops
            early; an encoder-decoder uses its config's `eos_token_id`.
        unroll_layers: a decoder's loop runs its blocks one after another on
            per-layer caches (`True`: faster steps, compile time growing with
            depth) or through the scanned stack (`False`: flat compile time);
            `None` unrolls stacks of at most `UNROLL_MAX_LAYERS` blocks. The
            tokens are the same either way. (Capturing sites, `hooks=`,
            always scans: a site of the stack comes out stacked over layers.)

    Raises:
        ConfigError: a field of the wrong type or outside its range, named.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_id: int | None = None
    unroll_layers: bool | None = None

    def __post_init__(self):
        owner = "GenerationConfig"
        put = object.__setattr__
        put(
            self,
            "temperature",
            check_float(owner, "temperature", self.temperature, min=0.0, min_open=True),
        )
        put(self, "top_k", check_int(owner, "top_k", self.top_k, min=1, optional=True))
        put(
            self,
            "top_p",
            check_float(
                owner,
                "top_p",
                self.top_p,
                min=0.0,
                min_open=True,
                max=1.0,
                optional=True,
            ),
        )
        put(
            self,
            "eos_id",
            check_int(owner, "eos_id", self.eos_id, min=0, optional=True),
        )
        if self.unroll_layers is not None:
            check_bool(owner, "unroll_layers", self.unroll_layers)  # fmt: skip


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


def static_selection(hooks: Hooks) -> tuple[Any, tuple]:
    """`hooks`' selection as a static (hashable) argument of the compiled loop."""
    record, edits = hooks.selection
    return record, tuple((name, tuple(fns)) for name, fns in edits.items())


def fresh(selection) -> Hooks | None:
    """A new `Hooks` of the selection for one call of the model."""
    if selection is None:
        return None
    record, edits = selection
    return Hooks(record, dict(edits))


def choose(z, i, key, temperature, top_k, top_p):
    """New token `i` from its logits `z` (..., vocab): greedy without `key`,
    else drawn with the key `fold_in(key, i)`; sampled on the rows flattened
    to one batch axis (one prompt as a batch of one), so every caller draws
    the same tokens."""
    flat = z.reshape(-1, z.shape[-1])
    if key is None:
        token = sample_logits(flat, None)
    else:
        k = jax.random.fold_in(key, i)
        token = sample_logits(
            flat, k, temperature=temperature, top_k=top_k, top_p=top_p
        )
    return token.reshape(z.shape[:-1])


def decode_loop(step, state, first, num_new, pick, eos_id, pad, selection=None):
    r"""The generation loop: `num_new` (>= 1) tokens per sequence.

    Token 0 is `pick(first, 0)` (`first`: the logits the start left,
    `(*lead, vocab)`); token $i \ge 1$ is `pick(z_i, i)` with
    `(z_i, state) = step(token_{i-1}, state, hooks)`. After a sequence has
    emitted `eos_id` it emits `pad`. Without `selection` it is a
    `lax.while_loop` that stops once every sequence has emitted `eos_id`
    (the columns it skips hold `pad`); with one, a `lax.scan` of all the
    steps whose recorded values it stacks.

    Returns:
        `(tokens, values)`: int32 `(*lead, num_new)`, and the values of the
        $S - 1$ steps stacked on a leading axis (`None` without a selection).
    """
    lead = first.shape[:-1]

    def emit(done, token):
        if eos_id is not None:
            token = jnp.where(done, pad, token)
            done = done | (token == eos_id)
        return done, token

    done, token = emit(jnp.zeros(lead, bool), pick(first, 0))
    if selection is not None:

        def body(carry, i):
            token, state, done = carry
            hooks = fresh(selection)
            logits, state = step(token, state, hooks)
            done, token = emit(done, pick(logits, i))
            return (token, state, done), (token, hooks.values)

        _, (rest, values) = jax.lax.scan(
            body, (token, state, done), jnp.arange(1, num_new, dtype=jnp.int32)
        )
        return jnp.concatenate(
            [token[..., None], jnp.moveaxis(rest, 0, -1)], -1
        ), values

    fill = jnp.full((*lead, num_new), 0 if eos_id is None else pad, jnp.int32)
    new = fill.at[..., 0].set(token)

    def cond(carry):
        i, _, _, _, done = carry
        more = i < num_new
        return more if eos_id is None else more & ~jnp.all(done)

    def body(carry):
        i, token, state, new, done = carry
        logits, state = step(token, state, None)
        done, token = emit(done, pick(logits, i))
        return i + 1, token, state, new.at[..., i].set(token), done

    *_, new, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), token, state, new, done))
    return new, None
