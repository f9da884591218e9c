r"""Activations while generating: `capture_generate`.

Generation runs the prompt once through the model with its key/value cache
(the prefill), then one token per step (`blocklab.models.decoding.extend`), each
step choosing the next token from the last logits. `capture_generate` is
`blocklab.generate(..., hooks=...)` with the names and patterns resolved: it
records the values at the chosen sites in that very loop, so what it reports
is what the model computed while it produced the tokens, edits
(`blocklab.interp.intervene`'s) included, and the whole loop is one compiled
program: the prefill, then a `lax.scan` over the steps.

With the prompt $t_{0..T-1}$ and $S$ = `max_new_tokens`, new token $s$ is
chosen from the logits at row $T - 1 + s$ of the sequence,
$$t_{T+s} = \mathrm{choose}_s\big(z_{T-1+s}\big),\qquad
z_i = f(t_{0..i})_i,$$
$\mathrm{choose}_s$ being $\arg\max$ (greedy) or a draw from
$\mathrm{softmax}$(`filter_logits(z)`) with the key
`jax.random.fold_in(key, s)`. The values reported for step $s$ are those of
that row, $i = T - 1 + s$: row $T - 1$ of the prefill for $s = 0$, then the
decoding step that fed token $t_{T-1+s}$. By causality they equal the rows
$T-1, \ldots, T+S-2$ of `capture(model, tokens, sites)` on the generated
sequence (to float32 rounding: the cached path computes the same sums in
another order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int

from .._validate import ConfigError, check_ids, check_int
from ..models import decoding as _cache
from ..models.charlm import CharLM
from ..models.decode_loop import GenerationConfig, check_sampling
from ..models.decoder import DecoderLM
from ..models.generation import generate
from ..nn.hooks import Edit, Hooks
from .sites import Selection, _cache_key, edit_table, select, site_shapes, unpack

__all__ = ["capture_generate", "decode_site_shapes"]

_OWNER = "capture_generate"

_CATALOGUES: dict[Any, dict[str, jax.ShapeDtypeStruct]] = {}

#: Sites that exist only when a whole sequence runs at once: their key axis
#: is the sequence's (the attention step refuses them).
_WHOLE_SEQUENCE = ("attn.hook_attn_scores", "attn.hook_pattern")


def _whole_sequence_only(name: str) -> bool:
    return any(name.endswith(s) for s in _WHOLE_SEQUENCE)


def decode_site_shapes(
    model: DecoderLM | CharLM,
    batch_shape: tuple[int, ...] = (),
    max_len: int = 2,
    num_tokens: int = 1,
) -> dict[str, jax.ShapeDtypeStruct]:
    """The activation sites of one cached step of `model`, with their shapes.

    `jax.eval_shape` of `blocklab.models.decoding.extend` of `num_tokens` tokens
    per sequence (`batch_shape` sequences) into a cache of `max_len`
    positions, recording every site the step has: all of `site_shapes`' but
    the attention scores and pattern. Stacked sites are keyed
    `blocks.*.<site>` with their leading layer axis, as in `site_shapes`.
    Cached per model structure and arguments.
    """
    probe = jnp.zeros((*batch_shape, num_tokens), jnp.int32)
    key = _cache_key(model, probe, {"max_len": max_len})
    try:
        hit = _CATALOGUES.get(key)
    except TypeError:  # an unhashable static field: no caching
        key, hit = None, None
    if hit is not None:
        return hit
    names = frozenset(
        s for s in site_shapes(model, probe) if not _whole_sequence_only(s)
    )

    def run(m, ids):
        hooks = Hooks(names)
        cache = _cache.init_cache(m, batch_shape, max_len, owner=_OWNER)
        _cache.extend(m, ids, cache, hooks=hooks)
        return hooks.values

    shapes = jax.eval_shape(run, model, jax.ShapeDtypeStruct(probe.shape, jnp.int32))
    if key is not None:
        _CATALOGUES[key] = shapes
    return shapes


def _resolve(
    forward: Mapping[str, Any],
    step: Mapping[str, Any],
    patterns: Sequence[str],
    what: str,
) -> Selection:
    """`select` against the sites of a decoding step; a pattern that only
    matches sites of the whole-sequence forward (scores, pattern) is refused
    with the reason, naming those sites."""
    for pattern in patterns:
        try:
            select(step, [pattern], what=f"{_OWNER}: {what}")
        except ConfigError as err:
            try:
                hits = select(forward, [pattern], what=what)
            except ConfigError:
                raise err from None
            raise ConfigError(
                f"{_OWNER}: {what} {pattern!r} selects {sorted(hits)}, which exist "
                "only when the whole sequence runs at once (their key axis is the "
                "sequence's), not while decoding one token per step. Capture them "
                "on the generated tokens afterwards: "
                "blocklab.interp.capture(model, tokens, sites)."
            ) from None
    return select(step, patterns, what=f"{_OWNER}: {what}")


def _token_axes(
    one: Mapping[str, Any], two: Mapping[str, Any], sites: Sequence[str]
) -> dict[str, int]:
    """The token axis of each site: where its shape differs between a step
    of one token and a step of two."""
    axes = {}
    for site in sites:
        diff = [
            i
            for i, (a, b) in enumerate(
                zip(one[site].shape, two[site].shape, strict=True)
            )
            if a != b
        ]
        if len(diff) != 1:
            raise ConfigError(
                f"{_OWNER}: site {site!r} has no token axis (shape "
                f"{tuple(one[site].shape)} for one token, {tuple(two[site].shape)} "
                "for two); it cannot be captured per generated token."
            )
        axes[site] = diff[0]
    return axes


def _check_sites(sites: Any) -> list[str]:
    if isinstance(sites, str):
        return [sites]
    if isinstance(sites, (list, tuple)) and all(isinstance(s, str) for s in sites):
        return list(sites)
    raise ConfigError(
        f"{_OWNER}: sites must be a site name or pattern (a str) or a list of "
        f"them, e.g. 'blocks.*.hook_resid_post', got {type(sites).__name__} "
        f"{sites!r}."
    )


def capture_generate(
    model: DecoderLM | CharLM,
    prompt: Int[ArrayLike, "*batch T"],
    max_new_tokens: int,
    sites: str | Sequence[str],
    *,
    key: Any = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    edits: Mapping[str, Edit] | None = None,
) -> tuple[Int[Array, "*batch total"], dict[str, Array], dict[str, Array]]:
    r"""Generate `max_new_tokens` tokens and capture the values at `sites` at each.

    The prompt goes through the model with a key/value cache (the prefill),
    then a `lax.scan` of $S - 1$ cached steps (no early stop) feeds one token
    per sequence; new token $s = 0, \ldots, S-1$ is chosen from the logits of
    row $i = T - 1 + s$: $\arg\max z_i$ without `key`, else a draw from
    $\mathrm{softmax}$(`filter_logits`($z_i$, `temperature`, `top_k`,
    `top_p`)) with the key `jax.random.fold_in(key, s)`: the tokens of
    `blocklab.generate` with the same arguments. The values of step $s$ are
    those of row $T - 1 + s$, the row whose logits chose token $s$; they
    equal rows $T-1, \ldots, T+S-2$ of
    `blocklab.interp.capture(model, tokens, sites)` on the tokens returned.
    Prefill and steps are one compiled program (cached per model structure,
    shapes, sites, `top_k`, edits and whether sampling and `top_p` are on).

    Args:
        model: a `DecoderLM` (any family, converted ones included) or a
            `CharLM`.
        prompt: `(T,)` token ids of one prompt, or `(B, T)` prompts of equal
            length.
        max_new_tokens: $S \ge 0$ tokens to add; $T + S$ must not exceed the
            model's `max_len`.
        sites: names or patterns, as for `capture`, of the sites a cached step
            has: all but `attn.hook_attn_scores` and `attn.hook_pattern`
            (refused by name: their key axis is the whole sequence's; capture
            them on the returned tokens with `capture`).
        key, temperature, top_k, top_p: sampling, as for `blocklab.generate`
            (`key=None` is greedy).
        edits: as for `intervene`, applied in the prefill and in every step
            (a steering vector then acts on every prompt row and every
            generated token). An edit sees the values of one call: the
            prompt's rows in the prefill, one row per sequence in a step (an
            edit that reads along the token axis, such as `steer(...,
            positions=...)` or a mean over positions, acts on that call's
            rows only).

    Returns:
        `(tokens, prefill_values, step_values)`:

        - `tokens`: int32 `(*batch, T + S)`, the prompt then the new tokens;
        - `prefill_values`: the values on the prompt, keyed and shaped as
            `capture`'s on it: `(*batch, T, ...)`, a stacked site
            `(L, *batch, T, ...)`;
        - `step_values`: per step the values of its one row, stacked over the
            steps on a new leading axis of size $S$, the token axis dropped:
            `(S, *batch, ...)`, a stacked site `(S, L, *batch, ...)` (the layer
            axis after the step axis; `blocks.{l}.<site>` keys, when only some
            layers are selected, `(S, *batch, ...)`). For example
            `blocks.*.hook_resid_post` is `(S, L, *batch, d)`, `attn.hook_z`
            `(S, L, *batch, H, p)`, `unembed.hook_out` (the logits each
            token was chosen from) `(S, *batch, vocab)`.

    Raises:
        ConfigError: naming the argument: a model of another type, a prompt
            that is not integer ids in `[0, vocab)` of shape `(T,)` or
            `(B, T)`, `max_new_tokens` negative or too many for `max_len`,
            bad sampling arguments (as `generate`), `sites` not a str or list
            of str, a site that matches nothing or exists only on the whole
            sequence (scores, pattern), an edit that is not callable or
            changes its site's shape or dtype.
    """
    if not isinstance(model, (DecoderLM, CharLM)):
        raise ConfigError(
            f"{_OWNER}: model must be a DecoderLM or a CharLM (a model with a "
            f"key/value cache), got {type(model).__name__}."
        )
    vocab, max_len = _cache.model_limits(model)
    if isinstance(prompt, (str, bytes)):
        raise ConfigError(
            f"{_OWNER}: prompt must be token ids, got a {type(prompt).__name__}; "
            "tokenize it first."
        )
    prompt = _cache._prompt_ids(_OWNER, "prompt", prompt, batch=" of equal length")
    prompt = check_ids(_OWNER, "prompt", prompt, vocab, what="vocab_size")
    T = prompt.shape[-1]
    S = check_int(_OWNER, "max_new_tokens", max_new_tokens, min=0)
    if T + S > max_len:
        raise ConfigError(
            f"{_OWNER}: the prompt's T={T} tokens plus max_new_tokens={S} exceed "
            f"the model's max_len={max_len} (at most {max(max_len - T, 0)} new "
            "tokens)."
        )
    key, temperature, top_k, top_p = check_sampling(
        _OWNER, key, temperature, top_k, top_p, vocab
    )
    patterns = _check_sites(sites)
    if edits is not None and not isinstance(edits, Mapping):
        raise ConfigError(
            f"{_OWNER}: edits must map site names or patterns to fn(value, layer), "
            f"got {type(edits).__name__}."
        )
    batch_shape = tuple(prompt.shape[:-1])
    width = max(T + S, 2)
    forward = site_shapes(model, prompt)
    one = decode_site_shapes(model, batch_shape, width, 1)
    selection = _resolve(forward, one, patterns, "sites")
    table = {}
    if edits:
        _resolve(forward, one, list(edits), "edits")
        table = edit_table(one, edits)
    two = decode_site_shapes(model, batch_shape, width, 2)
    axes = _token_axes(one, two, list(selection))
    prompt = prompt.astype(jnp.int32)
    if S == 0:
        tokens, prefill = (
            prompt,
            _prefill_only(model, prompt, frozenset(selection), table),
        )
        steps = {
            s: jnp.zeros((0, *_drop(one[s].shape, axes[s])), one[s].dtype)
            for s in selection
        }
        return (
            tokens,
            unpack(prefill, selection),
            unpack(steps, selection, layer_axis=1),
        )
    config = GenerationConfig(
        temperature=temperature if key is not None else 1.0, top_k=top_k, top_p=top_p
    )
    tokens, prefill, later = generate(
        model, prompt, S, key=key, config=config,
        hooks=Hooks(frozenset(selection), table),
    )  # fmt: skip
    # step 0's values are the prefill's row T - 1 (the row its logits came
    # from); step s >= 1's, the one row of the cached step that fed token s - 1
    steps = {}
    for s, v in prefill.items():
        first = jax.lax.index_in_dim(v, T - 1, axes[s], keepdims=False)
        rest = jnp.squeeze(later[s], axes[s] + 1)
        steps[s] = jnp.concatenate([first[None], rest], axis=0)
    return tokens, unpack(prefill, selection), unpack(steps, selection, layer_axis=1)


@eqx.filter_jit
def _prefill_only(model, prompt, record, table):
    """The values of the prefill alone (no token to generate)."""
    hooks = Hooks(record, table)
    cache = _cache.init_cache(model, prompt.shape[:-1], prompt.shape[-1], owner=_OWNER)
    _cache.extend(model, prompt, cache, hooks=hooks)
    return hooks.values


def _drop(shape, axis):
    return tuple(n for i, n in enumerate(shape) if i != axis)
