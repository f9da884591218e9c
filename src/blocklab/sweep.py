r"""Sweeps: K runs of one structure as one compiled, vmapped, device-sharded program.

A sweep trains K *members* that share a model structure but differ in their
initialization key, their data-order key and their hyperparameters (the
learning rate, through `optax.inject_hyperparams`, which moves it from the
optimizer's closure into its state). The member states are stacked along a
leading axis of size K (`eqx.filter_vmap` over the model constructor), and one
training step, `blocklab.train.TrainStep`, is `jax.vmap`-ed over that axis:

$$S^{(k)}_{s+1} = \mathrm{step}\big(S^{(k)}_s,\ \mathrm{fold\_in}(\kappa_k, s)\big),
\qquad k = 1, \ldots, K,$$

with $\kappa_k$ the data key of member $k$, exactly as `train_lm` does for one
run, so member $k$ of a sweep follows the same trajectory as
`train_lm(model_k, ..., key=kappa_k)` (up to float rounding of the batched
matmuls).

**Sharding.** The K axis is laid out over a 1-D mesh of all visible devices
and padded to a multiple of the device count (`blocklab.sharding`, which also
says how `jax.distributed.initialize()` extends the mesh over many hosts).
Members never communicate, so XLA inserts no collectives.

**Divergence.** `TrainStep` skips any update whose loss or update is not
finite and clears the member's `finite` flag, after which that member is a
no-op (`jnp.where` on the flag, member by member): it is frozen at its last
finite state and reported as diverged at that step, while the other members
continue bit for bit as if it were not there. No error is raised.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import ArrayLike, Float, PRNGKeyArray
from tqdm.auto import tqdm

from .data import TimeMachine
from .sharding import (
    AXIS,
    MemberKeys,
    _global,
    _host,
    _key_data,
    _pad,
    _sharding_of,
    _wrap,
    member_mesh,
    pad_members,
    sharded_map,
)
from .train import TrainResult, TrainState, init_state, make_train_step, step_keys
from .train import validation_loss as _validation_loss

__all__ = [
    "AXIS",
    "SweepResult",
    "member_mesh",
    "pad_members",
    "sharded_map",
    "sweep_optimizer",
    "train_sweep",
]


@functools.cache
def _chapter_optimizer() -> optax.GradientTransformationExtraArgs:
    # One object, so that repeated sweeps hit the compilation cache (the
    # optimizer is a static part of the compiled step).
    return sweep_optimizer(optax.adamw, weight_decay=0.0)


def sweep_optimizer(
    optimizer: Callable[..., optax.GradientTransformation] = optax.adamw, **kwargs: Any
) -> optax.GradientTransformationExtraArgs:
    """`optax.inject_hyperparams(optimizer)(learning_rate=1.0, **kwargs)`.

    The learning rate lives in the optimizer state (`opt_state.hyperparams`),
    so members of one sweep can hold different rates under one compiled step;
    `train_sweep` writes each member's rate there. The chapter's optimizer is
    `sweep_optimizer(optax.adamw, weight_decay=0.0)`.
    """
    return optax.inject_hyperparams(optimizer, hyperparam_dtype=jnp.float32)(
        learning_rate=1.0, **kwargs
    )


class SweepResult(NamedTuple):
    """What `train_sweep` returns (padding already dropped; K members).

    Attributes:
        losses: `(K, num_steps)` float32 training losses; NaN from the step at
            which a member diverged on.
        diverged_at: `(K,)` int: the 1-based step whose loss or update was
            first non-finite (the member is frozen at the state before it),
            or 0 for a member that never diverged.
        val_loss: `(K,)` validation loss of each final model (NaN without
            validation windows or with `validate=False`).
        probe_steps: `(R,)` the steps at which `probe` was evaluated (0 is
            the initialization).
        probes: `probe`'s pytree with leading axes `(K, R)` (`None` without a
            probe).
        learning_rates: `(K,)` the members' learning rates.
        state: the final `TrainState` of the members, stacked (leading axis K).
    """

    losses: np.ndarray
    diverged_at: np.ndarray
    val_loss: np.ndarray
    probe_steps: np.ndarray
    probes: Any
    learning_rates: np.ndarray
    state: TrainState

    @property
    def num_members(self) -> int:
        return self.losses.shape[0]

    def model(self, k: int) -> Any:
        """Member `k`'s final model (its last finite one) as an ordinary module."""
        return jax.tree_util.tree_map(
            lambda a: a[k] if eqx.is_array(a) else a, self.state.model
        )

    def runs(self) -> list[TrainResult]:
        """One `TrainResult` per member, as `train_lm` would have returned it.

        A diverged member's losses stop before its divergence and `stopped`
        says at which step, as for `train_lm`.
        """
        out = []
        for k in range(self.num_members):
            state = jax.tree_util.tree_map(
                lambda a, k=k: a[k] if eqx.is_array(a) else a, self.state
            )
            d = int(self.diverged_at[k])
            losses = self.losses[k] if d == 0 else self.losses[k, : d - 1]
            stopped = (
                None
                if d == 0
                else f"non-finite training loss or update at step {d}; "
                f"kept the model after step {d - 1}."
            )
            out.append(
                TrainResult(
                    state.model, losses, float(self.val_loss[k]), state, stopped
                )
            )
        return out


