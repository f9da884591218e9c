r"""The chapter's diagnostics on any model at any checkpoint: attention entropy
per head, token spread and per-block gradient norms.

`blocklab.diagnostics.propagation.signal_stats` measures a fresh
`chapter_stack` through `TransformerBlock.trace`. `model_diagnostics` measures
the same quantities on any model blocklab builds or converts (a `DecoderLM`
of any family, a `CharLM`, a bare `Stack`), trained or not, by reading its
named activation sites (`blocklab.nn.hooks`; the names of
`blocklab.interp`) in one forward and one backward pass. For block
$l = 1..L$, with $H_l$ the stream after block $l$ (`blocks.*.hook_resid_post`)
and $P_l$ its attention pattern (`blocks.*.attn.hook_pattern`, the keys
masked in `blocks.*.attn.hook_attn_scores` excluded):

- attention entropy of head $h$: the mean over the queries $q$ (and the
  batch) of $-\sum_{k \in V_q} P_{l,h,q,k} \log P_{l,h,q,k}$ (nats), $V_q$
  the keys query $q$ sees (causal, window, segments); it is at most
  $\log |V_q|$, reached by uniform attention, whose mean over the queries is
  returned beside it;
- token spread $\|H_l - \bar H_l\| / \|H_l\|$, $\bar H_l$ the mean token of
  each sequence (`blocklab.nn.functional.token_spread`, the chapter's
  definition), and the stream RMS;
- gradient norms: the Frobenius norm, per block, of the gradient of a loss
  with respect to the block's parameters. The scanned stack holds every
  block's parameter as one leaf with a leading layer axis, so one backward
  pass gives every block's gradient, and block $l$'s norm is
  $\sqrt{\sum_\text{leaves} \|\partial \ell / \partial \theta_{l}\|_F^2}$
  (and per leaf, e.g. `attention.W_q.weight`).

The gradient is taken with respect to the parameters, not the residual
stream: the chapter's diagnostic is the gradient each block's *weights*
receive (what an optimizer step sees), and the gradient with respect to
$H_l$ (`blocklab.interp.attribute`) is a different quantity, the
sensitivity of the loss to the stream, which does not split by parameter
tensor. The loss is the model's next-token loss for a language model, the
mean of `blocklab.training.losses.token_cross_entropy` over the scored
positions (what `lm_loss` computes, without its z-loss), and for a bare
`Stack` the chapter's readout $\mathrm{mean}(R \odot H_L)$ with
$R \sim \mathcal N(0, 1)$ drawn from `jax.random.key(0)`, as `signal_stats`
draws it by default; any `loss(outputs)` may replace it.

On a `chapter_stack` at initialization the numbers are `signal_stats`'s:
its `attn_entropy` is the mean over heads here, its `token_spread`,
`stream_rms` and `grad_norms["W_q"]` are this `token_spread`, `stream_rms`
and `grad_norms["attention.W_q.weight"]`.

`model_diagnostics` is a pure function of the model: it composes with
`jax.vmap` over the members of a sweep, so `train_sweep(..., sweep=SweepConfig(
probe=lambda m: model_diagnostics(m, ids)))` records every diagnostic on a
fixed batch at initialization and after every chunk, for every member,
stacked `(members, evaluations, ...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._validate import ConfigError, check_bool
from ..nn.functional import attention_entropy, token_spread
from ..nn.hooks import Hooks
from ..nn.stack import Stack
from ..training.losses import token_cross_entropy

__all__ = ["model_diagnostics", "attention_stats", "SITES"]

_PATTERN = "blocks.*.attn.hook_pattern"
_SCORES = "blocks.*.attn.hook_attn_scores"
_RESID = "blocks.*.hook_resid_post"

#: The activation sites `model_diagnostics` reads.
SITES = (_PATTERN, _SCORES, _RESID)


def _stack_of(model: Any) -> Callable[[Any], Stack]:
    """How to reach the model's scanned `Stack` (the model itself, or `.stack`)."""
    if isinstance(model, Stack):
        return lambda m: m
    if isinstance(getattr(model, "stack", None), Stack):
        return lambda m: m.stack
    raise ConfigError(
        f"model_diagnostics: model must be a DecoderLM, a CharLM or a Stack (a "
        f"model with a scanned Stack of blocks), got {type(model).__name__}."
    )


def _rms(h: Array) -> Array:
    hf = h.astype(jnp.promote_types(h.dtype, jnp.float32))
    return jnp.sqrt(jnp.mean(jnp.square(hf)))


