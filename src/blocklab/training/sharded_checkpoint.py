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

The mesh's axes may be `Auto`, `Explicit` (`jax.make_mesh`'s default) or a
mix, on either side: the arrays are restored onto `mesh` as given, and
`train_model(state=..., run=RunConfig(mesh=mesh))` resumes from them.

Folder layout: `arrays/` (orbax's `StandardSave` of the state's arrays, as
`{"a00000": ..., ...}` in tree order) and `meta/` (JSON: the format
version, the model's class and `config()`, the step, the data position, the
name, shape and dtype of every array: `.model.stack.blocks...`,
`.opt_state...`, and a checksum of every array).

**Checksums.** As the single-file format (`checkpoint.save`) refuses a
flipped bit, so does this one, per array, without gathering anything: an
array's checksum is two 32-bit sums over its elements,

$$c_j = \sum_i f\big(w_i \oplus f(i \cdot \varphi + s_j)\big) \bmod 2^{32},$$

$w_i$ the bits of element $i$ (by its index $i$ in the whole array, as
32-bit words), $f$ MurmurHash3's 32-bit finalizer (a bijection), $\varphi$ =
0x9E3779B9 and $s_j$ two seeds. Each device sums its own shard and the
partial sums add up modulo $2^{32}$ exactly, in any order, so the checksum
does not depend on the layout: it is computed where the arrays are at save
and at restore (on another mesh, too). A change of any one element changes
both sums ($f$ is a bijection). A SHA-256 of the bytes, as the single-file
format has, would need each array whole on one host. `restore_sharded`
refuses an array whose checksum differs with a `CheckpointError` naming it.
Version-1 folders (no checksums) are still read, unchecked.

Restoring checks the saved names, shapes and config against the target
model first: a checkpoint of another config is refused with a `ConfigError`
naming the leaf, the two shapes (or the differing config fields) and the
mesh, before anything is read. A folder that is not a readable checkpoint
raises `CheckpointError`.

The data position: `train_model` draws step $s$'s batch from
`fold_in(key, s)`, so the step count is the position in the data stream,
and training resumed from a restored state with the same key continues as
if it had not stopped. `data_position=` stores anything else a loader needs
(a JSON value that reads back equal; anything else is refused before
anything is written).

The small single-file format (`blocklab.training.checkpoint.save` / `load`)
stays for models that fit one host.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._validate import ConfigError
from .checkpoint import CheckpointError
from .mesh_training import place_state, state_shardings
from .placement import ActivationConstraint, check_mesh, resolve_rules, with_constraints
from .step import TrainState, init_state

__all__ = ["SavedCheckpoint", "restore_sharded", "save_sharded", "sharded_metadata"]

_FORMAT = "blocklab-sharded-checkpoint"
_VERSION = 2
#: The versions this module reads (1: no checksums).
_READS = (1, 2)
#: The name of the checksum (see the module docstring), stored with it.
_CHECKSUM = "murmur3-fmix32-sum-2x32"
_SEEDS = (0x243F6A88, 0x85A308D3)
_TMP = ".orbax-checkpoint-tmp"


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


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words, shape `(*x.shape, w)` (injective)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.concatenate([_words(jnp.real(x)), _words(jnp.imag(x))], -1)
    size = np.dtype(x.dtype).itemsize
    if x.dtype == bool or (jnp.issubdtype(x.dtype, jnp.integer) and size <= 4):
        return x.astype(jnp.uint32)[..., None]  # ints: two's complement bits
    if size >= 4:  # float32 -> (..., 1), float64 -> (..., 2)
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(*x.shape, -1)
    same = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, same).astype(jnp.uint32)[..., None]


def _checksum(x: jax.Array) -> jax.Array:
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(w.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, w.shape, dim)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= w.shape[dim]
    key = index * jnp.uint32(0x9E3779B9)
    return jnp.stack([
        jnp.sum(_fmix32(w ^ _fmix32(key + jnp.uint32(seed))), dtype=jnp.uint32)
        for seed in _SEEDS
    ])  # fmt: skip


@jax.jit
def _checksums_of(arrays: dict) -> dict:
    return {n: _checksum(x) for n, x in arrays.items()}


