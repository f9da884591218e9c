r"""Training one model on a mesh: the state's layout, the batch split, the chunk.

`train_model(..., run=RunConfig(mesh=, rules=))` (and `train_sweep` on a mesh with a
`members` axis) run the same `TrainStep` as on one device; only the layout
of the arrays differs, and GSPMD inserts the collectives:

- the parameters follow `rules` (`blocklab.training.placement.shard`);
- the optimizer state is sharded like the parameters: every leaf of the
  state that has the structure of the parameters (Adam's $m$ and $v$) gets
  the parameter's sharding (`optax.tree_map_params`), the rest (step
  counts, injected hyperparameters) is replicated;
- the batch drawn on the device is split along its leading (batch) axis over
  the mesh axes of the logical `batch` axis (`data`, ...);
- the state is constrained to that layout after every step of a fused
  chunk, so the compiled loop keeps it (and donates it in place).

The mesh's axes may be `Auto`, `Explicit` (`jax.make_mesh`'s default) or
a mix: the step is a program written for propagation, so it runs on
`auto_mesh(mesh)` (the same devices with every axis `Auto`; see
`blocklab.training.placement`), and the state it returns is laid out there;
`placement.on_mesh` puts it back on the caller's mesh without copying.

The arithmetic is that of one device up to the order of the reductions
(a split batch or a split contraction sums in another order), so the losses
agree to float rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._validate import ConfigError
from .placement import (
    ActivationConstraint,
    auto_mesh,
    check_mesh,
    param_shardings,
    place,
    resolve_rules,
    with_constraints,
)
from .step import TrainState, TrainStep, draw_batch, init_state

__all__ = [
    "ShardedSource",
    "check_batch",
    "place_state",
    "reshard_state",
    "run_chunk",
    "shard_step",
    "sharded_state",
    "state_shardings",
]


def _replicated(mesh: Any, prefix: Sequence[str] = ()) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*prefix))


def state_shardings(
    state: Any,
    optimizer: optax.GradientTransformation,
    mesh: Any,
    rules: Any,
    *,
    prefix: Sequence[str] = (),
) -> TrainState:
    """The `NamedSharding` of every array of a `TrainState` (its structure).

    The model's follow `rules`; the optimizer state's parameter-shaped
    leaves follow the parameters; everything else is replicated (with
    `prefix=("members",)`, split over `members` on its leading axis).
    """
    model = param_shardings(state.model, mesh, rules, prefix=prefix)
    inexact = eqx.filter(state.model, _is_inexact)
    # Only the shardings of the trained (floating-point) leaves, in the
    # structure `optimizer.init` saw.
    params = jax.tree_util.tree_map(
        lambda x, s: s if x is not None else None,
        inexact,
        model,
        is_leaf=lambda x: x is None,
    )
    rest = _replicated(mesh, prefix)
    # A masked state (`optax.multi_transform`, `optax.masked`, e.g.
    # `blocklab.nn.lora.lora_optimizer`) holds `MaskedNode`s where a
    # transformation holds no state: kept as they are.
    opt = optax.tree_map_params(
        optimizer,
        lambda x, s: x if isinstance(x, optax.MaskedNode) else s,
        state.opt_state,
        params,
        transform_non_params=lambda x: rest if _is_arrayish(x) else None,
        is_leaf=lambda x: x is None or isinstance(x, optax.MaskedNode),
    )
    return _state_like(model, opt, rest, rest)


def _state_like(model: Any, opt_state: Any, step: Any, finite: Any) -> TrainState:
    """A `TrainState` node holding anything (shardings, `None`), unchecked."""
    probe = TrainState(None, None, jnp.zeros((), jnp.int32), jnp.ones((), bool))
    treedef = jax.tree_util.tree_structure(probe, is_leaf=lambda x: x is not probe)
    return jax.tree_util.tree_unflatten(treedef, [model, opt_state, step, finite])


def _is_arrayish(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _is_inexact(x: Any) -> bool:
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(np.issubdtype(x.dtype, np.inexact))
    return eqx.is_inexact_array(x)


def place_state(state: TrainState, shardings: TrainState) -> TrainState:
    """Every array of `state` put onto its sharding (shapes get it attached)."""
    return jax.tree_util.tree_map(
        lambda x, s: place(x, s) if s is not None and _is_arrayish(x) else x,
        state,
        shardings,
        is_leaf=lambda x: x is None,
    )


class ShardedSource(eqx.Module):
    """A batch source whose batches are split over the data-parallel mesh axes.

    `batch(key)` draws `source`'s batch and constrains every leaf's leading
    axis to `sharding`'s spec (the other axes replicated).
    """

    source: Any
    sharding: NamedSharding = eqx.field(static=True)

    @property
    def data(self) -> Any:
        return getattr(self.source, "data", self.source)

    @property
    def batch_size(self) -> int | None:
        return getattr(self.source, "batch_size", None)

    def batch(self, key: Any) -> Any:
        batch = draw_batch(self.source, key)
        return jax.tree_util.tree_map(
            lambda a: (
                jax.lax.with_sharding_constraint(a, self.sharding) if a.ndim >= 1 else a
            ),
            batch,
        )


def _batch_sharding(mesh: Mesh, resolved: dict) -> NamedSharding:
    axes = tuple(resolved.get("batch", ()))
    spec = (
        PartitionSpec(axes[0] if len(axes) == 1 else axes) if axes else PartitionSpec()
    )
    return NamedSharding(mesh, spec)


def check_batch(step: TrainStep, mesh: Mesh, *, _owner: str = "check_batch") -> None:
    """Refuse a batch whose leading axis is not divisible by the batch's mesh axes."""
    owner = _owner
    source = step.source
    if not isinstance(source, ShardedSource):
        return
    spec = source.sharding.spec
    axes = () if not len(spec) or spec[0] is None else spec[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    n = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
    shapes = jax.eval_shape(lambda k: draw_batch(source.source, k), jax.random.key(0))
    k = step.microbatches
    for leaf in jax.tree_util.tree_leaves(shapes):
        if leaf.ndim >= 1 and leaf.shape[0] % n:
            raise ConfigError(
                f"{owner}: the batch's leading axis ({leaf.shape[0]} rows) is not "
                f"divisible by mesh axis {axes!r} of size {n} on mesh "
                f"{dict(mesh.shape)}; pick a batch_size that is a multiple of {n}."
            )
        if leaf.ndim >= 1 and leaf.shape[0] % (n * k):
            raise ConfigError(
                f"{owner}: microbatches={k} splits the batch's {leaf.shape[0]} "
                f"rows into microbatches of {leaf.shape[0] / k:g} rows, not "
                f"divisible by mesh axis {axes!r} of size {n}; pick a batch_size "
                f"that is a multiple of {n * k}."
            )


def shard_step(step: TrainStep, mesh: Mesh, rules: Any) -> TrainStep:
    """`step` with its batches split over the mesh axes of the logical `batch`
    (on `auto_mesh(mesh)`, where the step runs)."""
    mesh = auto_mesh(mesh)
    sharding = _batch_sharding(mesh, resolve_rules(rules, mesh))
    return TrainStep(
        ShardedSource(step.source, sharding), step.loss_fn, step.optimizer,
        step.precision, step.microbatches,
    )  # fmt: skip


def sharded_state(
    model: Any, optimizer: optax.GradientTransformation, mesh: Mesh, rules: Any
) -> tuple[TrainState, TrainState]:
    """A fresh `TrainState` laid out on `mesh`, and its shardings.

    The model is placed by `rules` (with the block-boundary constraint) and
    the optimizer state is built by one compiled `optimizer.init` whose
    outputs land directly on their shardings (never whole on one device).
    Both are on `auto_mesh(mesh)`, where the training step runs.
    """
    check_mesh(mesh)
    mesh = auto_mesh(mesh)
    resolved = resolve_rules(rules, mesh)
    # The constraint is static metadata of the model: install it first, so
    # the shardings' tree is the state's.
    model = with_constraints(model, ActivationConstraint.of(resolved, mesh))
    shape = eqx.filter_eval_shape(init_state, model, optimizer)
    shardings = state_shardings(shape, optimizer, mesh, rules)
    placed = place_state(_state_like(model, None, None, None), shardings).model
    dyn_shard = eqx.filter(
        shardings, lambda s: s is not None, is_leaf=lambda x: x is None
    )

    @eqx.filter_jit
    def build(m):
        return eqx.filter_shard(init_state(m, optimizer), dyn_shard)

    return build(placed), shardings


def reshard_state(state: TrainState, mesh: Mesh, rules: Any, optimizer: Any) -> tuple:
    """A given `TrainState` (e.g. to resume) moved onto `mesh` by `rules` (on
    `auto_mesh(mesh)`, where the training step runs; a state already laid out
    so on `mesh`, e.g. by `restore_sharded`, moves no data)."""
    check_mesh(mesh)
    mesh = auto_mesh(mesh)
    resolved = resolve_rules(rules, mesh)
    # On every Stack of the state: the optimizer's copies of the model's
    # structure (Adam's m and v) carry the constraint too, and must match the
    # model's (a state restored onto another mesh or other rules has theirs).
    state = with_constraints(state, ActivationConstraint.of(resolved, mesh))
    shardings = state_shardings(state, optimizer, mesh, rules)
    return place_state(state, shardings), shardings


def run_chunk(fixed: tuple, state: TrainState, keys: Any) -> tuple[TrainState, Any]:
    """`step.scan(state, keys)` with the state held on `shardings` after every step.

    `fixed = (step, shardings)`; the state is donated. Traced and run under
    `jax.set_mesh(mesh)`, so a runtime check (an id out of range) raises on
    every device (`blocklab._validate.check_ids`) instead of stalling the
    others in a collective.
    """
    mesh = fixed[0].source.sharding.mesh
    with jax.set_mesh(mesh):
        return _run_chunk(fixed, state, keys)


@eqx.filter_jit(donate="all-except-first")
def _run_chunk(fixed: tuple, state: TrainState, keys: Any) -> tuple[TrainState, Any]:
    step, shardings = fixed
    dynamic, static = eqx.partition(state, eqx.is_array)
    dyn_shard = eqx.filter(
        shardings, lambda s: s is not None, is_leaf=lambda x: x is None
    )

    def body(dyn, k):
        new, out = step(eqx.combine(dyn, static), k)
        new = eqx.filter(new, eqx.is_array)
        return jax.lax.with_sharding_constraint(new, dyn_shard), out

    dynamic, outs = jax.lax.scan(body, dynamic, keys)
    # and on the way out (a constraint in the loop body alone may be
    # overridden by propagation for the loop's result)
    dynamic = jax.lax.with_sharding_constraint(dynamic, dyn_shard)
    return eqx.combine(dynamic, static), outs
