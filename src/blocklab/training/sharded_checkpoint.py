r"""Sharded checkpoints: a training state saved and restored without gathering it.

For a model that does not fit one host, `save_sharded(path, state)` writes a
`TrainState` (parameters, optimizer state, step count and finite flag, and
the data position) through `orbax-checkpoint`: every process writes the
shards it owns, in parallel, and nothing is ever gathered onto one host. The
write goes to `<path>.orbax-checkpoint-tmp` and is renamed into place once
complete, so a checkpoint folder that exists is whole (atomic commit); with
`wait=False` the write continues in a background thread (async save) and
`SavedCheckpoint.wait()` joins it.

`restore_sharded(path, model, optimizer, mesh=..., rules=...)` reads the
arrays straight into the layout that `rules` gives on `mesh`
(`blocklab.training.mesh_training.state_shardings`), which need not be the mesh
they were saved from: a checkpoint written by 8 devices under FSDP restores
onto 4 devices under tensor parallelism with equal values.

Folder layout: `arrays/` (orbax's `StandardSave` of the state's arrays, as
`{"a00000": ..., ...}` in tree order) and `meta/` (JSON: the format
version, the model's class and `config()`, the step, the data position, and
the name, shape and dtype of every array: `.model.stack.blocks...`,
`.opt_state...`).

Restoring checks the saved names, shapes and config against the target
model first: a checkpoint of another config is refused with a `ConfigError`
naming the leaf, the two shapes (or the differing config fields) and the
mesh, before anything is read. A folder that is not a readable checkpoint
raises `CheckpointError`.

The data position: `train_model` draws step $s$'s batch from
`fold_in(key, s)`, so the step count is the position in the data stream,
and training resumed from a restored state with the same key continues as
if it had not stopped. `data_position=` stores anything else a loader needs
(any JSON value).

The small single-file format (`blocklab.training.checkpoint.save` / `load`)
stays for models that fit one host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._validate import ConfigError
from .checkpoint import CheckpointError
from .mesh_training import place_state, state_shardings
from .placement import (
    ActivationConstraint,
    check_mesh,
    resolve_rules,
    with_constraints,
)
from .step import TrainState, init_state

__all__ = ["SavedCheckpoint", "restore_sharded", "save_sharded", "sharded_metadata"]

_FORMAT = "blocklab-sharded-checkpoint"
_VERSION = 1


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:  # pragma: no cover - a runtime dependency
        raise ImportError(
            "sharded checkpoints need orbax-checkpoint (pip install orbax-checkpoint)."
        ) from err
    return ocp


def _is_arrayish(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _named_arrays(state: Any) -> list[tuple[str, Any]]:
    return [
        (jax.tree_util.keystr(p), x)
        for p, x in jax.tree_util.tree_leaves_with_path(state)
        if _is_arrayish(x)
    ]


def _config_of(model: Any) -> dict | None:
    init_args = getattr(model, "init_args", None)
    if not callable(init_args):
        return None
    try:
        return dict(init_args())
    except Exception:  # noqa: BLE001 - a module without a JSON config
        return None


def _flat(config: dict, prefix: str = "") -> dict:
    """A nested config as `{"a.b": value}` (so a difference names its field)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _abs(owner: str, path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError(
            f"{owner}: path must be a folder name (a non-empty str or os.PathLike), "
            f"got {path!r}."
        )
    return Path(os.path.abspath(os.fspath(path)))


@dataclass
class SavedCheckpoint:
    """A checkpoint being written (`wait=False`) or written: `wait()` joins it."""

    path: Path
    _checkpointer: Any

    def wait(self) -> Path:
        """Block until the write is committed; returns the folder."""
        if self._checkpointer is not None:
            self._checkpointer.wait_until_finished()
            self._checkpointer.close()
            self._checkpointer = None
        return self.path


def save_sharded(
    path: str | os.PathLike,
    state: TrainState,
    *,
    data_position: Any = None,
    force: bool = False,
    wait: bool = True,
) -> SavedCheckpoint:
    """Write `state` to the folder `path`, each process its own shards.

    Every process of a multi-process job must call it with the same
    arguments. Nothing is gathered: each array is written as the shards its
    devices hold.

    Args:
        path: the checkpoint folder (made absolute; must not exist unless
            `force`).
        state: a `TrainState` (sharded or not).
        data_position: any JSON value a data loader needs to resume (the
            step count, stored anyway, is the position for `train_model`).
        force: overwrite an existing folder.
        wait: block until committed; `False` returns at once (async save:
            the arrays are copied to host memory first, then written in a
            background thread), call `.wait()` before reading it.

    Raises:
        ConfigError: `path` exists (without `force`) or is not a name.
    """
    owner = "save_sharded"
    ocp = _ocp()
    path = _abs(owner, path)
    if path.exists() and not force:
        raise ConfigError(
            f"{owner}: {path} already exists; pass force=True to overwrite it."
        )
    if not isinstance(state, TrainState):
        raise ConfigError(
            f"{owner}: state must be a TrainState, got {type(state).__name__}."
        )
    named = _named_arrays(state)
    arrays = {f"a{i:05d}": x for i, (_, x) in enumerate(named)}
    meta = {
        "format": _FORMAT,
        "version": _VERSION,
        "class": type(state.model).__name__,
        "config": _config_of(state.model),
        "step": int(np.asarray(jax.device_get(state.step))),
        "data_position": data_position,
        "leaves": [[n, list(x.shape), str(x.dtype)] for n, x in named],
    }
    ckpt = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())
    ckpt.save(
        path,
        args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
        ),
        force=force,
    )
    saved = SavedCheckpoint(path, ckpt)
    if wait:
        saved.wait()
    return saved


