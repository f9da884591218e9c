r"""One training run: `train_model` for any model, source and loss, and `train_lm`.

`train_model(model, source, optimizer, num_steps, key=..., run=RunConfig(...))`
builds the step (`make_train_step`, `blocklab.training.step`), checks the
source and the loss once by tracing, and runs the steps as compiled chunks
of fused steps with the state's buffers donated to each chunk. Around the chunks it is
`blocklab.training.loop.run_chunks`, the one loop it shares with
`blocklab.train_sweep`: tqdm progress, the loss's aux, a stop with a message
on a non-finite loss (the last finite model is kept), and the validation
loss at the end. A host source is drawn on the host and prefetched to the
device a chunk ahead; when it runs out, training ends with a message and
keeps the finished steps. With `RunConfig(mesh=...)` the same step runs on a
mesh (`blocklab.training.mesh_training`).

`train_lm(model, data, optimizer, num_steps, key=...)` is the language-model
shortcut: the next-token loss on a token dataset, validated on its
validation windows.

Randomness: step $s$ of `train_lm(..., key=k)` uses `jax.random.fold_in(k, s)`,
so a run is reproducible and independent of how steps are grouped into chunks.
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
from jaxtyping import Array, Key, PRNGKeyArray

from .._validate import ConfigError, check_int, check_key
from ..data.datasets import TimeMachine, TokenDataset
from ..nn.remat import with_remat
from . import mesh_training, placement
from .hyperparams import check_values, climbs
from .loop import run_chunks
from .run_config import RunConfig, _run_with
from .sources import HostSource
from .step import (
    TrainState,
    TrainStep,
    init_state,
    is_token_data,
    make_train_step,
    step_keys,
    validation_loss,
)

__all__ = ["TrainResult", "train_lm", "train_model"]


@eqx.filter_jit(donate="all-except-first")
def _run_chunk(step: TrainStep, state: TrainState, keys: Key[Array, " n"]):
    return step.scan(state, keys)


@eqx.filter_jit(donate="all-except-first")
def _run_host_chunk(step: TrainStep, state: TrainState, keys, batches):
    return step.scan(state, keys, batches)


def _stacked(batches: list[Any]) -> Any:
    """A host source's batches stacked over the steps, put on the device."""
    return jax.device_put(
        jax.tree_util.tree_map(
            lambda *b: np.stack([np.asarray(x) for x in b]), *batches
        )
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


def _check_descends(owner: str, tx: Any, state: TrainState) -> None:
    """Refuse a fresh optimizer whose hyperparameters make it climb or blow up.

    Injected hyperparameters are checked against their valid intervals
    (`blocklab.training.hyperparams.RANGES`, the rule sweeps use too).
    Without an injected learning rate, the first update for the gradient
    $g = 1$ is probed: a learning rate below zero makes it climb
    ($\\sum_i u_i g_i > 0$).
    """
    has_lr = False
    for hyper in _injected(state.opt_state):
        check_values(hyper, members=False, _owner=owner)
        has_lr |= "learning_rate" in hyper and not callable(hyper["learning_rate"])
    if has_lr:
        return
    try:
        climb = float(climbs(tx, state.opt_state, state.model))
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
    state: TrainState | None = None,
    run: RunConfig = RunConfig(),  # noqa: B008 - frozen, never mutated
) -> TrainResult:
    r"""Train `model` for `num_steps` steps of `loss_fn` on batches of `source`.

    The work is `make_train_step(optimizer, source, loss_fn=...,
    batch_size=run.batch_size, precision=run.precision,
    microbatches=run.microbatches)` run as compiled chunks of
    `run.steps_per_call` fused steps (`TrainStep.scan`), with the state's
    buffers donated to each chunk; the host only reads each chunk's losses
    back for the progress bar. The source and loss are checked once by
    tracing (`TrainStep.check`) first. Step $s$ draws its batch (and the
    loss's key) from $\mathrm{fold\_in}(\kappa, s)$, so the numbers do not
    depend on `steps_per_call`.

    Args:
        model: an Equinox module (its floating-point arrays are trained).
        source: a batch source or a token dataset (see `make_train_step`).
        optimizer: an optax transformation.
        num_steps: optimizer steps to take (>= 1).
        key: PRNG key $\kappa$ of the batches (step `s` uses `fold_in(key, s)`).
        loss_fn: `loss_fn(model, batch, key) -> loss | (loss, aux)`; default
            the next-token loss (as for `make_train_step`).
        state: resume from this `TrainState` (then `model` is ignored).
        run: the run's options, a `blocklab.RunConfig`: `batch_size`,
            `precision`, `steps_per_call`, `microbatches`, `remat` (the
            returned model carries it), `mesh` (the model, its optimizer
            state and each batch split over it,
            `blocklab.training.mesh_training`) with its `rules` (default
            `"fsdp"`), `progress`.

    Returns:
        A `TrainResult` (validation loss: that of a token dataset's
        validation windows under the next-token loss, otherwise NaN). If a
        loss becomes non-finite the run stops there with a warning, and the
        result holds the model and losses up to the last finite step.

    Example:
        `train_model(model, source, optax.adam(1e-3), 100, key=k,
        loss_fn=mlm_loss, run=RunConfig(batch_size=8, remat="dots"))`.
    """
    return _train(
        model, source, optimizer, num_steps, key=key, loss_fn=loss_fn,
        state=state, run=run, owner="train_model",
    )  # fmt: skip


