r"""Training any Equinox model: pure, vmappable steps and a thin loop around them.

The pieces, from the inside out:

- A **loss** `loss_fn(model, batch, key) -> loss` (a float scalar) or
  `-> (loss, aux)` (`aux` any pytree of arrays, e.g. an accuracy), where
  `key` is a fresh PRNG key per step (for dropout; ignore it otherwise). The
  chapter's loss is `next_token_loss`: `lm_loss(model, X, Y)` on a batch
  `(X, Y)`.
- A **batch source**, drawn on the device from a key: either a callable
  `source(key) -> batch` (any pytree of arrays, the same shapes and dtypes
  for every key) or an object with a method `source.batch(key) -> batch`
  (e.g. an `eqx.Module` holding the data, so its arrays are arguments of the
  compiled step rather than constants baked into it). A token dataset
  (`TimeMachine`, `TokenDataset`: anything with `train_batch(key,
  batch_size)`) is turned into one by `LMBatches(data, batch_size)`, which
  `make_train_step(optimizer, data, batch_size=...)` does for you.
  Such a *pure* source is traced once into the compiled step. A *host*
  source (an iterator, generator or iterable of batches, or
  `host_source(fn)` for a host callable) is drawn on the host once per step
  and prefetched to the device a chunk ahead; when it runs out, training ends
  with a message and keeps the finished steps. A callable with side effects
  (`lambda key: next(it)`) is refused rather than frozen
  (`blocklab.training.sources`).
- `TrainState`: a pytree of the model, the optax state, the step count and a
  `finite` flag. Every leaf is an array, so a stack of states (one per seed or
  hyperparameter) is just a `TrainState` with a leading axis.
- `make_train_step(optimizer, source, loss_fn=..., precision=...)` returns a
  `TrainStep`: `step(state, key) -> (state, loss)` (or `(state, (loss,
  aux))` for a loss with aux) draws a batch from `key` on the device, takes
  one optimizer step and returns the loss; `step.scan(state, keys)` fuses
  `len(keys)` steps into one `lax.scan`. Both are pure (no Python side
  effects), so they compose with `jax.jit`, `jax.vmap` (seeds: vmap the state
  and keys; hyperparameters: build the optimizer with
  `optax.inject_hyperparams` so they are part of the state) and sharding.
  `step.check(state)` traces the source and the loss once with
  `jax.eval_shape` and raises a clear error for a non-scalar loss or a batch
  the loss cannot take; `train_lm` and `blocklab.train_sweep` call it before
  the run.
- `init_state(model, optimizer)` and `validation_loss(model, data)`.
- `train_lm(model, data, optimizer, num_steps, key=...)`: the loop that the
  chapter's experiment runs: compiled chunks of fused steps, tqdm progress, a
  stop with a message on a non-finite loss. `train_model(...)` is the same
  loop for any source and loss. The loop itself (chunks, progress, aux,
  divergence, validation) is `blocklab.training.loop.run_chunks`, shared
  with `blocklab.train_sweep`.

**Mixed precision** (`precision="bf16"`): the parameters and the optimizer
state stay float32. For the forward and backward pass, the floating-point
leaves of the model and of the batch are cast to bfloat16, so every matrix
product runs in bfloat16; the gradients flow back through the cast and arrive
in float32 on the float32 parameters. Norms and softmax compute their
statistics in float32 (the library's norms and attention do so whatever the
input dtype), `lm_loss` promotes the logits to float32 before its
log-softmax, and the loss is returned as float32. The update, the finiteness
test and the optimizer arithmetic are float32.

A non-finite loss (or update) never corrupts a state: the step that sees it
leaves the state unchanged and clears `finite`; once cleared, later steps are
no-ops that report NaN. So a diverged run keeps its last finite model, also
inside a vmapped sweep.

Randomness: step $s$ of `train_lm(..., key=k)` uses `jax.random.fold_in(k, s)`,
so a run is reproducible and independent of how steps are grouped into chunks.
The batch is drawn from that key and the loss gets `fold_in(key, 1)` (so the
chapter's batches are those of a plain `train_batch(key, ...)`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from .._validate import (
    ConfigError,
    check_choice,
    check_float,
    check_ids,
    check_int,
    check_key,
)
from ..data.datasets import TimeMachine, TokenDataset
from .hyperparams import check_values, climbs
from .loop import run_chunks
from .sources import FORMS, HostSource, check_pure, is_host_source

__all__ = [
    "LMBatches",
    "PRECISIONS",
    "TrainState",
    "TrainStep",
    "TrainResult",
    "init_state",
    "lm_loss",
    "make_train_step",
    "next_token_loss",
    "step_keys",
    "train_model",
    "validation_loss",
    "train_lm",
]

#: The precision policies of `make_train_step` (see the module docstring).
PRECISIONS = ("float32", "bf16")


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
    if not jnp.issubdtype(seg.dtype, jnp.integer) or seg.shape[:-1] != tuple(
        shape[:-1]
    ) or seg.shape[-1] not in (T, T + 1):
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


class LMBatches(eqx.Module):
    """The batch source of a token dataset: `batch(key) = data.train_batch(key, B)`.

    Attributes:
        data: a `TimeMachine`, a `TokenDataset`, or anything with
            `train_batch(key, batch_size) -> (X, Y)`.
        batch_size: sequences per batch.
    """

    data: Any
    batch_size: int = eqx.field(static=True)

    def __init__(self, data: Any, batch_size: int = 64):
        if not callable(getattr(data, "train_batch", None)):
            raise ConfigError(
                f"LMBatches: data must have train_batch(key, batch_size) (a "
                f"TimeMachine or TokenDataset), got {type(data).__name__}."
            )
        self.data = data
        self.batch_size = check_int("LMBatches", "batch_size", batch_size, min=1)

    def batch(self, key: PRNGKeyArray) -> tuple[Int[Array, "B T"], Int[Array, "B T"]]:
        return self.data.train_batch(key, self.batch_size)


def _is_token_data(data: Any) -> bool:
    return callable(getattr(data, "train_batch", None)) and not callable(
        getattr(data, "batch", None)
    )


def _draw(source: Any, key: PRNGKeyArray) -> Any:
    if isinstance(source, HostSource):
        raise ConfigError(
            "TrainStep: a host source is drawn on the host; pass its batch as "
            "step(state, key, batch) (train_model does so every step)."
        )
    batch = getattr(source, "batch", None)
    return batch(key) if callable(batch) else source(key)


def _is_array_leaf(x: Any) -> bool:
    """An array of any dtype, or the shape of one (`jax.ShapeDtypeStruct`).

    Every such leaf must be an *argument* of a traced function, never a
    constant closed over: a model built by `eqx.filter_eval_shape` holds
    `ShapeDtypeStruct`s for its integer leaves too (a decoder's per-layer
    RoPE base and window), and a closed-over one is neither an array that
    `lax.scan` slices per layer nor a value arithmetic accepts.
    """
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _split_loss(out: Any) -> tuple[Any, Any]:
    """`(loss, aux)` of a loss function's output (`aux=None` for a bare loss)."""
    if isinstance(out, tuple) and len(out) == 2:
        return out
    return out, None


