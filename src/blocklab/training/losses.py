r"""The training losses: next-token cross-entropy, packed documents, MoE router losses.

A **loss** is `loss_fn(model, batch, key) -> loss` (a float scalar) or
`-> (loss, aux)` (`aux` any pytree of arrays, e.g. an accuracy), where `key`
is a fresh PRNG key per step (for dropout; ignore it otherwise); that is the
form `make_train_step` (`blocklab.training.step`) takes. The next-token loss
on `(X, Y)` batches is `next_token_loss`: `lm_loss(model, X, Y)` on a batch `(X, Y)`.
`moe_loss(...)` builds the loss of a mixture of experts: a task loss plus
the router's load-balancing and z-losses (`blocklab.nn.moe`).

Both score tokens with one cross-entropy, `token_cross_entropy`: the logits
are promoted to float32 (or wider) before the log-softmax, so under mixed
precision (`precision="bf16"`) the loss is still computed and returned in
float32, and the target ids are checked against the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, Int

from .._validate import ConfigError, check_float, check_ids
from ..nn.moe import moe_forward

__all__ = [
    "lm_loss", "moe_loss", "next_token_loss", "token_cross_entropy", "mlm_loss",
    "mask_tokens", "seq2seq_loss",
]  # fmt: skip


def _wide(logits: Array) -> Array:
    """`logits` in float32, or wider when they are wider already."""
    return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


def token_cross_entropy(
    logits: Float[Array, "*N V"],
    targets: Int[Array, "*N"],
    *,
    _owner: str = "token_cross_entropy",
) -> Float[Array, "*N"]:
    r"""Per-token cross-entropy $\log\sum_v e^{z_v} - z_y$ (`-log softmax(z)[y]`).

    The one cross-entropy of the training losses (`lm_loss`, `moe_loss`).
    The logits $z$ are promoted to float32 (or wider) before the
    log-softmax, whatever their dtype (bfloat16 under mixed precision), and
    the result has that dtype.

    Args:
        logits: `(..., V)` unnormalized log-probabilities over `V` tokens.
        targets: `(...)` token ids, each in `[0, V)`.

    Raises:
        ConfigError: concrete targets with an id outside `[0, V)` (a
            negative one would silently give a finite, wrong loss; one past
            the vocabulary a NaN): the message names the id and its index.
        EquinoxRuntimeError (under `jit`): a traced target id outside
            `[0, V)` (`blocklab._validate.check_ids`).
    """
    logits = _wide(logits)
    targets = check_ids(_owner, "target ids", targets, logits.shape[-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def _check_not_empty(owner: str, targets: Any) -> None:
    if np.size(targets) == 0:
        raise ConfigError(
            f"{owner}: the batch is empty (targets of shape "
            f"{tuple(np.shape(targets))}); the mean loss over no tokens is NaN. "
            "Draw at least one sequence."
        )


def lm_loss(
    model: Any,
    X: Int[Array, "B T"],
    Y: Int[Array, "B T"],
    *,
    z_loss: float = 0.0,
    segment_ids: Int[Array, "B _"] | None = None,
) -> Float[Array, ""]:
    r"""Mean next-token cross-entropy of a batch, plus an optional z-loss.

    $$-\frac{1}{BT}\sum_{b,t}\log p(Y_{bt} \mid X_{b,\le t})
    \;+\; \frac{\alpha}{BT}\sum_{b,t} \log^2 Z_{bt},\qquad
    Z_{bt} = \sum_v e^{z_{btv}},$$
    with $\alpha$ = `z_loss` (default 0; PaLM and Wortsman et al. 2023 use
    $10^{-4}$): it pulls the softmax normalizer $\log Z$ towards 0, which
    keeps the output logits from drifting (Wortsman et al.'s output-logit
    divergence). `z_loss` is a finite number >= 0.

    `model` maps the `(B, T)` batch of token ids to `(B, T, vocab)` logits in
    one call, as `CharLM` does (its batched call is faster than `jax.vmap` over
    the sequences); pass a model written for one sequence as
    `eqx.filter_vmap(model)`. Log-softmax in float32 (or wider).

    Packed documents (`segment_ids`, as `data.pack_documents` makes them):
    the model is called as `model(X, segment_ids=S_X)` (a token attends only
    within its document, positions restart), and the mean runs over the
    targets $Y_{bt}$ of the same document as $X_{bt}$ only, so no token is
    predicted across a boundary; negative ids mark padding (no loss).
    `segment_ids` has shape `(B, T + 1)`, the segments of the whole window
    ($S_X$ = its first $T$, the targets' its last $T$), or `(B, T)`, those
    of `X` (then the last target of a row counts when its input is not
    padding).

    Raises:
        ConfigError: an empty batch (its mean is NaN), or concrete targets
            with an id outside `[0, vocab)` (a negative one would silently
            give a finite, wrong loss; one past the vocabulary a NaN): the
            message names the id and its index.
        EquinoxRuntimeError (under `jit`): a traced target id outside
            `[0, vocab)` (`blocklab._validate.check_ids`).
    """
    _check_not_empty("lm_loss", Y)
    if segment_ids is None:
        logits, keep = model(X), None
    else:
        seg_x, keep = _segment_targets(segment_ids, np.shape(X))
        logits = model(X, segment_ids=seg_x)
    per_token = token_cross_entropy(logits, Y, _owner="lm_loss")
    z_loss = check_float("lm_loss", "z_loss", z_loss, min=0.0)
    if z_loss:
        log_z = jax.nn.logsumexp(_wide(logits), axis=-1)
        per_token = per_token + z_loss * jnp.square(log_z)
    if keep is None:
        return per_token.mean()
    count = jnp.maximum(jnp.sum(keep), 1)
    return jnp.sum(jnp.where(keep, per_token, 0.0)) / count


def _segment_targets(segment_ids, shape):
    """`(segments of X, targets that count)` from `(B, T + 1)` or `(B, T)` ids."""
    seg = jnp.asarray(segment_ids)
    T = shape[-1]
    if (
        not jnp.issubdtype(seg.dtype, jnp.integer)
        or seg.shape[:-1] != tuple(shape[:-1])
        or seg.shape[-1] not in (T, T + 1)
    ):
        raise ConfigError(
            f"lm_loss: segment_ids must be integers of shape (B, T + 1) = "
            f"{(*shape[:-1], T + 1)} (the whole windows) or (B, T) = {tuple(shape)}, "
            f"got dtype {seg.dtype}, shape {tuple(seg.shape)}."
        )
    if seg.shape[-1] == T + 1:
        seg_x, seg_y = seg[..., :-1], seg[..., 1:]
    else:
        seg_x = seg
        seg_y = jnp.concatenate([seg[..., 1:], seg[..., -1:]], axis=-1)
    return seg_x, (seg_x == seg_y) & (seg_x >= 0)


def next_token_loss(
    model: Any, batch: tuple[Int[Array, "B T"], Int[Array, "B T"]], key: Any = None
) -> Float[Array, ""]:
    """The next-token loss in the general form: `lm_loss(model, *batch)`.

    `batch` is `(X, Y)`; `key` is unused (no dropout).
    """
    X, Y = batch
    return lm_loss(model, X, Y)


def _mean_token_cross_entropy(
    logits: Float[Array, "B T V"], Y: Int[Array, "B T"]
) -> Float[Array, ""]:
    """`moe_loss`'s default task loss: the mean of `token_cross_entropy`."""
    _check_not_empty("moe_loss", Y)
    return jnp.mean(token_cross_entropy(logits, Y, _owner="moe_loss"))


def moe_loss(
    task_loss: Callable[[Any, Any], Any] | None = None,
    *,
    aux_coef: float = 0.01,
    z_coef: float = 0.001,
) -> Callable[..., tuple[Array, dict[str, Array]]]:
    r"""A `loss_fn(model, batch, key) -> (loss, aux)` adding the router losses.

    For a batch `(X, Y)`, the model's output on `X` is computed through
    `moe_forward` and scored by `task_loss(output, Y)` (default: the mean
    next-token cross-entropy of the logits, in float32); then
    $$\ell = \ell_\text{task} + c_\text{aux} \frac1L \sum_l L_\text{aux}^{(l)}
    + c_z \frac1L \sum_l L_z^{(l)},$$
    the means over all MoE blocks of all stacks (Switch uses
    $c_\text{aux} = 0.01$, ST-MoE $c_z = 0.001$; `transformers`' Mixtral adds
    0.001 times the pooled `load_balancing_loss`). This is the form
    `blocklab.make_train_step(..., loss_fn=...)` and `train_sweep` take.

    Returns:
        `fn(model, batch, key=None) -> (loss, {"task", "aux", "z", "load"})`,
        `load` the `(L, E)` expert loads of the batch.
    """
    aux_coef = check_float("moe_loss", "aux_coef", aux_coef, min=0.0)
    z_coef = check_float("moe_loss", "z_coef", z_coef, min=0.0)
    task_loss = _mean_token_cross_entropy if task_loss is None else task_loss

    def fn(model, batch, key=None):
        X, Y = batch
        logits, stats = moe_forward(model, X, key=key)
        task = task_loss(logits, Y)
        aux = jnp.mean(jnp.concatenate([s.aux_loss.reshape(-1) for s in stats]))
        z = jnp.mean(jnp.concatenate([s.z_loss.reshape(-1) for s in stats]))
        load = jnp.concatenate([s.load.reshape(-1, s.load.shape[-1]) for s in stats])
        total = task + aux_coef * aux + z_coef * z
        return total, {"task": task, "aux": aux, "z": z, "load": load}

    return fn


def _masked_mean(owner, logits, labels):
    """Mean cross-entropy over the labels >= 0 (negative labels: no loss)."""
    keep = labels >= 0
    safe = jnp.where(keep, labels, 0)
    per_token = token_cross_entropy(logits, safe, _owner=owner)
    count = jnp.maximum(jnp.sum(keep), 1)
    return jnp.sum(jnp.where(keep, per_token, 0.0)) / count


def mlm_loss(
    model: Any,
    ids: Int[ArrayLike, "B T"],
    labels: Int[ArrayLike, "B T"],
    *,
    key_mask: Any = None,
    segment_ids: Int[ArrayLike, "B T"] | None = None,
    key: Any = None,
) -> Float[Array, ""]:
    r"""Masked-language-model loss: mean cross-entropy over the masked positions.

    $$-\frac{1}{|M|}\sum_{(b,t) \in M} \log p(y_{bt} \mid \tilde x_b),\qquad
    M = \{(b, t) : y_{bt} \ge 0\},$$
    where $\tilde x$ = `ids` is the corrupted input (`mask_tokens`) and the
    labels $y$ hold the original id at the positions to predict and a
    negative number (`transformers`' -100) elsewhere. `model(ids,
    key_mask=..., segment_ids=..., key=...)` returns `(B, T, vocab)` logits
    (an `EncoderModel` with `mlm_head`); `key_mask` hides padding, and
    packed documents (`segment_ids`) attend only within themselves. An
    empty $M$ gives 0. Log-softmax in float32.
    """
    _check_not_empty("mlm_loss", labels)
    kwargs = {"key": key}
    if key_mask is not None:
        kwargs["key_mask"] = key_mask
    if segment_ids is not None:
        kwargs["segment_ids"] = segment_ids
    return _masked_mean("mlm_loss", model(ids, **kwargs), jnp.asarray(labels))


def mask_tokens(
    key: Any,
    ids: Int[ArrayLike, "*batch T"],
    *,
    mask_id: int,
    vocab_size: int,
    rate: float = 0.15,
    can_mask: Any = None,
) -> tuple[Int[Array, "*batch T"], Int[Array, "*batch T"]]:
    r"""BERT's corruption (Devlin et al., 2019): `(inputs, labels)`.

    Each position where `can_mask` is True (default: all) is chosen with
    probability `rate`; a chosen token becomes `mask_id` with probability
    0.8, a uniformly random id with 0.1, and stays with 0.1. `labels` hold
    the original ids at the chosen positions and -100 elsewhere (`mlm_loss`).
    """
    rate = check_float("mask_tokens", "rate", rate, min=0.0, max=1.0)
    ids = jnp.asarray(ids)
    k_pick, k_kind, k_rand = jax.random.split(key, 3)
    pick = jax.random.uniform(k_pick, ids.shape) < rate
    if can_mask is not None:
        pick = pick & jnp.asarray(can_mask, bool)
    u = jax.random.uniform(k_kind, ids.shape)
    rand = jax.random.randint(k_rand, ids.shape, 0, vocab_size, ids.dtype)
    keep_or_rand = jnp.where(u < 0.9, rand, ids)
    new = jnp.where(u < 0.8, jnp.asarray(mask_id, ids.dtype), keep_or_rand)
    return jnp.where(pick, new, ids), jnp.where(pick, ids, -100)


def seq2seq_loss(
    model: Any,
    src_ids: Int[ArrayLike, "B S"] | Float[ArrayLike, "B M L"],
    tgt_in: Int[ArrayLike, "B T"],
    tgt_out: Int[ArrayLike, "B T"],
    *,
    src_mask: Any = None,
    key: Any = None,
) -> Float[Array, ""]:
    r"""Sequence-to-sequence loss: mean next-token cross-entropy of the target.

    $$-\frac{1}{|M|}\sum_{(b,t) \in M} \log p(y_{bt} \mid y_{b,<t}, u_b),
    \qquad M = \{(b, t): y_{bt} \ge 0\},$$
    with `tgt_in` the decoder's input (the target shifted right behind the
    start token) and `tgt_out` = $y$ the target, negative at padding.
    `model(src_ids, tgt_in, src_mask=..., key=...)` returns `(B, T, vocab)`
    logits (an `EncoderDecoderLM`; with an audio encoder `src_ids` are its
    log-mel features). Log-softmax in float32.
    """
    _check_not_empty("seq2seq_loss", tgt_out)
    logits = model(src_ids, tgt_in, src_mask=src_mask, key=key)
    return _masked_mean("seq2seq_loss", logits, jnp.asarray(tgt_out))