def train_sweep(
    make_model: Callable[[PRNGKeyArray], Any],
    data: TimeMachine,
    num_steps: int,
    *,
    model_keys: MemberKeys,
    data_keys: MemberKeys,
    learning_rates: float | Sequence[float] | Float[ArrayLike, " K"],
    optimizer: optax.GradientTransformationExtraArgs | None = None,
    batch_size: int = 64,
    steps_per_call: int = 25,
    probe: Callable[[Any], Any] | None = None,
    validate: bool = True,
    mesh: Mesh | None = None,
    progress: bool = True,
) -> SweepResult:
    """Train K members as one compiled program, vmapped over K and sharded over devices.

    Member k is `make_model(model_keys[k])`, trained with learning rate
    `learning_rates[k]` on the batches of `data_keys[k]` (step s draws its
    batch from `fold_in(data_keys[k], s)`, as `train_lm(..., key=data_keys[k])`).
    The work runs as compiled chunks of `steps_per_call` fused steps
    (`TrainStep.scan` vmapped over the members); the host reads each chunk's
    losses back for the tqdm bar and evaluates `probe` between chunks.

    Args:
        make_model: `make_model(key)` builds one model (e.g. a `CharLM`); it is
            `eqx.filter_vmap`-ed over the model keys, so every member has one
            structure.
        data: the corpus (`TimeMachine`), shared by all members.
        num_steps: optimizer steps per member.
        model_keys, data_keys: `(K,)` PRNG keys, or sequences of K int seeds.
        learning_rates: one rate for all, or K rates.
        optimizer: an `optax.inject_hyperparams` transformation with a
            `learning_rate` hyperparameter (`sweep_optimizer(...)`); default
            `sweep_optimizer(optax.adamw, weight_decay=0.0)` (the chapter's).
        batch_size: sequences per step and member.
        steps_per_call: steps fused per compiled call (also the probe period).
        probe: `probe(model) -> pytree of arrays`, evaluated on every member at
            step 0 and after every chunk (e.g. the largest attention logit on
            a fixed batch).
        validate: compute each final model's validation loss.
        mesh: a 1-D mesh with axis `"members"` (default: all devices).
        progress: show a tqdm bar over the chunks.

    Returns:
        A `SweepResult` over the K members (padding dropped).
    """
    for name, value in (("num_steps", num_steps), ("steps_per_call", steps_per_call)):
        if not isinstance(value, int) or value < (0 if name == "num_steps" else 1):
            raise ValueError(
                f"train_sweep: {name} must be a positive int, got {value!r}."
            )
    model_data, data_data = _key_data(model_keys), _key_data(data_keys)
    K = model_data.shape[0]
    if data_data.shape[0] != K:
        raise ValueError(
            f"train_sweep: model_keys and data_keys must have the same length, got "
            f"{K} and {data_data.shape[0]}."
        )
    lrs = np.broadcast_to(np.asarray(learning_rates, np.float32), (K,)).copy()
    if lrs.ndim != 1 or not np.all(np.isfinite(lrs)):
        raise ValueError(
            f"train_sweep: learning_rates must be one finite rate or {K}, got "
            f"{learning_rates!r}."
        )
    optimizer = _chapter_optimizer() if optimizer is None else optimizer
    probe_opt = optimizer.init(
        eqx.filter(jax.eval_shape(make_model, jax.random.key(0)), eqx.is_inexact_array)
    )
    if not (
        hasattr(probe_opt, "hyperparams") and "learning_rate" in probe_opt.hyperparams
    ):
        raise ValueError(
            "train_sweep: optimizer must be built with optax.inject_hyperparams and "
            "have a learning_rate hyperparameter; use sweep_optimizer(...)."
        )
    mesh = member_mesh() if mesh is None else mesh
    sharding = _sharding_of(mesh)
    size = pad_members(K, mesh.devices.size)
    step = make_train_step(optimizer, data, batch_size=batch_size)
    mk, dk, lr = (_global(_pad(a, size), mesh) for a in (model_data, data_data, lrs))

    states = _init_states(make_model, optimizer, sharding, mk, lr)

    def record(models):
        return jax.tree_util.tree_map(_host, _probe_members(probe, models, sharding))

    records = [] if probe is None else [record(states.model)]
    probe_steps = [0]
    losses = np.full((size, num_steps), np.nan, np.float32)
    done = 0
    with tqdm(
        total=num_steps, desc=f"sweep K={K}", unit="step", disable=not progress
    ) as bar:
        while done < num_steps:
            n = min(steps_per_call, num_steps - done)
            fixed = (step, dk, jnp.asarray(done, jnp.int32))
            states, chunk = _run_chunk(fixed, states, n, sharding)
            losses[:, done : done + n] = _host(chunk)
            done += n
            if probe is not None:
                records.append(record(states.model))
                probe_steps.append(done)
            bar.update(n)
            last = losses[:K, done - 1]
            alive = np.isfinite(last)
            best = np.min(last[alive]) if alive.any() else math.nan
            bar.set_postfix(alive=f"{alive.sum()}/{K}", best=f"{best:.3f}")
    bad = ~np.isfinite(losses[:K])
    diverged = np.where(bad.any(1), np.argmax(bad, 1) + 1, 0)
    if validate and data.num_val:
        val = _host(_val_members(states.model, data, sharding))[:K]
    else:
        val = np.full(K, np.nan, np.float32)
    probes = None
    if probe is not None:
        probes = jax.tree_util.tree_map(lambda *r: np.stack(r, 1)[:K], *records)
    final = jax.tree_util.tree_map(lambda a: a[:K] if eqx.is_array(a) else a, states)
    return SweepResult(
        losses[:K],
        diverged,
        np.asarray(val),
        np.asarray(probe_steps),
        probes,
        lrs,
        final,
    )


