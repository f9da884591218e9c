r"""Training a language model: pure, vmappable steps and a thin loop around them.

The pieces, from the inside out:

- `lm_loss(model, X, Y)`: mean token cross-entropy of a batch (float32).
- `TrainState`: a pytree of the model, the optax state, the step count and a
  `finite` flag. Every leaf is an array, so a stack of states (one per seed or
  learning rate) is just a `TrainState` with a leading axis.
- `make_train_step(optimizer, data, batch_size=...)` returns a `TrainStep`:
  `step(state, key) -> (state, loss)` draws a batch from `key` on the device,
  takes one optimizer step and returns the loss; `step.scan(state, keys)`
  fuses `len(keys)` steps into one `lax.scan`. Both are pure (no Python side
  effects), so they compose with `jax.jit`, `jax.vmap` (seeds: vmap the state
  and keys; learning rates: build the optimizer with
  `optax.inject_hyperparams` so the rate is part of the state) and sharding.
- `init_state(model, optimizer)` and `validation_loss(model, data)`.
- `train_lm(model, data, optimizer, num_steps, key=...)`: the loop that the
  chapter's experiment runs: compiled chunks of fused steps, tqdm progress, a
  stop with a message on a non-finite loss.

A non-finite loss (or update) never corrupts a state: the step that sees it
leaves the state unchanged and clears `finite`; once cleared, later steps are
no-ops that report NaN. So a diverged run keeps its last finite model, also
inside a vmapped sweep.

Randomness: step $s$ of `train_lm(..., key=k)` uses `jax.random.fold_in(k, s)`,
so a run is reproducible and independent of how steps are grouped into chunks.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray
from tqdm.auto import tqdm

from .data import TimeMachine

__all__ = [
    "TrainState",
    "TrainStep",
    "TrainResult",
    "init_state",
    "lm_loss",
    "make_train_step",
    "step_keys",
    "validation_loss",
    "train_lm",
]


def lm_loss(model: Any, X: Int[Array, "B T"], Y: Int[Array, "B T"]) -> Float[Array, ""]:
    r"""Mean next-token cross-entropy of a batch.

    $$-\frac{1}{BT}\sum_{b,t}\log p(Y_{bt} \mid X_{b,\le t})$$

    `model` maps the `(B, T)` batch of token ids to `(B, T, vocab)` logits in
    one call, as `CharLM` does (its batched call is faster than `jax.vmap` over
    the sequences); pass a model written for one sequence as
    `eqx.filter_vmap(model)`. Log-softmax in float32 (or wider).
    """
    logits = model(X)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()


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
    """One pure training step on batches drawn from `data` (see `make_train_step`).

    Calling it, `step(state, key) -> (state, loss)`: draws `batch_size`
    training windows from `key`, computes `lm_loss` and its gradient, and
    applies one optimizer update. If the loss or the update is not finite, or
    `state.finite` is already `False`, the update is skipped: the state is
    returned unchanged except `finite=False`, and the loss is reported as NaN
    (so a reported loss is always that of an applied step).
    """

    data: TimeMachine
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    batch_size: int = eqx.field(static=True)

    def __call__(
        self, state: TrainState, key: PRNGKeyArray
    ) -> tuple[TrainState, Float[Array, ""]]:
        X, Y = self.data.train_batch(key, self.batch_size)
        params, static = eqx.partition(state.model, eqx.is_inexact_array)

        def loss_fn(p):
            return lm_loss(eqx.combine(p, static), X, Y)

        loss, grads = jax.value_and_grad(loss_fn)(params)
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
        return new, jnp.where(ok, loss, jnp.nan)

    def scan(
        self, state: TrainState, keys: Key[Array, " n"]
    ) -> tuple[TrainState, Float[Array, " n"]]:
        """`len(keys)` steps fused in one `lax.scan`: `(final state, (n,) losses)`."""
        return jax.lax.scan(lambda s, k: self(s, k), state, keys)


def make_train_step(
    optimizer: optax.GradientTransformation, data: TimeMachine, *, batch_size: int = 64
) -> TrainStep:
    """A pure training step for language models on `data` (a `TimeMachine`).

    The step's arrays (the corpus) are fields of the returned module, so
    `eqx.filter_jit` passes them as arguments rather than baking them into the
    program, and `jax.vmap(step.scan)(states, keys)` runs many runs at once.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    return TrainStep(data, optimizer, batch_size)