def attention_stats(pattern: Array, scores: Array) -> tuple[Array, Array]:
    r"""Per-head attention entropy and its uniform bound from one layer's sites.

    Args:
        pattern: `(..., H, Tq, Tk)` attention weights (`hook_pattern`).
        scores: the scores of the same shape (`hook_attn_scores`), $-\infty$
            at the keys a query does not see.

    Returns:
        `(entropy (H,), uniform ())`: the mean over the batch and the queries
        of $-\sum_{k \in V_q} p_{qk} \log p_{qk}$ per head, and the mean of
        $\log |V_q|$ (the entropy of uniform attention over the visible keys).
        A query that sees no key (all masked) is left out of both means.
    """
    visible = jnp.isfinite(scores)
    ent = attention_entropy(jnp.where(visible, pattern, 0.0))  # (..., H, Tq)
    count = jnp.sum(visible, axis=-1)  # (..., H, Tq)
    rows = count > 0
    log_n = jnp.log(jnp.maximum(count, 1).astype(ent.dtype))
    H = pattern.shape[-3]
    # heads first, everything else (batch, queries) flattened
    ent = jnp.moveaxis(ent, -2, 0).reshape(H, -1)
    log_n = jnp.moveaxis(log_n, -2, 0).reshape(H, -1)
    w = jnp.moveaxis(rows, -2, 0).reshape(H, -1).astype(ent.dtype)
    per_head = jnp.sum(ent * w, -1) / jnp.maximum(jnp.sum(w, -1), 1.0)
    uniform = jnp.sum(log_n * w) / jnp.maximum(jnp.sum(w), 1.0)
    return per_head, uniform


def _default_loss(is_lm: bool, inputs: Any, targets: Any):
    """`loss(forward)`: the next-token loss, or the chapter's readout loss."""
    if not is_lm:

        def readout(forward):
            H = forward(inputs)
            R = jax.random.normal(jax.random.key(0), H.shape, H.dtype)
            return jnp.mean(R * H)

        return readout

    def next_token(forward):
        logits = forward(inputs)
        if targets is None:  # position t predicts token t + 1 of the inputs
            logits, Y = logits[..., :-1, :], jnp.asarray(inputs)[..., 1:]
        else:
            Y = targets
        return jnp.mean(token_cross_entropy(logits, Y, _owner="model_diagnostics"))

    return next_token


@eqx.filter_jit
def _diagnose(model, inputs, targets, loss, grads, kwargs):
    get_stack = _stack_of(model)
    is_lm = not isinstance(model, Stack)
    if loss is None:
        score = _default_loss(is_lm, inputs, targets)
    else:

        def score(forward):
            return loss(forward(inputs))

    def run(params, static):
        m = eqx.combine(params, static)
        hooks = Hooks(set(SITES))

        def forward(x):
            return m(x, hooks=hooks, **kwargs)

        if grads:
            value = score(forward)
        else:
            forward(inputs)
            value = None
        missing = sorted(set(SITES) - set(hooks.values))
        if missing:
            raise ConfigError(
                f"model_diagnostics: the model reported no sites {missing}; its "
                "blocks' attention must report its pattern and scores."
            )
        return value, {s: hooks.values[s] for s in SITES}

    blocks = get_stack(model).blocks
    spec = eqx.tree_at(
        lambda m: get_stack(m).blocks,
        jax.tree_util.tree_map(lambda _: False, model),
        replace=jax.tree_util.tree_map(eqx.is_inexact_array, blocks),
    )
    params, static = eqx.partition(model, spec)
    if grads:
        (value, sites), g = jax.value_and_grad(run, has_aux=True)(params, static)
    else:
        value, sites = run(params, static)
    entropy, uniform = jax.vmap(attention_stats)(sites[_PATTERN], sites[_SCORES])
    H = sites[_RESID]
    out = {
        "attn_entropy": entropy,
        "attn_entropy_uniform": uniform,
        "token_spread": jax.vmap(token_spread)(H),
        "stream_rms": jax.vmap(_rms)(H),
    }
    if grads:
        leaves = jax.tree_util.tree_flatten_with_path(get_stack(g).blocks)[0]
        per_leaf = {}
        for path, leaf in leaves:
            if leaf is None:
                continue
            sq = jnp.square(leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32)))
            per_leaf[jax.tree_util.keystr(path).lstrip(".")] = jnp.sum(
                sq.reshape(sq.shape[0], -1), -1
            )
        out["loss"] = value
        out["grad_norm"] = jnp.sqrt(sum(per_leaf.values()))
        out["grad_norms"] = {k: jnp.sqrt(v) for k, v in per_leaf.items()}
    return out


