r"""Sweeps: K runs of one structure as one compiled, vmapped, device-sharded program.

A sweep trains K *members* that share a model structure but differ in their
initialization key, their data-order key and their hyperparameters: any
hyperparameter of an `optax.inject_hyperparams` optimizer (the learning rate,
weight decay, Adam's b1/b2, the parameters of a schedule written with them),
which `inject_hyperparams` moves from the optimizer's closure into its state.
The member states are stacked along a leading axis of size K
(`eqx.filter_vmap` over the model constructor), and one training step,
`blocklab.training.step.TrainStep` (any model, loss and batch source), is
`jax.vmap`-ed over that axis:

$$S^{(k)}_{s+1} = \mathrm{step}\big(S^{(k)}_s,\ \mathrm{fold\_in}(\kappa_k, s)\big),
\qquad k = 1, \ldots, K,$$

with $\kappa_k$ the data key of member $k$, exactly as `train_lm` does for one
run, so member $k$ of a sweep follows the same trajectory as
`train_lm(model_k, ..., key=kappa_k)` (up to float rounding of the batched
matmuls). Model keys and data keys are independent axes: `sweep_grid` builds
the Cartesian product of hyperparameter values and seeds, and
`SweepResult.select(learning_rate=..., ...)` looks members up by value.

The chunks, the progress bar, the aux, the divergence bookkeeping and the
validation are those of `train_model`: both run
`blocklab.training.loop.run_chunks`, and differ only in the compiled chunk.

**From one model.** `train_sweep(model, ...)` with a model (an Equinox
module) instead of `make_model(key)` starts every member from that model (a
loaded checkpoint swept over learning rates and data orders); the members
then differ only in their hyperparameters and data keys.

**Adapter sweeps.** `train_sweep(base, ..., sweep=SweepConfig(adapters=[
LoRAConfig(rank=r, alpha=16.0, targets=("q", "v")) for r in ranks]))` trains
K low-rank adapters (`blocklab.lora`) on one frozen base model. Member $k$ is
`lora(base, adapters[k], key=model_keys[k])`, held at the largest rank
$R = \max_k r_k$ by masking (`blocklab.nn.lora.mask_lora`: its rank axis is zero-padded
and masked, so it follows the rank-$r_k$ adapter's trajectory), and its
state holds only its adapters and their optimizer state. The base is held
once: it is an argument of the compiled step that every member reads
(broadcast by the vmap, not stacked), so K adapters cost the base plus K
adapters' states, not K bases (`SweepConfig(memory_analysis=True)` reports the compiled
chunk's bytes).

**Sharding.** The K axis is laid out over a 1-D mesh of all visible devices
and padded to a multiple of the device count (`blocklab.training.member_axis`). Members
never communicate, so XLA inserts no collectives in the step. On a mesh with
more axes than `members` (e.g. `members=2,data=4`), each member is also
split over the other axes by `rules` (`blocklab.training.placement`, default
`"fsdp"`): K sharded models as one program.

**Many processes.** After `blocklab.training.distributed.initialize()`, the mesh spans
every device of every process; every process runs the same `train_sweep`
call, holds only its own members, and gets back the same `SweepResult` (the
per-member results and final states are gathered with
`jax.experimental.multihost_utils.process_allgather`).

**Divergence.** `TrainStep` skips any update whose loss or update is not
finite and clears the member's `finite` flag, after which that member is a
no-op (`jnp.where` on the flag, member by member): it is frozen at its last
finite state and reported as diverged at that step, while the other members
continue bit for bit as if it were not there. No error is raised.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray

from .._validate import ConfigError, check_int
from ..nn.lora import (
    LoRAConfig,
    MaskedLoRALinear,
    _lora,
    lora_filter,
    mask_lora,
    unmask_lora,
)
from ..nn.remat import with_remat
from .hyperparams import check_values, climbs
from .loop import run_chunks
from .member_axis import (
    AXIS,
    MemberKeys,
    check_seeds,
    global_rows,
    is_seeds,
    key_data,
    member_mesh,
    member_sharding,
    pad_members,
    pad_rows,
    sharded_map,
    to_host,
    wrap_key,
)
from .mesh_training import shard_step, state_shardings
from .placement import auto_mesh, on_mesh
from .run import TrainResult
from .run_config import RunConfig, SweepConfig, _run_with
from .sources import HostSource
from .step import (
    TrainState,
    TrainStep,
    _to_compute,
    init_state,
    make_train_step,
    step_keys,
    validation_loss,
)

__all__ = [
    "AXIS",
    "SweepResult",
    "check_seeds",
    "member_mesh",
    "pad_members",
    "sharded_map",
    "sweep_grid",
    "sweep_optimizer",
    "train_sweep",
]


@functools.cache
def _default_optimizer() -> optax.GradientTransformationExtraArgs:
    # One object, so that repeated sweeps hit the compilation cache (the
    # optimizer is a static part of the compiled step).
    return sweep_optimizer(optax.adamw, weight_decay=0.0)


def sweep_optimizer(
    optimizer: Callable[..., optax.GradientTransformation] = optax.adamw, **kwargs: Any
) -> optax.GradientTransformationExtraArgs:
    """`optax.inject_hyperparams(optimizer)(learning_rate=1.0, **kwargs)`.

    Every numeric argument (the learning rate and each of `kwargs`, e.g.
    `weight_decay=0.0, b2=0.95`) lives in the optimizer state
    (`opt_state.hyperparams`) as a float32 array, so members of one sweep can
    hold different values under one compiled step; `train_sweep` writes each
    member's values there. AdamW without weight decay is
    `sweep_optimizer(optax.adamw, weight_decay=0.0)`.

    To sweep a schedule's parameters, give `inject_hyperparams` a function of
    them that builds the schedule, e.g. a linear warm-up over `warmup` steps:
    `optax.inject_hyperparams(lambda peak, warmup: optax.adamw(lambda t: peak
    * jnp.minimum(1.0, (t + 1) / warmup)))(peak=1.0, warmup=1.0)`.
    """
    return optax.inject_hyperparams(optimizer, hyperparam_dtype=jnp.float32)(
        learning_rate=1.0, **kwargs
    )


def sweep_grid(**axes: Iterable[Any]) -> dict[str, np.ndarray]:
    """The Cartesian product of named axes, flattened into K = prod(lengths) members.

    `sweep_grid(learning_rate=[1e-3, 1e-2], weight_decay=[0.0, 0.1], seed=[0, 1])`
    returns `{"learning_rate": (8,), "weight_decay": (8,), "seed": (8,)}`
    arrays, the last axis varying fastest (`itertools.product` order). Pass
    the hyperparameter columns as `SweepConfig(hyperparams=...)` and a seed
    column as `model_keys=` / `data_keys=` (the same column for both ties
    them; two seed axes sweep them independently).

    Raises:
        ConfigError: no axes, or an axis that is not a non-empty sequence of
            numbers.
    """
    if not axes:
        raise ConfigError("sweep_grid: give at least one axis, e.g. seed=[0, 1].")
    values = {}
    for name, axis in axes.items():
        if isinstance(axis, (str, bytes)) or not isinstance(axis, Iterable):
            raise ConfigError(
                f"sweep_grid: axis {name} must be a sequence of values, got {axis!r}."
            )
        axis = list(axis)
        if not axis:
            raise ConfigError(f"sweep_grid: axis {name} is empty.")
        bad = [
            v for v in axis if isinstance(v, bool) or not isinstance(v, numbers.Real)
        ]
        if bad:
            raise ConfigError(
                f"sweep_grid: axis {name} must hold numbers, got {bad[0]!r}."
            )
        values[name] = axis
    rows = list(itertools.product(*values.values()))
    return {name: np.asarray([r[i] for r in rows]) for i, name in enumerate(values)}


@dataclass(frozen=True)
class SweepResult:
    """What `train_sweep` returns (padding already dropped; K members).

    Attributes:
        losses: `(K, num_steps)` float32 training losses; NaN from the step at
            which a member diverged on.
        diverged_at: `(K,)` int: the 1-based step whose loss or update was
            first non-finite (the member is frozen at the state before it),
            or 0 for a member that never diverged.
        val_loss: `(K,)` validation loss of each final model (NaN without
            validation windows, with `validate=False`, or for a general source
            or loss).
        probe_steps: `(R,)` the steps at which `probe` was evaluated (0 is
            the initialization).
        probes: `probe`'s pytree with leading axes `(K, R)` (`None` without a
            probe).
        learning_rates: `(K,)` the members' learning rates (NaN when the
            learning rate is not swept).
        state: the final `TrainState` of the members, stacked (leading axis K).
        hyperparams: `{name: (K,) float32}`, every swept hyperparameter.
        model_seeds, data_seeds: `(K,)` int seeds, or `None` where keys were
            given.
        aux: the loss's aux stacked as `(K, num_steps, ...)`, or `None`.
        ranks: `(K,)` int, each member's adapter rank in an adapter sweep
            (`None` otherwise); `select(rank=...)` looks members up by it.
        base: an adapter sweep's shared base: the adapted model at the largest
            rank with its adapters' leaves `None` (held once; `state.model`
            holds the members' adapters only). `None` otherwise.
        memory: with `SweepConfig(memory_analysis=True)`, the compiled
            chunk's `memory_analysis()` in bytes: `argument`, `output`,
            `temp`, `alias` and `total` (= argument + output + temp - alias).
    """

    losses: np.ndarray
    diverged_at: np.ndarray
    val_loss: np.ndarray
    probe_steps: np.ndarray
    probes: Any
    learning_rates: np.ndarray
    state: TrainState
    hyperparams: Mapping[str, np.ndarray] | None = None
    model_seeds: np.ndarray | None = None
    data_seeds: np.ndarray | None = None
    aux: Any = None
    ranks: np.ndarray | None = None
    base: Any = None
    memory: Mapping[str, int] | None = None

    @property
    def num_members(self) -> int:
        return self.losses.shape[0]

    def model(self, k: int) -> Any:
        """Member `k`'s final model (its last finite one) as an ordinary module.

        In an adapter sweep: the base with member `k`'s adapters as
        `LoRALinear`s of its own rank (`unmask_lora`), ready for
        `merge_lora` or `save_adapter`.
        """
        member = jax.tree_util.tree_map(
            lambda a: a[k] if eqx.is_array(a) else a, self.state.model
        )
        if self.base is None:
            return member
        return unmask_lora(eqx.combine(member, self.base))

    def _columns(self) -> dict[str, np.ndarray]:
        cols = dict(self.hyperparams or {})
        if self.model_seeds is not None:
            cols["model_seed"] = self.model_seeds
        if self.data_seeds is not None:
            cols["data_seed"] = self.data_seeds
        if self.ranks is not None:
            cols["rank"] = self.ranks
        return cols

    def index(self, **values: Any) -> np.ndarray:
        """Indices of the members whose hyperparameters (and seeds) equal `values`.

        Hyperparameters are float32, so a value matches within a relative
        1e-6 (`index(learning_rate=1e-3)` finds the rate stored as
        `float32(1e-3)`); `model_seed=` / `data_seed=` match exactly.

        Raises:
            ConfigError: a name that is not a swept hyperparameter or seed, or
                no member matching.
        """
        cols = self._columns()
        mask = np.ones(self.num_members, bool)
        for name, value in values.items():
            if name not in cols:
                raise ConfigError(
                    f"SweepResult: no swept hyperparameter or seed named {name!r}; "
                    f"have {sorted(cols)}."
                )
            col = np.asarray(cols[name])
            if np.issubdtype(col.dtype, np.integer):
                mask &= col == value
            else:
                mask &= np.isclose(col, np.float32(value), rtol=1e-6, atol=0.0)
        if not mask.any():
            raise ConfigError(
                f"SweepResult: no member has {values}; the values are "
                + "; ".join(f"{n}: {np.unique(cols[n]).tolist()}" for n in values)
                + "."
            )
        return np.flatnonzero(mask)

    def select(self, **values: Any) -> SweepResult:
        """The sub-sweep of the members matching `values` (see `index`).

        `result.select(learning_rate=1e-3, weight_decay=0.1)` keeps every
        seed run at those values; `.losses`, `.state`, ... are indexed alike.
        """
        idx = self.index(**values)

        def take(tree):
            if tree is None:
                return None
            return jax.tree_util.tree_map(
                lambda a: a[idx] if eqx.is_array(a) or isinstance(a, np.ndarray) else a,
                tree,
            )

        return SweepResult(
            self.losses[idx],
            self.diverged_at[idx],
            self.val_loss[idx],
            self.probe_steps,
            take(self.probes),
            self.learning_rates[idx],
            take(self.state),
            None if self.hyperparams is None else take(dict(self.hyperparams)),
            take(self.model_seeds),
            take(self.data_seeds),
            take(self.aux),
            take(self.ranks),
            self.base,
            self.memory,
        )

    def runs(self) -> list[TrainResult]:
        """One `TrainResult` per member, as `train_lm` would have returned it.

        In an adapter sweep its `model` is `self.model(k)` (base and
        adapters) and its `state` holds the member's adapters.

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
            aux = None
            if self.aux is not None:
                n = len(losses)
                aux = jax.tree_util.tree_map(lambda a, k=k, n=n: a[k, :n], self.aux)
            out.append(
                TrainResult(
                    self.model(k),
                    losses,
                    float(self.val_loss[k]),
                    state,
                    stopped,
                    aux,
                )  # fmt: skip
            )
        return out