@eqx.filter_jit
def _init_states(make_model, optimizer, sharding, model_keys, lrs):
    def one(k, lr):
        state = init_state(make_model(_wrap(k)), optimizer)
        hyper = state.opt_state.hyperparams
        hyper = dict(hyper, learning_rate=lr.astype(hyper["learning_rate"].dtype))
        opt_state = state.opt_state._replace(hyperparams=hyper)
        return eqx.tree_at(lambda s: s.opt_state, state, opt_state)

    return eqx.filter_shard(eqx.filter_vmap(one)(model_keys, lrs), sharding)


# The states are donated (updated in place); the step, the data keys and the
# start step travel in the first, undonated argument.
@eqx.filter_jit(donate="all-except-first")
def _run_chunk(fixed, states, n, sharding):
    step, data_keys, start = fixed
    keys = jax.vmap(lambda k: step_keys(_wrap(k), start, n))(data_keys)
    states, losses = jax.vmap(step.scan)(states, keys)
    return eqx.filter_shard((states, losses), sharding)


@eqx.filter_jit
def _probe_members(probe, models, sharding):
    return eqx.filter_shard(eqx.filter_vmap(probe)(models), sharding)


@eqx.filter_jit
def _val_members(models, data, sharding):
    losses = eqx.filter_vmap(lambda m: _validation_loss(m, data))(models)
    return eqx.filter_shard(losses, sharding)