def _to_compute(tree: Any, precision: str) -> Any:
    """The floating-point leaves of `tree` in the compute dtype of `precision`."""
    if precision == "float32":
        return tree
    return jax.tree_util.tree_map(
        lambda a: (
            a.astype(jnp.bfloat16)
            if eqx.is_inexact_array(a) and jnp.issubdtype(a.dtype, jnp.floating)
            else a
        ),
        tree,
    )


class TrainState(eqx.Module):
    """Everything a training run carries from one step to the next.

    Attributes:
        model: the model being trained (an Equinox module).
        opt_state: the optax optimizer state.
        step: number of optimizer steps applied so far.
        finite: `False` once a non-finite loss or gradient has been seen; the
            state then stops changing.
    """

    model: Any
    opt_state: Any
    step: Int[Array, ""]
    finite: Bool[Array, ""]


def init_state(model: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh `TrainState`: `optimizer.init` on the model's floating-point arrays."""
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    return TrainState(model, opt_state, jnp.zeros((), jnp.int32), jnp.ones((), bool))


class TrainStep(eqx.Module):
    """One pure step of `loss_fn` on batches of `source` (see `make_train_step`).

    Calling it, `step(state, key)`: draws a batch from `key`, computes the
    loss and its gradient (in the compute dtype of `precision`), and applies
    one optimizer update. Returns `(state, loss)`, or `(state, (loss, aux))`
    when `loss_fn` returns an aux pytree. If the loss or the update is not
    finite, or `state.finite` is already `False`, the update is skipped: the
    state is returned unchanged except `finite=False`, and the loss (and the
    floating-point leaves of aux) are reported as NaN (so a reported loss is
    always that of an applied step).

    Attributes:
        source: the batch source (`source.batch(key)` or `source(key)`).
        loss_fn: `loss_fn(model, batch, key) -> loss | (loss, aux)`.
        optimizer: the optax transformation.
        precision: `"float32"` or `"bf16"` (mixed precision).
    """

    source: Any
    loss_fn: Any
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    precision: str = eqx.field(static=True)

    @property
    def data(self) -> Any:
        """The token dataset of an `LMBatches` source (the chapter's `step.data`)."""
        return getattr(self.source, "data", self.source)

    @property
    def batch_size(self) -> int | None:
        return getattr(self.source, "batch_size", None)

    @property
    def has_validation(self) -> bool:
        """Whether a run of this step has a validation loss: the next-token
        loss on a token dataset that has validation windows."""
        return (
            self.loss_fn is next_token_loss
            and _is_token_data(self.data)
            and bool(getattr(self.data, "num_val", 0))
        )

    def _raw_loss(self, params, static, batch, key):
        """`(loss, aux)` of `loss_fn` in the compute dtype of `precision`."""
        model = _to_compute(eqx.combine(params, static), self.precision)
        return _split_loss(self.loss_fn(model, _to_compute(batch, self.precision), key))

    def __call__(
        self, state: TrainState, key: PRNGKeyArray, batch: Any = None
    ) -> tuple[TrainState, Any]:
        # A host source's batch is drawn on the host and passed in.
        batch = _draw(self.source, key) if batch is None else batch
        params, static = eqx.partition(state.model, eqx.is_inexact_array)

        def loss_of(p):
            loss, aux = self._raw_loss(p, static, batch, jax.random.fold_in(key, 1))
            return jnp.asarray(loss).astype(jnp.float32), aux

        (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, params)
        # The updates are finite only if the gradients (and the optimizer's
        # arithmetic) are.
        finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(updates))
        ok = state.finite & finite
        stepped = TrainState(
            eqx.apply_updates(state.model, updates), opt_state, state.step + 1, ok
        )
        kept = eqx.tree_at(lambda s: s.finite, state, ok)
        new = jax.tree_util.tree_map(
            lambda a, b: jnp.where(ok, a, b) if eqx.is_array(a) else a, stepped, kept
        )
        loss = jnp.where(ok, loss, jnp.nan)
        if aux is None:
            return new, loss
        aux = jax.tree_util.tree_map(
            lambda a: (
                jnp.where(ok, a, jnp.nan)
                if jnp.issubdtype(jnp.result_type(a), jnp.inexact)
                else a
            ),
            aux,
        )
        return new, (loss, aux)

    def scan(
        self, state: TrainState, keys: Key[Array, " n"], batches: Any = None
    ) -> tuple[TrainState, Any]:
        """`len(keys)` steps fused in one `lax.scan`: `(final state, (n,) losses)`.

        With an aux, the second output is `((n,) losses, aux stacked over n)`.
        `batches` (a host source's batches stacked over n) replaces the draws.
        """
        # Only the arrays are carried: a model may hold functions (activations).
        dynamic, static = eqx.partition(state, eqx.is_array)

        def body(dyn, xs):
            k, batch = xs
            new, out = self(eqx.combine(dyn, static), k, batch)
            return eqx.filter(new, eqx.is_array), out

        dynamic, outs = jax.lax.scan(body, dynamic, (keys, batches))
        return eqx.combine(dynamic, static), outs

    def check(
        self, state: TrainState, *, owner: str = "TrainStep", first_key: Any = None
    ) -> bool:
        """Trace the source and the loss once (`jax.eval_shape`; nothing runs).

        A callable source is traced twice more (`sources.check_pure`) and
        refused if it has side effects; a host source's first batch is drawn
        (with `first_key`) and kept for the first step. Returns whether
        `loss_fn` returns an aux pytree.

        Raises:
            ConfigError: the source fails or returns something other than a
                pytree of arrays; `loss_fn` fails on the batch (the message
                gives the batch's shapes and dtypes); or the loss is not a
                real scalar.
        """
        key = jax.random.key(0)
        if isinstance(self.source, HostSource):
            # A host source's first batch is kept for the first step (a host
            # callable gets that step's key, `first_key`).
            first = self.source.peek(
                key if first_key is None else first_key, owner=owner
            )
            batch = jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), np.result_type(a)), first
            )
        else:
            check_pure(owner, lambda k: _draw(self.source, k))
        try:
            if not isinstance(self.source, HostSource):
                batch = jax.eval_shape(lambda k: _draw(self.source, k), key)
        except Exception as err:  # noqa: BLE001 - re-raised with context
            raise ConfigError(
                f"{owner}: the batch source failed to draw a batch from a key "
                f"(it must be source(key) or source.batch(key) returning a pytree "
                f"of arrays): {type(err).__name__}: {err}"
            ) from err
        shapes = jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", batch)
        if self.loss_fn is next_token_loss:
            leaves = batch if isinstance(batch, tuple) else ()
            ok = len(leaves) == 2 and all(
                getattr(a, "ndim", 0) == 2
                and jnp.issubdtype(a.dtype, jnp.integer)
                and a.shape == leaves[0].shape
                for a in leaves
            )
            if not ok:
                raise ConfigError(
                    f"{owner}: the next-token loss takes batches (X, Y) of two "
                    f"integer (B, T) arrays of one shape; the source gave {shapes}. "
                    "Pass loss_fn= for other batches."
                )
        params, static = eqx.partition(state.model, _is_array_leaf)
        try:
            raw, aux = jax.eval_shape(
                lambda p, b, k: self._raw_loss(p, static, b, k), params, batch, key
            )
        except Exception as err:  # noqa: BLE001 - re-raised with context
            raise ConfigError(
                f"{owner}: loss_fn(model, batch, key) failed on a batch of "
                f"{shapes}: {type(err).__name__}: {err}"
            ) from err
        got = (
            f"{raw.dtype}{list(raw.shape)}"
            if hasattr(raw, "shape")
            else f"a {type(raw).__name__}"
        )
        if not hasattr(raw, "shape") or (
            raw.shape != () or not jnp.issubdtype(raw.dtype, jnp.floating)
        ):
            raise ConfigError(
                f"{owner}: loss_fn must return a real scalar loss, or (loss, aux) "
                f"with a scalar loss; it returned {got} (reduce it, e.g. with "
                ".mean())."
            )
        return aux is not None