def _seeds_of(owner: str, name: str, keys: Any) -> np.ndarray | None:
    """The int seeds of `keys` if it is a sequence (or 1-D array) of seeds."""
    if not is_seeds(keys):
        return None
    return np.asarray(
        check_seeds(keys, name=name, distinct=False, _owner=owner), np.int64
    )


def _member_values(
    owner: str, hyperparams: Mapping[str, Any], K: int
) -> dict[str, np.ndarray]:
    """Each hyperparameter as `(K,)` float32: one value for all, or K values."""
    out = {}
    for name, value in hyperparams.items():
        arr = np.asarray(value)
        if arr.dtype == bool or not (
            np.issubdtype(arr.dtype, np.floating)
            or np.issubdtype(arr.dtype, np.integer)
        ):
            raise ConfigError(
                f"{owner}: hyperparameter {name} must be numbers, got {value!r}."
            )
        if arr.ndim == 0:
            arr = np.broadcast_to(arr, (K,))
        if arr.shape != (K,):
            raise ConfigError(
                f"{owner}: hyperparameter {name} has {arr.size} values (shape "
                f"{arr.shape}) but there are K={K} members (the length of "
                f"model_keys); give one value or {K}."
            )
        arr = arr.astype(np.float64)
        if not np.all(np.isfinite(arr)):
            raise ConfigError(
                f"{owner}: hyperparameter {name} must be finite, got {arr.tolist()}."
            )
        check_values({name: arr}, _owner=owner)
        out[name] = arr.astype(np.float32)
    return out


