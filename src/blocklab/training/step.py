r"""The training step: a pure, vmappable optimizer step on batches drawn from a key.

The pieces, from the inside out:

- A **loss** `loss_fn(model, batch, key) -> loss | (loss, aux)`
  (`blocklab.training.losses`; the default is `next_token_loss`).
- A **batch source**, drawn on the device from a key: either a callable
  `source(key) -> batch` (any pytree of arrays, the same shapes and dtypes
  for every key) or an object with a method `source.batch(key) -> batch`
  (e.g. an `eqx.Module` holding the data, so its arrays are arguments of the
  compiled step rather than constants baked into it); `draw_batch` draws
  from either. A token dataset (`TimeMachine`, `TokenDataset`: anything
  with `train_batch(key, batch_size)`) is turned into one by
  `LMBatches(data, batch_size)`, which `make_train_step(optimizer, data,
  batch_size=...)` does for you. Such a *pure* source is traced once into
  the compiled step. A *host* source (an iterator, generator or iterable of
  batches, or `host_source(fn)` for a host callable) is drawn on the host
  once per step and passed in as `step(state, key, batch)`
  (`blocklab.training.sources`; `train_model` prefetches it a chunk ahead).
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
  the loss cannot take; `train_model` and `blocklab.train_sweep` call it
  before the run.
- `init_state(model, optimizer)`, `step_keys(key, start, num)` and
  `validation_loss(model, data)`.

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

Randomness: step $s$ of a run with key $k$ uses `jax.random.fold_in(k, s)`
(`step_keys`), so a run is reproducible and independent of how steps are
grouped into chunks. The batch is drawn from that key and the loss gets
`fold_in(key, 1)` (so the batches are those of a plain
`train_batch(key, ...)`).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from .._validate import ConfigError, check_choice, check_int
from ..data.datasets import TimeMachine, TokenDataset
from .losses import lm_loss, next_token_loss
from .sources import FORMS, HostSource, check_pure, is_host_source

__all__ = [
    "LMBatches",
    "PRECISIONS",
    "TrainState",
    "TrainStep",
    "draw_batch",
    "init_state",
    "is_token_data",
    "accumulate",
    "make_train_step",
    "split_microbatches",
    "step_keys",
    "validation_loss",
]

#: The precision policies of `make_train_step` (see the module docstring).
PRECISIONS = ("float32", "bf16")


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


def is_token_data(data: Any) -> bool:
    """A token dataset (`train_batch(key, batch_size)`), not a batch source."""
    return callable(getattr(data, "train_batch", None)) and not callable(
        getattr(data, "batch", None)
    )


def draw_batch(source: Any, key: PRNGKeyArray) -> Any:
    """The batch of a pure source for `key`: `source.batch(key)` or `source(key)`.

    Raises:
        ConfigError: a host source (its batches are drawn on the host and
            passed to the step).
    """
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


def split_microbatches(batch: Any, k: int, *, _owner: str = "TrainStep") -> Any:
    r"""`batch` as `k` microbatches: every leaf `(B, ...)` becomes `(k, B/k, ...)`.

    Microbatch $j$ holds rows $j, j + k, j + 2k, \ldots$ (strided, so that a
    batch split over devices along its rows stays split the same way in every
    microbatch). A scalar leaf is repeated in each.

    Raises:
        ConfigError: `k` does not divide a leaf's leading axis.
    """

    def split(a):
        if np.ndim(a) == 0:
            return jnp.broadcast_to(a, (k,))
        rows = a.shape[0]
        if rows % k:
            raise ConfigError(
                f"{_owner}: microbatches={k} does not divide the batch's leading "
                f"axis ({rows} rows, leaf {a.dtype}{list(a.shape)}); pick a "
                f"divisor of {rows}."
            )
        return jnp.swapaxes(a.reshape(rows // k, k, *a.shape[1:]), 0, 1)

    return jax.tree_util.tree_map(split, batch)


def accumulate(
    loss_of: Any, params: Any, batch: Any, key: PRNGKeyArray, k: int
) -> tuple[Any, Any, Any]:
    r"""Loss and gradient of a batch as the mean over `k` microbatches.

    $$L = \frac1k \sum_{j=1}^{k} L_j, \qquad
    \nabla L = \frac1k \sum_{j=1}^{k} \nabla L_j,$$
    with $L_j$ the loss of microbatch $j$ (`split_microbatches`), computed
    one microbatch at a time in a `lax.scan` (one compiled step; the
    activations of one microbatch alive at a time). For a loss that is a mean
    over equally weighted rows (the next-token loss on full windows) this is
    the full batch's loss and gradient. Microbatch $j$'s loss gets the key
    `fold_in(key, j)`.

    Args:
        loss_of: `loss_of(params, batch, key) -> (loss, aux)`.
        params, batch, key: as `loss_of` takes them.
        k: the number of microbatches (divides every leaf's leading axis).

    Returns:
        `(loss, aux, grads)`: aux's floating leaves are averaged over the
        microbatches, its other leaves summed.
    """
    parts = split_microbatches(batch, k)
    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def body(acc, xs):
        part, j = xs
        (loss, aux), grads = grad_fn(params, part, jax.random.fold_in(key, j))
        total, gsum = acc
        gsum = jax.tree_util.tree_map(jnp.add, gsum, grads)
        return (total + loss, gsum), aux

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    init = (jnp.zeros((), jnp.float32), zeros)
    (total, gsum), auxs = jax.lax.scan(body, init, (parts, jnp.arange(k)))
    grads = jax.tree_util.tree_map(lambda g: (g / k).astype(g.dtype), gsum)
    aux = jax.tree_util.tree_map(
        lambda a: (
            jnp.mean(a, axis=0)
            if jnp.issubdtype(a.dtype, jnp.inexact)
            else jnp.sum(a, axis=0)
        ),
        auxs,
    )
    return total / k, aux, grads


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
        microbatches: `k`, the batch is split into `k` microbatches whose
            gradients are accumulated in one step (see `accumulate`).
    """

    source: Any
    loss_fn: Any
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    precision: str = eqx.field(static=True)
    microbatches: int = eqx.field(static=True, default=1)

    @property
    def data(self) -> Any:
        """The token dataset of an `LMBatches` source (`step.data`)."""
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
            and is_token_data(self.data)
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
        batch = draw_batch(self.source, key) if batch is None else batch
        params, static = eqx.partition(state.model, eqx.is_inexact_array)
        loss_key = jax.random.fold_in(key, 1)

        def loss_of(p, b, k):
            loss, aux = self._raw_loss(p, static, b, k)
            return jnp.asarray(loss).astype(jnp.float32), aux

        if self.microbatches == 1:
            grad_fn = jax.value_and_grad(loss_of, has_aux=True)
            (loss, aux), grads = grad_fn(params, batch, loss_key)
        else:
            loss, aux, grads = accumulate(
                loss_of, params, batch, loss_key, self.microbatches
            )
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
        self, state: TrainState, *, first_key: Any = None, _owner: str = "TrainStep"
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
        owner = _owner
        key = jax.random.key(0)
        if isinstance(self.source, HostSource):
            # A host source's first batch is kept for the first step (a host
            # callable gets that step's key, `first_key`).
            first = self.source.peek(
                key if first_key is None else first_key, _owner=owner
            )
            batch = jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), np.result_type(a)), first
            )
        else:
            check_pure(lambda k: draw_batch(self.source, k), _owner=owner)
        try:
            if not isinstance(self.source, HostSource):
                batch = jax.eval_shape(lambda k: draw_batch(self.source, k), key)
        except Exception as err:  # noqa: BLE001 - re-raised with context
            raise ConfigError(
                f"{owner}: the batch source failed to draw a batch from a key "
                f"(it must be source(key) or source.batch(key) returning a pytree "
                f"of arrays): {type(err).__name__}: {err}"
            ) from err
        shapes = jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", batch)
        if self.microbatches > 1:
            jax.eval_shape(
                lambda b: split_microbatches(b, self.microbatches, _owner=owner), batch
            )
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
    microbatches: int = 1,
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
        microbatches: split each batch into this many microbatches and
            accumulate their gradients in the one compiled step
            (`accumulate`): the same update as the whole batch, with the
            activations of one microbatch alive at a time. It must divide
            the batch's leading axis.

    The step's arrays (the corpus) are fields of the returned module, so
    `eqx.filter_jit` passes them as arguments rather than baking them into the
    program, and `jax.vmap(step.scan)(states, keys)` runs many runs at once.
    """
    owner = "make_train_step"
    precision = check_choice(owner, "precision", precision, PRECISIONS)
    microbatches = check_int(owner, "microbatches", microbatches, min=1)
    if is_token_data(source):
        source = LMBatches(source, 64 if batch_size is None else batch_size)
    elif is_host_source(source):
        if batch_size is not None:
            raise ConfigError(
                f"{owner}: batch_size applies to token datasets; a host source "
                "yields whole batches."
            )
        source = HostSource(source, _owner=owner)
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
    return TrainStep(source, loss_fn, optimizer, precision, microbatches)


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