def _train(
    model: Any,
    source: Any,
    optimizer: optax.GradientTransformation,
    num_steps: int,
    *,
    key: PRNGKeyArray,
    loss_fn: Any,
    state: TrainState | None,
    run: RunConfig,
    owner: str,
) -> TrainResult:
    """`train_model` with the caller's name (`owner`) in its messages."""
    run = _run_with(owner, run, {})
    batch_size, precision = run.batch_size, run.precision
    steps_per_call, progress = run.steps_per_call, run.progress
    mesh, rules, microbatches, remat = run.mesh, run.rules, run.microbatches, run.remat
    num_steps = check_int(owner, "num_steps", num_steps, min=1)
    key = check_key(owner, "key", key)
    step = make_train_step(
        optimizer, source, loss_fn=loss_fn, batch_size=batch_size,
        precision=precision, microbatches=microbatches,
    )  # fmt: skip
    if remat is not None:
        if state is None:
            model = with_remat(model, remat)
        else:
            state = TrainState(
                with_remat(state.model, remat), state.opt_state, state.step,
                state.finite,
            )  # fmt: skip
    fresh = state is None
    on_mesh = None  # the state's shardings when training on a mesh
    if mesh is None and rules is not None:
        raise ConfigError(f"{owner}: rules={rules!r} needs a mesh= to lay out on.")
    if mesh is None:
        state = init_state(model, optimizer) if fresh else state
    else:
        rules = "fsdp" if rules is None else rules
        if isinstance(step.source, HostSource):
            raise ConfigError(
                f"{owner}: a host batch source cannot train on a mesh yet; draw "
                "the batches on the device (source(key) or source.batch(key))."
            )
        step = mesh_training.shard_step(step, mesh, rules)
        state, on_mesh = (
            mesh_training.sharded_state(model, optimizer, mesh, rules)
            if fresh
            else mesh_training.reshard_state(state, mesh, rules, optimizer)
        )
        mesh_training.check_batch(step, mesh, _owner=owner)
    has_aux = step.check(
        state, first_key=step_keys(key, int(state.step), 1)[0], _owner=owner
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
        batches = host.take(keys, _owner=owner)
        return keys[: len(batches)], (_stacked(batches) if batches else None)

    def advance(state, done, n):
        if on_mesh is not None:
            keys = step_keys(key, start + done, n)
            state, out = mesh_training.run_chunk((step, on_mesh), state, keys)
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

    result = run_chunks(
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
    d = int(result.diverged_at)
    kept = result.steps_run if d == 0 else d - 1
    stopped = None
    if d:
        stopped = (
            f"non-finite training loss or update at step {start + d}; stopped "
            f"and kept the model after step {start + d - 1}."
        )
        warnings.warn(f"{owner}: {stopped}", RuntimeWarning, stacklevel=3)
    elif result.steps_run < num_steps:
        stopped = (
            f"the host source ran out after {result.steps_run} of {num_steps} steps; "
            f"stopped and kept the model after step {start + result.steps_run}."
        )
        warnings.warn(f"{owner}: {stopped}", UserWarning, stacklevel=3)
    aux = result.aux
    if aux is not None:
        aux = jax.tree_util.tree_map(lambda a: a[:kept], aux)
    # On a mesh the state was laid out on its Auto view (where the step
    # runs); hand it back on the mesh given (no copy).
    final = result.state if mesh is None else placement.on_mesh(result.state, mesh)
    return TrainResult(
        final.model,
        result.losses[:kept],
        float(result.val_loss),
        final,
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
    state: TrainState | None = None,
    run: RunConfig = RunConfig(),  # noqa: B008 - frozen, never mutated
    **options: Any,
) -> TrainResult:
    r"""Train a language model for `num_steps` steps on random batches of `data`.

    The language-model shortcut for `train_model(model, data, optimizer,
    num_steps, key=key, run=run)`: the next-token loss (`lm_loss`) on
    windows of a token dataset, validated on its validation windows at the
    end. Step $s$ draws its batch from $\mathrm{fold\_in}(\kappa, s)$.

    The chapter's keywords stay: `train_lm(model, data, opt, steps, key=k,
    batch_size=32, progress=False)` is `run=dataclasses.replace(run,
    batch_size=32, progress=False)`; any `RunConfig` field may be given so.

    Args:
        model: maps a `(B, T)` batch of token ids to `(B, T, vocab)` logits
            (e.g. `CharLM`).
        data: the corpus and its split (`TimeMachine` or `TokenDataset`).
        optimizer: an optax transformation (e.g. `optax.adamw(1e-3,
            weight_decay=0.0)`); a learning rate that is not positive is
            refused.
        num_steps: optimizer steps to take (>= 1).
        key: PRNG key $\kappa$ of the batches (step `s` uses `fold_in(key, s)`).
        state: resume from this `TrainState` (then `model` is ignored).
        run: the run's options (`blocklab.RunConfig`; `batch_size=None` is
            64 sequences per step).
        **options: `RunConfig` fields that replace those of `run`
            (`batch_size`, `steps_per_call`, `precision`, `progress`, ...).

    Returns:
        A `TrainResult`. If a loss becomes non-finite the run stops there with
        a warning, and the result holds the model and losses up to the last
        finite step (nothing is lost).

    Raises:
        ConfigError: `data` not a token dataset; an option that is no
            `RunConfig` field, or a bad value of one.
    """
    if not is_token_data(data):
        raise ConfigError(
            f"train_lm: data must be a token dataset (TimeMachine, TokenDataset), "
            f"got {type(data).__name__}; use blocklab.train_model for other sources."
        )
    run = _run_with("train_lm", run, options)
    return _train(
        model, data, optimizer, num_steps, key=key, loss_fn=None, state=state,
        run=run, owner="train_lm",
    )  # fmt: skip