def train_sweep(
    model: Callable[[PRNGKeyArray], Any] | eqx.Module,
    data: Any,
    num_steps: int,
    *,
    model_keys: MemberKeys | None = None,
    data_keys: MemberKeys,
    loss_fn: Any = None,
    run: RunConfig = RunConfig(),  # noqa: B008 - frozen, never mutated
    sweep: SweepConfig = SweepConfig(),  # noqa: B008 - frozen, never mutated
) -> SweepResult:
    """Train K members as one compiled program, vmapped over K and sharded over devices.

    Member k is `make_model(model_keys[k])` (or the model given, or the
    base with adapters: see `model` and `adapters`), trained with hyperparameters
    `{name: values[k]}` on the batches of `data_keys[k]` (step s draws its
    batch from `fold_in(data_keys[k], s)`, as `train_lm(..., key=data_keys[k])`).
    The work runs as compiled chunks of `steps_per_call` fused steps
    (`TrainStep.scan` vmapped over the members); the host reads each chunk's
    losses back for the tqdm bar and evaluates `probe` between chunks. The
    source and the loss are checked once by tracing before anything runs.

    Args:
        model: `make_model(key)`, which builds one model: it is
            `eqx.filter_vmap`-ed over `model_keys`, so every member has one
            structure. Or a model itself (an Equinox module other than
            `eqx.Partial`, or any pytree that is not callable), e.g. a loaded
            checkpoint: every member starts from it, K is the length of
            `data_keys` and `model_keys` is not taken. With `adapters`, the
            frozen base the adapters are added to.
        data: a token dataset (`TimeMachine`, `TokenDataset`) or any batch
            source (`source(key)` / `source.batch(key)`), shared by all members;
            or an iterable of batches drawn on the host (a
            `blocklab.data.TokenPipeline`, a list, a loader): every member
            then trains step $s$ on the $s$-th batch (its data key only
            drives dropout). A host callable `fn(key)` is refused.
        num_steps: optimizer steps per member (>= 1).
        model_keys, data_keys: `(K,)` PRNG keys, or K int seeds (non-negative,
            repeats allowed: members may share a seed and differ in
            hyperparameters). `model_keys` go to `make_model`, or draw each
            member's adapter $A$ (`lora(..., key=model_keys[k])`).
        loss_fn: `loss_fn(model, batch, key)`; default the next-token loss.
        run: the options every member's run shares, a `blocklab.RunConfig`
            (as for `train_model`): `batch_size` (sequences per step and
            member for a token dataset, default 64), `precision`,
            `steps_per_call` (also the probe period), `microbatches`,
            `remat`, `mesh` (a mesh with axis `"members"`; default: all
            devices of all processes), `rules` (with a mesh that has axes
            besides `"members"`, e.g. `members=2,data=4`, how each member
            is split over them: a preset of `blocklab.training.placement`,
            default `"fsdp"`, or a mapping), `progress`.
        sweep: what only a sweep has, a `blocklab.SweepConfig`:
            `learning_rates` (one rate or K rates > 0; shorthand for
            `hyperparams={"learning_rate": ...}`), `hyperparams` (`{name:
            one value or K values}` for any hyperparameter of the
            optimizer), `optimizer` (an `optax.inject_hyperparams`
            transformation; default `sweep_optimizer(optax.adamw,
            weight_decay=0.0)`, which needs a learning rate), `probe`
            (`probe(model) -> pytree of arrays` on every member at step 0
            and after every chunk, vmapped: `SweepResult.probes` stacks it
            `(K, R, ...)`; e.g. `probe=lambda m:
            blocklab.diagnostics.model_diagnostics(m, ids)`), `validate`
            (each final model's validation loss, token datasets with the
            next-token loss), `adapters` and `memory_analysis` (below).

    Adapters: `SweepConfig(adapters=LoRAConfig(...))` (one config for all
    members) or K `LoRAConfig`s that differ in `rank` only make an adapter
    sweep on the base `model`: member $k$ trains `lora(model, adapters[k],
    key=model_keys[k])` only: the optimizer sees its adapters alone (no
    `lora_optimizer` needed) and the base is held once for all members.
    Ranks are masked up to the largest (`mask_lora`); `SweepResult.ranks`
    records each member's rank and `result.model(k)` is its adapter at that
    rank. On a 1-D `members` mesh only (the base is replicated on each
    device).

    Memory: `SweepConfig(memory_analysis=True)` compiles the first chunk
    ahead of time once more and puts its `memory_analysis()` in
    `SweepResult.memory` (bytes of arguments, outputs and temporaries). Not
    with a host source.

    Why two configs: `RunConfig` is what a sweep shares with `train_model`
    (one run's options, reused as they are: a sweep of the run you tuned),
    `SweepConfig` what differs between members and what the sweep reports;
    the members themselves, `model_keys` and `data_keys`, stay arguments,
    because every sweep names them.

    Returns:
        A `SweepResult` over the K members (padding dropped), the same on
        every process.

    Raises:
        ConfigError: bad sizes, keys of different lengths, a hyperparameter
            the optimizer does not have or with the wrong number of values, a
            learning rate that is not positive, a non-scalar loss, or a batch
            the loss cannot take; `model_keys` missing with `make_model` or
            `adapters`, or given with a model alone; `adapters` with
            `make_model`, unknown or bad adapter settings, or a mesh with
            axes besides `"members"`.
    """
    owner = "train_sweep"
    run = _run_with(owner, run, {})
    if not isinstance(sweep, SweepConfig):
        raise ConfigError(
            f"{owner}: sweep must be a blocklab.SweepConfig (e.g. SweepConfig("
            f"learning_rates=[1e-3, 1e-2])), got {sweep!r} of type "
            f"{type(sweep).__name__}."
        )
    precision, batch_size, microbatches = (
        run.precision, run.batch_size, run.microbatches
    )  # fmt: skip
    steps_per_call, mesh, rules, progress = (
        run.steps_per_call, run.mesh, run.rules, run.progress
    )  # fmt: skip
    learning_rates, hyperparams, optimizer = (
        sweep.learning_rates, sweep.hyperparams, sweep.optimizer
    )  # fmt: skip
    probe, validate, adapters, memory_analysis = (
        sweep.probe, sweep.validate, sweep.adapters, sweep.memory_analysis
    )  # fmt: skip
    num_steps = check_int(owner, "num_steps", num_steps, min=1)
    given = _is_model(model)
    if run.remat is not None:
        model = with_remat(model, run.remat) if given else _Remat(model, run.remat)
    if adapters is not None and not given:
        raise ConfigError(
            f"{owner}: adapters= trains adapters on one shared base: pass the "
            "base model itself, not make_model(key)."
        )
    if model_keys is None and (not given or adapters is not None):
        raise ConfigError(
            f"{owner}: model_keys is required "
            + (
                "with adapters= (they draw each member's adapter A)."
                if given
                else "with make_model(key) (one key per member)."
            )
        )
    if given and adapters is None and model_keys is not None:
        raise ConfigError(
            f"{owner}: model_keys were given with a model: every member starts "
            "from that model, so there is nothing for them to draw. Pass "
            "make_model(key) to draw each member's model, or leave model_keys out."
        )
    data_seeds = _seeds_of(owner, "data_keys", data_keys)
    data_data = key_data(data_keys, "data_keys", _owner=owner)
    if model_keys is None:
        model_seeds = None
        model_data = data_data  # unused: every member starts from `model`
        if data_data.shape[0] == 0:
            raise ConfigError(f"{owner}: data_keys must hold at least one key.")
    else:
        model_seeds = _seeds_of(owner, "model_keys", model_keys)
        model_data = key_data(model_keys, "model_keys", _owner=owner)
    K = model_data.shape[0]
    if K == 0:
        raise ConfigError(f"{owner}: model_keys must hold at least one key.")
    if data_data.shape[0] != K:
        raise ConfigError(
            f"{owner}: model_keys and data_keys must have the same length, got "
            f"{K} and {data_data.shape[0]}."
        )
    spec = None if adapters is None else _adapter_spec(owner, adapters, K)
    hp = dict(hyperparams or {})
    if learning_rates is not None:
        if "learning_rate" in hp:
            raise ConfigError(
                f"{owner}: give the learning rate once: learning_rates= or "
                "hyperparams['learning_rate'], not both."
            )
        hp["learning_rate"] = learning_rates
    if optimizer is None and "learning_rate" not in hp:
        raise ConfigError(
            f"{owner}: learning_rates is required with the default optimizer "
            "(sweep_optimizer(optax.adamw, weight_decay=0.0))."
        )
    tx = _default_optimizer() if optimizer is None else optimizer
    values = _member_values(owner, hp, K)
    step = make_train_step(
        tx, data, loss_fn=loss_fn, batch_size=batch_size, precision=precision,
        microbatches=microbatches,
    )  # fmt: skip
    has_validation = step.has_validation
    host = step.source if isinstance(step.source, HostSource) else None
    if host is not None and host._fn is not None:
        raise ConfigError(
            f"{owner}: data is a host callable fn(key); the members have K data "
            "keys, so it has no one key to get. Give an iterable of batches (e.g. "
            "a blocklab.data.TokenPipeline): every member trains step s on its "
            "s-th batch."
        )
    if memory_analysis and host is not None:
        raise ConfigError(
            f"{owner}: memory_analysis=True needs a source drawn on the device "
            "(the host source's batches are not known before the run)."
        )
    base = None
    if spec is not None:
        members, base = _adapter_members(owner, model, spec, model_data)
        one = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), members
        )
        shape_state = eqx.filter_eval_shape(init_state, one, tx)
        # The loss reads each member's adapters on the one base (an argument
        # of the step, broadcast by the vmap).
        step = TrainStep(
            step.source, _OnBase(base, step.loss_fn, precision), tx, precision
        )
        make_model = None
    elif given:
        make_model = _Given(model)
        shape_state = eqx.filter_eval_shape(init_state, model, tx)
    else:
        make_model = model
        shape_state = eqx.filter_eval_shape(
            lambda k: init_state(make_model(k), tx), jax.random.key(0)
        )
    injected = getattr(shape_state.opt_state, "hyperparams", None)
    if values and not isinstance(injected, dict):
        raise ConfigError(
            f"{owner}: the optimizer has no injected hyperparameters, so "
            f"{sorted(values)} cannot differ between members; build it with "
            "optax.inject_hyperparams (e.g. sweep_optimizer(optax.adamw))."
        )
    missing = sorted(set(values) - set(injected or {}))
    if missing:
        raise ConfigError(
            f"{owner}: the optimizer has no hyperparameter {missing[0]!r}; it has "
            f"{sorted(injected)} (inject_hyperparams injects the numeric arguments "
            "of the optimizer's function)."
        )
    has_aux = step.check(shape_state, _owner=owner)
    user_mesh = member_mesh() if mesh is None else mesh
    # The sweep is a program written for propagation: on a mesh with Explicit
    # axes it computes on the mesh's Auto view (placement.auto_mesh), and the
    # final states go back onto the mesh given (no copy).
    mesh = auto_mesh(user_mesh)
    sharding = member_sharding(mesh)
    if spec is not None and (set(mesh.axis_names) != {AXIS} or rules is not None):
        raise ConfigError(
            f"{owner}: adapter sweeps run on a 1-D {AXIS!r} mesh (the base is "
            f"replicated on each device), got mesh {dict(mesh.shape)} and "
            f"rules={rules!r}."
        )
    state_shard = _state_sharding(owner, mesh, rules, shape_state, tx, K)
    if state_shard is None:
        state_shard = sharding
    else:
        step = shard_step(step, mesh, rules or "fsdp")
    size = pad_members(K, mesh.shape[AXIS])
    mk, dk = (global_rows(pad_rows(a, size), mesh) for a in (model_data, data_data))
    hv = {n: global_rows(pad_rows(v, size), mesh) for n, v in values.items()}

    if base is None:
        states = _init_states(make_model, tx, state_shard, mk, hv)
    else:
        base = _replicated(base, mesh)
        step = eqx.tree_at(lambda s: s.loss_fn.base, step, base)
        stacked = jax.tree_util.tree_map(
            lambda a: global_rows(pad_rows(np.asarray(a), size), mesh), members
        )
        states = _init_member_states(tx, state_shard, stacked, hv)
    _check_members_descend(owner, tx, states, injected, K)
    memory = None
    chunk = _run_chunk  # the compiled chunk (ahead of time with memory_analysis)
    if memory_analysis:
        n = min(steps_per_call, num_steps)
        fixed = (step, dk, jnp.asarray(0, jnp.int32))
        with jax.set_mesh(mesh):
            compiled = _run_chunk.lower(
                fixed, states, n, (state_shard, sharding)
            ).compile()
        # equinox's Compiled wraps jax's (`.compiled`).
        memory = _memory_of(getattr(compiled, "compiled", compiled).memory_analysis())

        def chunk(fixed, states, m, shardings, n=n, compiled=compiled):
            # the program analysed runs the chunks of its length (no second
            # compile); a shorter last chunk compiles its own
            if m == n:
                return compiled(fixed, states, m, shardings)
            return _run_chunk(fixed, states, m, shardings)

    def on_base(fn):
        return fn if base is None else _OnBase(base, fn)

    def record(models):
        probed = _probe_members(on_base(probe), models, sharding)
        return jax.tree_util.tree_map(lambda a: to_host(a)[:K], probed)

    records = [] if probe is None else [record(states.model)]
    probe_steps = [0]

    def advance(states, done, n):
        fixed = (step, dk, jnp.asarray(done, jnp.int32))
        with jax.set_mesh(mesh):  # runtime checks raise on every device
            if host is None:
                states, out = chunk(fixed, states, n, (state_shard, sharding))
            else:
                batches = host.take(range(n), _owner=owner)
                if not batches:
                    return states, np.zeros((K, 0), np.float32), None
                stacked = jax.tree_util.tree_map(
                    lambda *b: np.stack([np.asarray(x) for x in b]), *batches
                )
                states, out = _run_host_chunk(
                    fixed, states, stacked, (state_shard, sharding)
                )
        loss, aux = out if has_aux else (out, None)
        aux = jax.tree_util.tree_map(lambda a: to_host(a)[:K], aux)
        return states, to_host(loss)[:K], aux

    def after_chunk(states, done):
        if probe is not None:
            records.append(record(states.model))
            probe_steps.append(done)

    def members_val(models):
        val = _val_members(on_base(validation_loss), models, step.data, sharding)
        return to_host(val)[:K]

    run = run_chunks(
        advance,
        states,
        num_steps,
        steps_per_call,
        has_aux=has_aux,
        members=(K,),
        after_chunk=after_chunk,
        validate=members_val if validate and has_validation else None,
        desc=f"sweep K={K}",
        progress=progress,
    )
    probes = None
    if probe is not None:
        probes = jax.tree_util.tree_map(lambda *r: np.stack(r, 1), *records)
    return SweepResult(
        run.losses,
        run.diverged_at,
        run.val_loss.astype(np.float32),
        np.asarray(probe_steps),
        probes,
        values.get("learning_rate", np.full(K, np.nan, np.float32)),
        on_mesh(_final_states(run.state, K), user_mesh),
        values,
        model_seeds,
        data_seeds,
        run.aux,
        None if spec is None else spec["rank"].copy(),
        None if base is None else on_mesh(base, user_mesh),
        memory,
    )