def sharded_metadata(path: str | os.PathLike) -> dict:
    """The JSON metadata of a sharded checkpoint (config, step, leaves, ...).

    Raises:
        CheckpointError: not a readable blocklab sharded checkpoint.
    """
    ocp = _ocp()
    path = _abs("sharded_metadata", path)
    if not (path / "meta").is_dir() or not (path / "arrays").is_dir():
        raise CheckpointError(
            f"{path} is not a sharded checkpoint (no arrays/ and meta/ folders); "
            "an unfinished save leaves only a '.orbax-checkpoint-tmp' folder."
        )
    ckpt = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        meta = ckpt.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta["meta"]
    except Exception as err:  # noqa: BLE001 - re-raised as the file's fault
        raise CheckpointError(f"{path}: unreadable metadata: {err}") from err
    finally:
        ckpt.close()
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f"{path}: not a blocklab sharded checkpoint.")
    if meta.get("version") != _VERSION:
        raise CheckpointError(
            f"{path}: sharded checkpoint version {meta.get('version')!r}; this "
            f"blocklab reads version {_VERSION}."
        )
    return meta


def restore_sharded(
    path: str | os.PathLike,
    model: Any,
    optimizer: Any,
    *,
    mesh: Any,
    rules: Any = "fsdp",
) -> TrainState:
    """The `TrainState` saved at `path`, read straight into `rules` on `mesh`.

    Args:
        path: a folder written by `save_sharded`.
        model: a model of the saved structure; only its structure is used,
            so pass the shapes (`eqx.filter_eval_shape(make_model, key)`) to
            allocate nothing beyond the restored shards.
        optimizer: the optax transformation (its state's structure).
        mesh: the mesh to restore onto (any mesh over every device; not
            necessarily the one saved from).
        rules: the layout on `mesh` (a preset or a mapping), as for
            `train_model(mesh=, rules=)`.

    Returns:
        The state, each array on its sharding, with the block-boundary
        constraint installed (pass it to `train_model(state=..., mesh=mesh,
        rules=rules)` to resume).

    Raises:
        ConfigError: `model` is of another config than the saved one, or an
            array's name or shape differs (naming the leaf, both shapes and
            the mesh); the mesh or rules are bad (see
            `blocklab.training.placement.shard`).
        CheckpointError: the folder is not a readable checkpoint.
    """
    owner = "restore_sharded"
    ocp = _ocp()
    check_mesh(mesh)
    meta = sharded_metadata(path)
    path = _abs(owner, path)
    desc = f"mesh {dict(mesh.shape)}"
    saved_cfg, cfg = meta.get("config"), _config_of(model)
    if meta.get("class") != type(model).__name__:
        raise ConfigError(
            f"{owner}: the checkpoint holds a {meta.get('class')}, the target model "
            f"is a {type(model).__name__} (restoring onto {desc})."
        )
    if saved_cfg is not None and cfg is not None and saved_cfg != cfg:
        old, new = _flat(saved_cfg), _flat(cfg)
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ConfigError(
            f"{owner}: the checkpoint's model config differs from the target's in "
            + ", ".join(
                f"{k} (saved {old.get(k)!r}, target {new.get(k)!r})" for k in diff
            )  # fmt: skip
            + f"; restoring onto {desc}. Build the model from the saved config "
            "(sharded_metadata(path)['config'])."
        )
    resolved = resolve_rules(rules, mesh)
    model = with_constraints(model, ActivationConstraint.of(resolved, mesh))
    shape = eqx.filter_eval_shape(init_state, model, optimizer)
    shardings = state_shardings(shape, optimizer, mesh, rules)
    target = place_state(shape, shardings)
    named = _named_arrays(target)
    saved = {n: (tuple(s), d) for n, s, d in meta["leaves"]}
    names = [n for n, _ in named]
    for n, x in named:
        if n not in saved:
            raise ConfigError(
                f"{owner}: the target state has leaf {n} (shape {tuple(x.shape)}), "
                f"which the checkpoint does not hold (restoring onto {desc})."
            )
        if saved[n][0] != tuple(x.shape):
            raise ConfigError(
                f"{owner}: leaf {n} has shape {saved[n][0]} in the checkpoint but "
                f"{tuple(x.shape)} in the target model (restoring onto {desc}); is "
                "the model of another config?"
            )
    extra = sorted(set(saved) - set(names))
    if extra:
        raise ConfigError(
            f"{owner}: the checkpoint holds leaves the target state lacks, e.g. "
            f"{extra[0]} (restoring onto {desc}); another optimizer or model?"
        )
    index = {n: i for i, (n, _, _) in enumerate(meta["leaves"])}
    args = {f"a{index[n]:05d}": x for n, x in named}
    ckpt = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        got = ckpt.restore(
            path, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(args))
        )["arrays"]
    except Exception as err:  # noqa: BLE001 - the file's fault
        raise CheckpointError(f"{path}: could not read the arrays: {err}") from err
    finally:
        ckpt.close()
    values = {n: got[f"a{index[n]:05d}"] for n in names}

    def fill(p, x):
        return values[jax.tree_util.keystr(p)] if _is_arrayish(x) else x

    return jax.tree_util.tree_map_with_path(fill, target)