def model_diagnostics(
    model: Any,
    inputs: ArrayLike,
    *,
    targets: ArrayLike | None = None,
    loss: Callable[[Any], Array] | None = None,
    grads: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    r"""The chapter's diagnostics of `model` on `inputs`, per layer (see the module).

    One forward pass records the sites, one backward pass the gradients;
    jitted (`eqx.filter_jit`), and a pure function of the model, so it runs
    under `jax.vmap` over models (a sweep's members) or inputs.

    Args:
        model: a `DecoderLM` (any family, converted or built), a `CharLM`, or
            a `Stack` of `TransformerBlock`s; trained or not.
        inputs: token ids `(T,)` or `(B, T)` for a language model; a stream
            `(T, d)` or `(B, T, d)` for a `Stack`.
        targets: the next-token targets, of the shape of `inputs`: the loss
            is `lm_loss(model, inputs, targets)`, the mean cross-entropy
            $-\frac1{BT}\sum \log p(Y_{bt} \mid X_{b,\le t})$; `None` scores the inputs
            themselves: position $t$ predicts token $t + 1$ (the mean over
            the first $T - 1$ positions; needs $T \ge 2$). Language models only.
        loss: `loss(outputs) -> ()`, the loss whose gradient is measured, in
            place of the default (the next-token loss, or for a `Stack` the
            readout $\mathrm{mean}(R \odot H_L)$, $R \sim \mathcal N(0, 1)$
            from `jax.random.key(0)`).
        grads: `False` skips the backward pass (no `loss` or gradient entries).
        **kwargs: forwarded to the model's call (`positions`, `segment_ids`
            for a decoder; `valid_lens` for a `Stack`).

    Returns:
        A dict of arrays over the L blocks:

        - `"attn_entropy"`: `(L, H)` mean attention entropy of each head
            (nats; masked keys excluded);
        - `"attn_entropy_uniform"`: `(L,)` the mean over queries of
            $\log$ (number of visible keys), the entropy of uniform attention
            (every entry of `attn_entropy[l]` is at most `attn_entropy_uniform[l]`);
        - `"token_spread"`, `"stream_rms"`: `(L,)` of the stream after each
            block, over the whole batch;
        - `"loss"`: `()` the loss;
        - `"grad_norm"`: `(L,)` the norm of the loss's gradient with respect
            to all of block l's floating-point parameters;
        - `"grad_norms"`: `{leaf: (L,)}` the same per parameter, keyed by its
            path in the block (`"attention.W_q.weight"`, `"ffn.W_1.weight"`, ...).

    Raises:
        ConfigError: a model without a scanned `Stack`, `targets` with a
            `Stack` or with `loss`, `targets` of another shape than `inputs`,
            a sequence of one token with the default loss.
    """
    owner = "model_diagnostics"
    _stack_of(model)
    grads = check_bool(owner, "grads", grads)
    is_lm = not isinstance(model, Stack)
    if loss is not None and not callable(loss):
        raise ConfigError(
            f"{owner}: loss must be a function loss(outputs) -> scalar, got "
            f"{type(loss).__name__} {loss!r}."
        )
    if targets is not None:
        if not is_lm:
            raise ConfigError(
                f"{owner}: targets are next-token ids for a language model; a "
                "Stack has none (its default loss is the readout mean(R * H)); "
                "pass loss=fn(outputs) instead."
            )
        if loss is not None:
            raise ConfigError(
                f"{owner}: give targets (for the next-token loss) or loss, not both."
            )
        targets = jnp.asarray(targets)
        if targets.shape != jnp.shape(inputs):
            raise ConfigError(
                f"{owner}: targets must have the shape of inputs "
                f"{tuple(jnp.shape(inputs))}, got targets.shape="
                f"{tuple(targets.shape)}."
            )
    elif is_lm and loss is None and grads and jnp.shape(inputs)[-1:] in ((), (1,)):
        raise ConfigError(
            f"{owner}: the default loss scores token t + 1 from position t and "
            f"needs at least 2 tokens, got inputs of shape "
            f"{tuple(jnp.shape(inputs))}; pass targets= or loss=."
        )
    return _diagnose(model, inputs, targets, loss, grads, kwargs)