def _final_states(states: TrainState, K: int) -> TrainState:
    """The members' states without the padding; gathered onto every process."""
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(lambda a: a[:K] if eqx.is_array(a) else a, states)
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(to_host(a)[:K]) if eqx.is_array(a) else a, states
    )


def _state_sharding(owner, mesh, rules, shape_state, tx, K):
    """The members' state layout by `rules` when the mesh has axes besides
    `members` (each member split over them); `None` for a 1-D member mesh."""
    if AXIS not in mesh.axis_names:
        raise ConfigError(
            f"{owner}: the mesh must have an axis {AXIS!r} for the members, got "
            f"mesh {dict(mesh.shape)}."
        )
    others = [a for a in mesh.axis_names if a != AXIS]
    if not others:
        if rules is not None:
            raise ConfigError(
                f"{owner}: rules={rules!r} split each member over mesh axes "
                f"besides {AXIS!r}, but mesh {dict(mesh.shape)} has none."
            )
        return None
    size = pad_members(K, mesh.shape[AXIS])
    stacked = jax.tree_util.tree_map(
        lambda a: (
            jax.ShapeDtypeStruct((size, *a.shape), a.dtype)
            if isinstance(a, jax.ShapeDtypeStruct)
            else a
        ),
        shape_state,
    )
    return state_shardings(stacked, tx, mesh, rules or "fsdp", prefix=(AXIS,))