def _checksums(named: list[tuple[str, Any]]) -> dict[str, str]:
    """`{name: 16 hex digits}`: the checksum of every array (module docstring),
    computed where the arrays are (nothing is gathered)."""
    sums = _checksums_of(dict(named))
    return {
        n: "".join(f"{int(v):08x}" for v in np.asarray(jax.device_get(c)))
        for n, c in sums.items()
    }


def _check_position(owner: str, value: Any) -> None:
    """Refuse a data position that JSON would not give back equal."""
    try:
        same = json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError):
        same = False
    if not same:
        raise ConfigError(
            f"{owner}: data_position must be a JSON value that reads back equal "
            f"(None, bool, int, finite float, str, lists of them and dicts with "
            f"str keys), got {value!r} ({type(value).__name__})."
        )


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
        """Block until the write is committed; returns the folder. A write
        that failed raises here, and its temporary folder is removed."""
        if self._checkpointer is not None:
            ckpt, self._checkpointer = self._checkpointer, None
            try:
                ckpt.wait_until_finished()
            except BaseException:
                _remove_tmp(self.path)
                raise
            finally:
                ckpt.close()
        return self.path


def _remove_tmp(path: Path) -> None:
    """Remove the temporary folder of an unfinished write to `path`."""
    tmp = path.with_name(path.name + _TMP)
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)


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
        data_position: a JSON value a data loader needs to resume (the
            step count, stored anyway, is the position for `train_model`);
            it must read back equal (dicts with str keys, lists, str, int,
            finite float, bool, None).
        force: overwrite an existing folder.
        wait: block until committed; `False` returns at once (async save:
            the arrays are copied to host memory first, then written in a
            background thread), call `.wait()` before reading it.

    Raises:
        ConfigError: `path` exists (without `force`) or is not a name; a
            `data_position` that JSON does not give back equal (checked
            before anything is written).
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
    _check_position(owner, data_position)
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
        "checksum": _CHECKSUM,
        "checksums": _checksums(named),
    }
    ckpt = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())
    try:
        ckpt.save(
            path,
            args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )
    except BaseException:
        ckpt.close()
        _remove_tmp(path)
        raise
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
    if meta.get("version") not in _READS:
        raise CheckpointError(
            f"{path}: sharded checkpoint version {meta.get('version')!r}; this "
            f"blocklab reads versions {list(_READS)}."
        )
    if meta["version"] >= 2 and (
        meta.get("checksum") != _CHECKSUM
        or not isinstance(meta.get("checksums"), dict)
        or set(meta["checksums"]) != {n for n, *_ in meta.get("leaves", ())}
    ):
        raise CheckpointError(
            f"{path}: the metadata's checksums are missing or incomplete (want "
            f"{_CHECKSUM!r} for every array); the folder is damaged."
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
        mesh: the mesh to restore onto (a `jax.sharding.Mesh` over every
            device, its axes `Auto`, `Explicit` or a mix; not necessarily the
            one saved from).
        rules: the layout on `mesh` (a preset or a mapping), as for
            `train_model(run=RunConfig(mesh=, rules=))`.

    Returns:
        The state, each array on its sharding, with the block-boundary
        constraint installed (pass it to `train_model(state=...,
        run=RunConfig(mesh=mesh, rules=rules))` to resume).

    Raises:
        ConfigError: `model` is of another config than the saved one, or an
            array's name or shape differs (naming the leaf, both shapes and
            the mesh); the mesh (not a `Mesh`, ...) or rules are bad (see
            `blocklab.training.placement.shard`).
        CheckpointError: the folder is not a readable checkpoint, or an
            array does not match its checksum (naming it).
    """
    owner = "restore_sharded"
    ocp = _ocp()
    check_mesh(mesh, _owner=owner)
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
    if meta["version"] >= 2:
        read = _checksums(list(values.items()))
        bad = [n for n in names if read[n] != meta["checksums"][n]]
        if bad:
            raise CheckpointError(
                f"{owner}: {path} is corrupted: array {bad[0]} does not match its "
                f"checksum (saved {meta['checksums'][bad[0]]}, read {read[bad[0]]})"
                + (f", and {len(bad) - 1} more" if len(bad) > 1 else "")
                + "; use another copy of the checkpoint."
            )

    def fill(p, x):
        return values[jax.tree_util.keystr(p)] if _is_arrayish(x) else x

    return jax.tree_util.tree_map_with_path(fill, target)