def step_keys(
    key: PRNGKeyArray, start: int | Int[Array, ""], num: int
) -> Key[Array, " num"]:
    """The keys of steps `start .. start + num - 1`: `fold_in(key, s)` for step `s`."""
    steps = jnp.arange(num) + start
    return jax.vmap(lambda s: jax.random.fold_in(key, s))(steps)


def validation_loss(
    model: Any, data: TimeMachine, *, chunk: int = 250
) -> Float[Array, ""]:
    """`lm_loss` over the fixed validation windows of `data` (all `num_val` of them).

    Evaluated in chunks of `chunk` windows (`lax.map`) to bound memory; every
    window has the same number of tokens, so the mean of chunk means is exact
    when `chunk` divides `num_val` and a token-weighted mean otherwise.
    """
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


_validation_loss = eqx.filter_jit(validation_loss)


class TrainResult(NamedTuple):
    """What `train_lm` returns.

    Attributes:
        model: the trained model (the last one with a finite loss).
        losses: `(num_steps_done,)` float32 NumPy array of per-step training losses.
        val_loss: validation loss of `model` at the end (NaN without
            validation windows).
        state: the final `TrainState` (to resume: `train_lm(..., state=...)`).
        stopped: `None`, or why the run stopped early.
    """

    model: Any
    losses: np.ndarray
    val_loss: float
    state: TrainState
    stopped: str | None


def train_lm(
    model: Any,
    data: TimeMachine,
    optimizer: optax.GradientTransformation,
    num_steps: int,
    *,
    key: PRNGKeyArray,
    batch_size: int = 64,
    steps_per_call: int = 25,
    state: TrainState | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train `model` for `num_steps` optimizer steps on random batches of `data`.

    The work is `make_train_step(optimizer, data, batch_size=...)` run as
    compiled chunks of `steps_per_call` fused steps (`TrainStep.scan`), with
    the state's buffers donated to each chunk; the host only reads each
    chunk's losses back for the progress bar.

    Args:
        model: maps a `(T,)` sequence to `(T, vocab)` logits (e.g. `CharLM`).
        data: the corpus and its split (`TimeMachine`).
        optimizer: an optax transformation (the chapter: `optax.adamw(1e-3,
            weight_decay=0.0)`).
        num_steps: optimizer steps to take.
        key: PRNG key of the batches (step `s` uses `fold_in(key, s)`).
        batch_size: sequences per step.
        steps_per_call: steps fused per compiled call.
        state: resume from this `TrainState` (then `model` is ignored).
        progress: show a tqdm bar.

    Returns:
        A `TrainResult`. If a loss becomes non-finite the run stops there with
        a warning, and the result holds the model and losses up to the last
        finite step (nothing is lost).
    """
    if not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"train_lm: num_steps must be an int >= 0, got {num_steps!r}.")
    if not isinstance(steps_per_call, int) or steps_per_call < 1:
        raise ValueError(
            f"train_lm: steps_per_call must be a positive int, got {steps_per_call!r}."
        )
    step = make_train_step(optimizer, data, batch_size=batch_size)
    state = init_state(model, optimizer) if state is None else state
    # The state is donated chunk by chunk: work on a copy so the caller's
    # model stays valid.
    state = jax.tree_util.tree_map(
        lambda a: jnp.array(a, copy=True) if eqx.is_array(a) else a, state
    )
    start = int(state.step)
    losses: list[np.ndarray] = []
    stopped = None
    done = 0
    with tqdm(total=num_steps, desc="train", unit="step", disable=not progress) as bar:
        while done < num_steps:
            n = min(steps_per_call, num_steps - done)
            state, chunk = _run_chunk(step, state, step_keys(key, start + done, n))
            chunk = np.asarray(chunk, dtype=np.float32)
            bad = ~np.isfinite(chunk)
            if bad.any():
                first = int(np.argmax(bad))
                losses.append(chunk[:first])
                stopped = (
                    f"non-finite training loss or update at step "
                    f"{start + done + first + 1}; stopped and kept the model "
                    f"after step {start + done + first}."
                )
                bar.update(first)
                break
            losses.append(chunk)
            done += n
            bar.update(n)
            bar.set_postfix(loss=f"{chunk[-1]:.3f}")
    if stopped is not None:
        warnings.warn(f"train_lm: {stopped}", RuntimeWarning, stacklevel=2)
    val = float(_validation_loss(state.model, data)) if data.num_val else math.nan
    all_losses = np.concatenate(losses) if losses else np.zeros(0, np.float32)
    return TrainResult(state.model, all_losses, val, state, stopped)