def make_train_step(
    optimizer: optax.GradientTransformation,
    source: Any,
    *,
    loss_fn: Any = None,
    batch_size: int | None = None,
    precision: str = "float32",
) -> TrainStep:
    """A pure training step of `loss_fn` on the batches of `source`.

    Args:
        optimizer: an optax transformation.
        source: a batch source (`source(key)` or `source.batch(key)`), or a
            token dataset (`TimeMachine`, `TokenDataset`), which becomes
            `LMBatches(source, batch_size)`.
        loss_fn: `loss_fn(model, batch, key) -> loss | (loss, aux)`; default
            `next_token_loss` (batches `(X, Y)` of token ids).
        batch_size: sequences per batch of a token dataset (default 64); a
            general source decides its own batch, so it is refused there.
        precision: `"float32"`, or `"bf16"` for mixed precision (see the
            module docstring).

    The step's arrays (the corpus) are fields of the returned module, so
    `eqx.filter_jit` passes them as arguments rather than baking them into the
    program, and `jax.vmap(step.scan)(states, keys)` runs many runs at once.
    """
    owner = "make_train_step"
    precision = check_choice(owner, "precision", precision, PRECISIONS)
    if _is_token_data(source):
        source = LMBatches(source, 64 if batch_size is None else batch_size)
    elif is_host_source(source):
        if batch_size is not None:
            raise ConfigError(
                f"{owner}: batch_size applies to token datasets; a host source "
                "yields whole batches."
            )
        source = HostSource(source, owner=owner)
    elif batch_size is not None:
        raise ConfigError(
            f"{owner}: batch_size applies to token datasets (TimeMachine, "
            f"TokenDataset); a {type(source).__name__} source draws its own batches."
        )
    elif not (callable(source) or callable(getattr(source, "batch", None))):
        raise ConfigError(
            f"{owner}: source must be a batch source (source(key) or "
            f"source.batch(key) -> pytree of arrays) or a token dataset, got "
            f"{type(source).__name__}. Supported: {FORMS}."
        )
    loss_fn = next_token_loss if loss_fn is None else loss_fn
    if not callable(loss_fn):
        raise ConfigError(
            f"{owner}: loss_fn must be callable as loss_fn(model, batch, key), got "
            f"{type(loss_fn).__name__}."
        )
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ConfigError(
            f"{owner}: optimizer must be an optax transformation, got "
            f"{type(optimizer).__name__}."
        )
    return TrainStep(source, loss_fn, optimizer, precision)


