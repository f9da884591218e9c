r"""The training losses: the next-token cross-entropy and its packed-document form.

A **loss** is `loss_fn(model, batch, key) -> loss` (a float scalar) or
`-> (loss, aux)` (`aux` any pytree of arrays, e.g. an accuracy), where `key`
is a fresh PRNG key per step (for dropout; ignore it otherwise); that is the
form `make_train_step` (`blocklab.training.step`) takes. The chapter's loss
is `next_token_loss`: `lm_loss(model, X, Y)` on a batch `(X, Y)`.

`lm_loss` promotes the logits to float32 (or wider) before its log-softmax,
so under mixed precision (`precision="bf16"`) the loss is still computed and
returned in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from .._validate import ConfigError, check_float, check_ids

__all__ = ["lm_loss", "next_token_loss"]


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
    if np.size(Y) == 0:
        raise ConfigError(
            f"lm_loss: the batch is empty (targets of shape {tuple(np.shape(Y))}); "
            "the mean loss over no tokens is NaN. Draw at least one sequence."
        )
    if segment_ids is None:
        logits, keep = model(X), None
    else:
        seg_x, keep = _segment_targets(segment_ids, np.shape(X))
        logits = model(X, segment_ids=seg_x)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    vocab = logits.shape[-1]
    Y = check_ids("lm_loss", "target ids", Y, vocab)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, Y)
    z_loss = check_float("lm_loss", "z_loss", z_loss, min=0.0)
    if z_loss:
        log_z = jax.nn.logsumexp(logits, axis=-1)
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
    """The chapter's loss in the general form: `lm_loss(model, *batch)`.

    `batch` is `(X, Y)`; `key` is unused (the chapter's model has no dropout).
    """
    X, Y = batch
    return lm_loss(model, X, Y)