def _with_values(state: TrainState, vals: Mapping[str, Any]) -> TrainState:
    """`state` with the member's hyperparameter values in its optimizer state."""
    if not vals:
        return state
    hyper = dict(state.opt_state.hyperparams)
    for name, v in vals.items():
        hyper[name] = v.astype(jnp.asarray(hyper[name]).dtype)
    opt_state = state.opt_state._replace(hyperparams=hyper)
    return eqx.tree_at(lambda s: s.opt_state, state, opt_state)


@eqx.filter_jit
def _init_states(make_model, tx, sharding, model_keys, values):
    def one(k, vals):
        return _with_values(init_state(make_model(wrap_key(k)), tx), vals)

    return eqx.filter_shard(eqx.filter_vmap(one)(model_keys, values), sharding)


@eqx.filter_jit
def _init_member_states(tx, sharding, members, values):
    def one(m, vals):
        return _with_values(init_state(m, tx), vals)

    return eqx.filter_shard(eqx.filter_vmap(one)(members, values), sharding)


def _is_model(x: Any) -> bool:
    """A model (every member starts from it) rather than `make_model(key)`."""
    if isinstance(x, eqx.Partial):
        return False
    return isinstance(x, eqx.Module) or not callable(x)


class _Given(eqx.Module):
    """`make_model` of a sweep given a model: every key builds that model
    (its arrays are arguments of the compiled init, not constants)."""

    model: Any

    def __call__(self, key: Any) -> Any:
        del key
        return self.model