def step_keys(
    key: PRNGKeyArray, start: int | Int[Array, ""], num: int
) -> Key[Array, " num"]:
    """The keys of steps `start .. start + num - 1`: `fold_in(key, s)` for step `s`."""
    steps = jnp.arange(num) + start
    return jax.vmap(lambda s: jax.random.fold_in(key, s))(steps)


def validation_loss(
    model: Any, data: TimeMachine | TokenDataset, *, chunk: int = 250
) -> Float[Array, ""]:
    """`lm_loss` over the fixed validation windows of `data` (all `num_val` of them).

    Evaluated in chunks of `chunk` windows (`lax.map`) to bound memory; every
    window has the same number of tokens, so the mean of chunk means is exact
    when `chunk` divides `num_val` and a token-weighted mean otherwise.
    """
    chunk = check_int("validation_loss", "chunk", chunk, min=1)
    X, Y = data.val_batch()
    n = X.shape[0]
    if n == 0:
        return jnp.asarray(jnp.nan, jnp.float32)
    chunk = min(chunk, n)
    full = (n // chunk) * chunk
    shape = (n // chunk, chunk, X.shape[1])
    sums = jax.lax.map(
        lambda xy: lm_loss(model, *xy) * chunk,
        (X[:full].reshape(shape), Y[:full].reshape(shape)),
    ).sum()
    if full < n:
        sums = sums + lm_loss(model, X[full:], Y[full:]) * (n - full)
    return sums / n


@eqx.filter_jit(donate="all-except-first")
def _run_chunk(step: TrainStep, state: TrainState, keys: Key[Array, " n"]):
    return step.scan(state, keys)


@eqx.filter_jit(donate="all-except-first")
def _run_host_chunk(step: TrainStep, state: TrainState, keys, batches):
    return step.scan(state, keys, batches)


def _stacked(batches: list[Any]) -> Any:
    """A host source's batches stacked over the steps, put on the device."""
    return jax.device_put(
        jax.tree_util.tree_map(lambda *b: np.stack([np.asarray(x) for x in b]), *batches)
    )


_validation_loss = eqx.filter_jit(validation_loss)


@dataclass(frozen=True)
class TrainResult:
    """What `train_lm` and `train_model` return.

    Attributes:
        model: the trained model (the last one with a finite loss).
        losses: `(num_steps_done,)` float32 NumPy array of per-step training losses.
        val_loss: validation loss of `model` at the end (NaN without
            validation windows, or for a general source).
        state: the final `TrainState` (to resume: `train_lm(..., state=...)`).
        stopped: `None`, or why the run stopped early.
        aux: the loss's aux pytree stacked over the steps done (NumPy), or
            `None` for a loss without aux.
    """

    model: Any
    losses: np.ndarray
    val_loss: float
    state: TrainState
    stopped: str | None
    aux: Any = None


def _injected(opt_state: Any) -> list[dict]:
    """The `hyperparams` dicts of every `inject_hyperparams` state in `opt_state`."""
    found = []

    def visit(node):
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict):
            found.append(hyper)
        return node

    jax.tree_util.tree_map(
        visit, opt_state, is_leaf=lambda n: hasattr(n, "hyperparams")
    )
    return found


def _check_descends(owner: str, optimizer: Any, state: TrainState) -> None:
    """Refuse a fresh optimizer whose hyperparameters make it climb or blow up.

    Injected hyperparameters are checked against their valid intervals
    (`blocklab.training.hyperparams.RANGES`, the rule sweeps use too).
    Without an injected learning rate, the first update for the gradient
    $g = 1$ is probed: a learning rate below zero makes it climb
    ($\\sum_i u_i g_i > 0$).
    """
    has_lr = False
    for hyper in _injected(state.opt_state):
        check_values(owner, hyper, members=False)
        has_lr |= "learning_rate" in hyper and not callable(hyper["learning_rate"])
    if has_lr:
        return
    try:
        climb = float(climbs(optimizer, state.opt_state, state.model))
    except Exception:  # noqa: BLE001 - the real step will report it
        return
    if climb > 0:
        raise ConfigError(
            f"{owner}: the optimizer's first update climbs the gradient "
            f"(sum of the update for a gradient of ones is {climb:.3g} > 0): is its "
            "learning rate negative? Pass a positive learning rate."
        )


def train_model(
    model: Any,
    source: Any,
    optimizer: optax.GradientTransformation,
    num_steps: int,
    *,
    key: PRNGKeyArray,
    loss_fn: Any = None,
    batch_size: int | None = None,
    precision: str = "float32",
    steps_per_call: int = 25,
    state: TrainState | None = None,
    progress: bool = True,
    owner: str = "train_model",
    mesh: Any = None,
    rules: Any = None,
) -> TrainResult:
    """Train `model` for `num_steps` steps of `loss_fn` on batches of `source`.

    The work is `make_train_step(optimizer, source, loss_fn=..., batch_size=...,
    precision=...)` run as compiled chunks of `steps_per_call` fused steps
    (`TrainStep.scan`), with the state's buffers donated to each chunk; the
    host only reads each chunk's losses back for the progress bar. The
    source and loss are checked once by tracing (`TrainStep.check`) first.

    Args:
        model: an Equinox module (its floating-point arrays are trained).
        source: a batch source or a token dataset (see `make_train_step`).
        optimizer: an optax transformation.
        num_steps: optimizer steps to take (>= 1).
        key: PRNG key of the batches (step `s` uses `fold_in(key, s)`).
        loss_fn, batch_size, precision: as for `make_train_step`.
        steps_per_call: steps fused per compiled call.
        state: resume from this `TrainState` (then `model` is ignored).
        progress: show a tqdm bar.
        mesh: a `jax.sharding.Mesh` over every device: the model, its
            optimizer state and each batch are split over it
            (`blocklab.training.mesh`); `None`: one device.
        rules: how (with `mesh`): a preset of
            `blocklab.training.partition` (`"fsdp"` by default, `"tp"`,
            `"ep"`, `"fsdp+tp"`, ...) or a mapping logical axis -> mesh axis.

    Returns:
        A `TrainResult` (validation loss: that of a token dataset's
        validation windows under the next-token loss, otherwise NaN). If a
        loss becomes non-finite the run stops there with a warning, and the
        result holds the model and losses up to the last finite step.
    """
    num_steps = check_int(owner, "num_steps", num_steps, min=1)
    steps_per_call = check_int(owner, "steps_per_call", steps_per_call, min=1)
    key = check_key(owner, "key", key)
    step = make_train_step(
        optimizer, source, loss_fn=loss_fn, batch_size=batch_size, precision=precision
    )
    fresh = state is None
    on_mesh = None  # the state's shardings when training on a mesh
    if mesh is None and rules is not None:
        raise ConfigError(f"{owner}: rules={rules!r} needs a mesh= to lay out on.")
    if mesh is None:
        state = init_state(model, optimizer) if fresh else state
    else:
        from . import mesh as meshes  # above this module (it imports train)

        rules = "fsdp" if rules is None else rules
        if isinstance(step.source, HostSource):
            raise ConfigError(
                f"{owner}: a host batch source cannot train on a mesh yet; draw "
                "the batches on the device (source(key) or source.batch(key))."
            )
        step = meshes.shard_step(step, mesh, rules)
        state, on_mesh = (
            meshes.sharded_state(model, optimizer, mesh, rules)
            if fresh
            else meshes.reshard_state(state, mesh, rules, optimizer)
        )
        meshes.check_batch(owner, step, mesh)
    has_aux = step.check(
        state, owner=owner, first_key=step_keys(key, int(state.step), 1)[0]
    )
    if fresh:
        _check_descends(owner, optimizer, state)
    # The state is donated chunk by chunk: work on a copy so the caller's
    # model stays valid.
    state = jax.tree_util.tree_map(
        lambda a: jnp.array(a, copy=True) if eqx.is_array(a) else a, state
    )
    start = int(state.step)

    host = step.source if isinstance(step.source, HostSource) else None
    prefetched: dict[int, Any] = {}

    def draw(done, n):
        # A host source's batches for steps done .. done + n - 1 (fewer at its end).
        keys = step_keys(key, start + done, n)
        batches = host.take(keys, owner=owner)
        return keys[: len(batches)], (_stacked(batches) if batches else None)

    def advance(state, done, n):
        if on_mesh is not None:
            keys = step_keys(key, start + done, n)
            state, out = meshes.run_chunk((step, on_mesh), state, keys)
        elif host is None:
            state, out = _run_chunk(step, state, step_keys(key, start + done, n))
        else:
            keys, batches = prefetched.pop(done, None) or draw(done, n)
            if batches is None:
                return state, np.zeros(0, np.float32), None
            state, out = _run_host_chunk(step, state, keys, batches)
            after = done + len(keys)
            if len(keys) == n and after < num_steps:
                # Draw the next chunk on the host while this one runs.
                nxt = min(steps_per_call, num_steps - after)
                prefetched[after] = draw(after, nxt)
        loss, aux = out if has_aux else (out, None)
        return state, np.asarray(loss), jax.tree_util.tree_map(np.asarray, aux)

    run = run_chunks(
        advance,
        state,
        num_steps,
        steps_per_call,
        has_aux=has_aux,
        stop_on_divergence=True,
        validate=_validation_loss_of(step),
        desc=owner,
        progress=progress,
    )
    d = int(run.diverged_at)
    kept = run.steps_run if d == 0 else d - 1
    stopped = None
    if d:
        stopped = (
            f"non-finite training loss or update at step {start + d}; stopped "
            f"and kept the model after step {start + d - 1}."
        )
        warnings.warn(f"{owner}: {stopped}", RuntimeWarning, stacklevel=3)
    elif run.steps_run < num_steps:
        stopped = (
            f"the host source ran out after {run.steps_run} of {num_steps} steps; "
            f"stopped and kept the model after step {start + run.steps_run}."
        )
        warnings.warn(f"{owner}: {stopped}", UserWarning, stacklevel=3)
    aux = (
        None if run.aux is None else jax.tree_util.tree_map(lambda a: a[:kept], run.aux)
    )
    return TrainResult(
        run.state.model,
        run.losses[:kept],
        float(run.val_loss),
        run.state,
        stopped,
        aux,
    )


def _validation_loss_of(step: TrainStep) -> Any:
    """`validation_loss` of the step's token dataset (compiled), or `None`."""
    if not step.has_validation:
        return None
    return lambda model: _validation_loss(model, step.data)


def train_lm(
    model: Any,
    data: TimeMachine | TokenDataset,
    optimizer: optax.GradientTransformation,
    num_steps: int,
    *,
    key: PRNGKeyArray,
    batch_size: int = 64,
    steps_per_call: int = 25,
    state: TrainState | None = None,
    progress: bool = True,
    precision: str = "float32",
) -> TrainResult:
    """Train a language model for `num_steps` steps on random batches of `data`.

    The chapter's shortcut for `train_model(model, data, optimizer, num_steps,
    key=key, batch_size=batch_size)`: the next-token loss (`lm_loss`) on
    windows of a token dataset, validated on its validation windows at the
    end.

    Args:
        model: maps a `(B, T)` batch of token ids to `(B, T, vocab)` logits
            (e.g. `CharLM`).
        data: the corpus and its split (`TimeMachine` or `TokenDataset`).
        optimizer: an optax transformation (the chapter: `optax.adamw(1e-3,
            weight_decay=0.0)`); a learning rate that is not positive is
            refused.
        num_steps: optimizer steps to take (>= 1).
        key: PRNG key of the batches (step `s` uses `fold_in(key, s)`).
        batch_size: sequences per step.
        steps_per_call: steps fused per compiled call.
        state: resume from this `TrainState` (then `model` is ignored).
        progress: show a tqdm bar.
        precision: `"float32"` or `"bf16"` (mixed precision).

    Returns:
        A `TrainResult`. If a loss becomes non-finite the run stops there with
        a warning, and the result holds the model and losses up to the last
        finite step (nothing is lost).
    """
    if not _is_token_data(data):
        raise ConfigError(
            f"train_lm: data must be a token dataset (TimeMachine, TokenDataset), "
            f"got {type(data).__name__}; use blocklab.train_model for other sources."
        )
    return train_model(
        model,
        data,
        optimizer,
        num_steps,
        key=key,
        batch_size=batch_size,
        precision=precision,
        steps_per_call=steps_per_call,
        state=state,
        progress=progress,
        owner="train_lm",
    )
