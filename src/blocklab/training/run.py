r"""One training run: `train_model` for any model, source and loss, and `train_lm`.

`train_model(model, source, optimizer, num_steps, key=...)` builds the step
(`make_train_step`, `blocklab.training.step`), checks the source and the loss
once by tracing, and runs the steps as compiled chunks of fused steps with
the state's buffers donated to each chunk. Around the chunks it is
`blocklab.training.loop.run_chunks`, the one loop it shares with
`blocklab.train_sweep`: tqdm progress, the loss's aux, a stop with a message
on a non-finite loss (the last finite model is kept), and the validation
loss at the end. A host source is drawn on the host and prefetched to the
device a chunk ahead; when it runs out, training ends with a message and
keeps the finished steps. With `mesh=` the same step runs on a mesh
(`blocklab.training.mesh_training`).

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
from jax.sharding import Mesh
from jaxtyping import Array, Key, PRNGKeyArray

from .._validate import ConfigError, check_int, check_key
from ..data.datasets import TimeMachine, TokenDataset
from ..nn.remat import with_remat
from . import mesh_training, placement
from .hyperparams import check_values, climbs
from .loop import run_chunks
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
        check_values(owner, hyper, members=False)
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
    batch_size: int | None = None,
    precision: str = "float32",
    steps_per_call: int = 25,
    state: TrainState | None = None,
    progress: bool = True,
    owner: str = "train_model",
    mesh: Any = None,
    rules: Any = None,
    microbatches: int = 1,
    remat: Any = None,
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
            (`blocklab.training.mesh_training`); `None`: one device.
        rules: how (with `mesh`): a preset of
            `blocklab.training.placement` (`"fsdp"` by default, `"tp"`,
            `"ep"`, `"fsdp+tp"`, ...) or a mapping logical axis -> mesh axis.
        microbatches: accumulate the gradients of this many microbatches per
            step, in the one compiled step (`make_train_step`): the same
            update as the whole batch; it must divide the batch.
        remat: the rematerialization policy of the model's stacks for this
            run (`blocklab.nn.remat`: `"none"`, `"full"`, `"dots"`,
            `"names:..."`, `"offload:..."`, `"nested"`, a bool or a
            `jax.checkpoint_policies` callable); `None` keeps the model's
            own. The returned model carries it.

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
        if not isinstance(mesh, Mesh):
            raise ConfigError(
                f"{owner}: mesh must be a jax.sharding.Mesh, got {mesh!r} "
                f"({type(mesh).__name__}); build one with "
                "blocklab.training.mesh_of('data=8') or jax.make_mesh."
            )
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
        mesh_training.check_batch(owner, step, mesh)
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
    # On a mesh the state was laid out on its Auto view (where the step
    # runs); hand it back on the mesh given (no copy).
    final = run.state if mesh is None else placement.on_mesh(run.state, mesh)
    return TrainResult(
        final.model,
        run.losses[:kept],
        float(run.val_loss),
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
    batch_size: int = 64,
    steps_per_call: int = 25,
    state: TrainState | None = None,
    progress: bool = True,
    precision: str = "float32",
) -> TrainResult:
    """Train a language model for `num_steps` steps on random batches of `data`.

    The language-model shortcut for `train_model(model, data, optimizer, num_steps,
    key=key, batch_size=batch_size)`: the next-token loss (`lm_loss`) on
    windows of a token dataset, validated on its validation windows at the
    end.

    Args:
        model: maps a `(B, T)` batch of token ids to `(B, T, vocab)` logits
            (e.g. `CharLM`).
        data: the corpus and its split (`TimeMachine` or `TokenDataset`).
        optimizer: an optax transformation (e.g. `optax.adamw(1e-3,
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
    if not is_token_data(data):
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