class _OnBase(eqx.Module):
    """`fn(member's adapters on the shared base, *args)`: the base is a
    field (an argument of the compiled step, broadcast by the vmap), cast to
    the compute dtype of `precision` as the step casts the member."""

    base: Any
    fn: Any
    precision: str = eqx.field(static=True, default="float32")

    def __call__(self, member: Any, *args: Any) -> Any:
        full = eqx.combine(member, _to_compute(self.base, self.precision))
        return self.fn(full, *args)


class _Remat(eqx.Module):
    """`make_model(key)` with the run's remat policy (`RunConfig.remat`)."""

    make_model: Any
    remat: Any = eqx.field(static=True)

    def __call__(self, key: Any) -> Any:
        return with_remat(self.make_model(key), self.remat)


def _adapter_spec(owner: str, adapters: Any, K: int) -> dict[str, Any]:
    """The members' adapters from `SweepConfig.adapters` (one `LoRAConfig` for
    all, or K that differ in rank only): `rank` as `(K,)` ints and the shared
    `config` (at the first member's rank)."""
    configs = (adapters,) * K if isinstance(adapters, LoRAConfig) else adapters
    if len(configs) != K:
        raise ConfigError(
            f"{owner}: adapters has {len(configs)} LoRAConfigs but there are "
            f"K={K} members; give one LoRAConfig or {K}."
        )
    first = configs[0]
    for k, c in enumerate(configs):
        for field in ("alpha", "targets", "use_rslora", "dropout"):
            if getattr(c, field) != getattr(first, field):
                raise ConfigError(
                    f"{owner}: the members' adapters may differ in rank only; "
                    f"adapters[{k}].{field}={getattr(c, field)!r} but "
                    f"adapters[0].{field}={getattr(first, field)!r}."
                )
    return {
        "rank": np.asarray([c.rank for c in configs], np.int64),
        "config": first,
    }


def _adapter_members(owner, base_model, spec, model_data):
    """`(members, base)`: each member's adapters, `lora(base_model,
    replace(config, rank=r_k), key=model_keys[k])` masked to the largest
    rank, stacked over K (host arrays); and the shared rest of the adapted
    model."""
    R = int(spec["rank"].max())
    rows = []
    for r, k in zip(spec["rank"].tolist(), model_data, strict=True):
        config = dataclasses.replace(spec["config"], rank=r)
        try:
            adapted = _lora(
                base_model, config, key=wrap_key(jnp.asarray(k)), owner="lora"
            )
        except ConfigError as err:
            raise ConfigError(f"{owner}: adapters: {err}") from err
        masked = mask_lora(adapted, R)
        rows.append(masked)
    trainable = lora_filter(rows[0])
    rank_leaf = jax.tree.map(_rank_marks, rows[0], is_leaf=_is_masked)
    keep = jax.tree.map(lambda a, b: a or b, trainable, rank_leaf)
    parts = [eqx.filter(m, keep) for m in rows]
    members = jax.tree_util.tree_map(
        lambda *a: np.stack([np.asarray(x) for x in a]), *parts
    )
    base = eqx.filter(rows[0], keep, inverse=True)
    return members, base


def _is_masked(x: Any) -> bool:
    return isinstance(x, MaskedLoRALinear)


def _rank_marks(node: Any) -> Any:
    """True on a `MaskedLoRALinear`'s `rank` leaf (it differs per member)."""
    if not _is_masked(node):
        return jax.tree.map(lambda _: False, node)
    marked = eqx.tree_at(lambda m: m.rank, node, True)
    return jax.tree.map(lambda x: x is True, marked)


def _replicated(tree: Any, mesh: Mesh) -> Any:
    """`tree`'s arrays replicated on every device of `mesh` (held once per
    device, read by every member)."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.tree_util.tree_map(
        lambda a: jax.device_put(a, sharding) if eqx.is_array(a) else a, tree
    )


def _memory_of(analysis: Any) -> dict[str, int] | None:
    """The bytes of a compiled program's `memory_analysis()`."""
    if analysis is None:
        return None
    out = {
        "argument": int(analysis.argument_size_in_bytes),
        "output": int(analysis.output_size_in_bytes),
        "temp": int(analysis.temp_size_in_bytes),
        "alias": int(analysis.alias_size_in_bytes),
    }
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


# The states are donated (updated in place); the step, the data keys and the
# start step travel in the first, undonated argument.
@eqx.filter_jit(donate="all-except-first")
def _run_chunk(fixed, states, n, sharding):
    step, data_keys, start = fixed
    keys = jax.vmap(lambda k: step_keys(wrap_key(k), start, n))(data_keys)
    states, losses = eqx.filter_vmap(step.scan)(states, keys)
    state_shard, member_shard = sharding
    return eqx.filter_shard(states, state_shard), eqx.filter_shard(losses, member_shard)


@eqx.filter_jit(donate="all-except-first")
def _run_host_chunk(fixed, states, batches, sharding):
    """`_run_chunk` on a host source's batches, the same for every member."""
    step, data_keys, start = fixed
    n = jax.tree_util.tree_leaves(batches)[0].shape[0]
    keys = jax.vmap(lambda k: step_keys(wrap_key(k), start, n))(data_keys)
    scan = eqx.filter_vmap(step.scan, in_axes=(0, 0, None))
    states, losses = scan(states, keys, batches)
    state_shard, member_shard = sharding
    return eqx.filter_shard(states, state_shard), eqx.filter_shard(losses, member_shard)


def _check_members_descend(owner, tx, states, injected, K) -> None:
    """Refuse members whose injected hyperparameters (swept or fixed) are out
    of range, or whose first update climbs (a negative learning rate fixed
    inside the optimizer)."""
    hyper = getattr(states.opt_state, "hyperparams", None)
    if isinstance(hyper, dict):
        check_values(
            {n: to_host(v)[:K] for n, v in hyper.items() if eqx.is_array(v)},
            _owner=owner,
        )
    if isinstance(injected, dict) and "learning_rate" in injected:
        return
    try:
        climb = to_host(_member_climbs(tx, states))[:K]
    except Exception:  # noqa: BLE001 - the real step will report it
        return
    bad = np.flatnonzero(climb > 0)
    if bad.size:
        raise ConfigError(
            f"{owner}: the first update of member {int(bad[0])} climbs the "
            f"gradient (sum of the update for a gradient of ones is "
            f"{float(climb[bad[0]]):.3g} > 0): is a learning rate fixed inside the "
            "optimizer negative? Pass a positive learning rate."
        )


@eqx.filter_jit
def _member_climbs(tx, states):
    return eqx.filter_vmap(lambda s: climbs(tx, s.opt_state, s.model))(states)


@eqx.filter_jit
def _probe_members(probe, models, sharding):
    return eqx.filter_shard(eqx.filter_vmap(probe)(models), sharding)


@eqx.filter_jit
def _val_members(val, models, data, sharding):
    losses = eqx.filter_vmap(lambda m: val(m, data))(models)
    return eqx.filter_shard(losses, sharding)
