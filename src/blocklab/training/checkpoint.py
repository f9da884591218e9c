"""Checkpoints: a model's hyperparameters stored beside its weights, in one file.

File layout (version 2):

1. the line `blocklab-checkpoint 2`;
2. the line `sha256 <64 hex digits>`: the SHA-256 of everything after this
   line (the header line, its newline and the weights), so that any flipped
   bit in the header or the weights is refused by `load`;
3. one line of JSON: `{"class": ..., "config": {...}, "dtypes": [...],
   "nbytes": N}`, where `config` holds the constructor arguments that rebuild
   the model's structure (`model.init_args()`), `dtypes` the dtype of every
   stored array in tree order and `N` the size of what follows;
4. the weights, written by `equinox.tree_serialise_leaves` (NumPy `.npy`
   records, one per array, in tree order).

Version-1 files (no checksum line, no `dtypes`) are still read.

`save` writes through `blocklab._io.atomic_path` (a temporary file in the same
folder, fsync, rename), after checking everything that can be checked first
(the model's class, that its config is JSON, the destination): a failure at
any point leaves an earlier checkpoint at `path` exactly as it was.

Errors: a bad argument (a model class that cannot be checkpointed, a path
that is a folder or names no file, a `like=` model that does not match) is a
`ConfigError`; a file that is not a readable, intact checkpoint (truncated,
corrupted, an unknown version or class) is a `CheckpointError`. Both are
`ValueError`s.

`load` rebuilds the structure from the config (without drawing weights,
`eqx.filter_eval_shape`) and reads the arrays back with their stored dtypes
(float32, bfloat16, float16, float64, ...), so a round trip is bit-exact.

The classes a checkpoint can hold are listed in `_MODELS`; to add one, give
it a `config()` method returning its constructor arguments (JSON values,
without `key`) and add it there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._io import atomic_path, check_writable
from .._validate import ConfigError
from ..models.charlm import CharLM
from ..models.decoder import DecoderLM

__all__ = ["CheckpointError", "save", "load"]

_PREFIX = b"blocklab-checkpoint "
_VERSION = 2
_MAGIC = _PREFIX + str(_VERSION).encode() + b"\n"
_MAGIC_V1 = _PREFIX + b"1\n"
_SHA_TAG = b"sha256 "
#: Model classes a checkpoint can hold, by name. Each has `config()`.
_MODELS: dict[str, type] = {"CharLM": CharLM, "DecoderLM": DecoderLM}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read back: unreadable, truncated,
    corrupted (its checksum does not match), of an unknown version or model
    class, or with weights that do not fit its config. Not a bad argument
    (that is `ConfigError`): the file itself is at fault, so use another copy.
    """


def _check_path(owner: str, path: Any) -> Path:
    if isinstance(path, (str, os.PathLike)) and str(path):
        return Path(path)
    raise ConfigError(
        f"{owner}: path must be a file name (a non-empty str or os.PathLike), got "
        f"{path!r} of type {type(path).__name__}."
    )


def _array_dtypes(model: Any) -> list[str]:
    return [str(a.dtype) for a in jax.tree_util.tree_leaves(model) if eqx.is_array(a)]


def save(path: str | Path, model: Any) -> Path:
    """Write `model` (its config and weights) to `path` atomically; returns the path.

    Nothing is written until the model and the destination have been checked,
    and the file is replaced only once the new one is complete on disk: a
    failure (a full disk, an interrupt, a folder that cannot be written)
    leaves an earlier checkpoint at `path` intact and no temporary file.

    Raises:
        ConfigError: `model` is not a checkpointable class, or its config holds
            values JSON cannot store (e.g. an `attn_factory` function); `path`
            is a directory or its folder cannot be written.
        OSError: the write itself failed (the old file is kept).
    """
    name = type(model).__name__
    if _MODELS.get(name) is not type(model):
        raise ConfigError(
            f"save: cannot checkpoint a {name} (model=); supported models: "
            f"{sorted(_MODELS)}."
        )
    keys = [
        jax.tree_util.keystr(p)
        for p, a in jax.tree_util.tree_leaves_with_path(model)
        if eqx.is_array(a) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    ]
    if keys:
        raise ConfigError(
            f"save: the model (model=) holds a PRNG key at {keys[0]}; a checkpoint "
            "stores weights, not keys. Store jax.random.key_data(key) (a uint32 "
            "array) instead, or drop the key before saving."
        )
    config = model.init_args()
    try:
        json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"save: the config of this {name} (model=) cannot be stored as JSON "
            f"({err}); options such as attn_factory / ffn_factory must be rebuilt "
            "in code."
        ) from None
    path = check_writable(_check_path("save", path), owner="save", name="path")
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, model)
    payload = buf.getvalue()
    header = json.dumps(
        {
            "class": name,
            "config": config,
            "dtypes": _array_dtypes(model),
            "nbytes": len(payload),
        },
        allow_nan=False,
    ).encode()
    body = header + b"\n" + payload
    digest = hashlib.sha256(body).hexdigest().encode()
    with atomic_path(path, owner="save") as tmp, open(tmp, "wb") as f:
        for part in (_MAGIC, _SHA_TAG + digest + b"\n", header + b"\n", payload):
            f.write(part)
    return path


def _read_file(path: Path) -> tuple[int, dict, bytes]:
    """`(version, header, weights)` of a checkpoint, checksum verified."""
    if path.is_dir():
        raise ConfigError(
            f"load: {path} is a directory; pass the checkpoint file written by "
            "blocklab.save."
        )
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"load: no checkpoint at path={str(path)!r}.") from None
    except OSError as err:
        raise CheckpointError(f"load: cannot read {path}: {err}.") from None
    if blob.startswith(_MAGIC):
        version = _VERSION
        line, sep, body = blob[len(_MAGIC) :].partition(b"\n")
        if not (sep and line.startswith(_SHA_TAG)):
            raise CheckpointError(f"load: {path} has a truncated or corrupted header.")
        stored = line[len(_SHA_TAG) :].decode("ascii", "replace")
    elif blob.startswith(_MAGIC_V1):
        version, body = 1, blob[len(_MAGIC_V1) :]
    elif blob.startswith(_PREFIX):
        found = blob[len(_PREFIX) :].partition(b"\n")[0][:20]
        raise CheckpointError(
            f"load: {path} is a blocklab checkpoint of an unsupported version "
            f"{found.decode('ascii', 'replace')!r}; this blocklab reads versions "
            f"1 to {_VERSION}."
        )
    else:
        raise CheckpointError(
            f"load: {path} is not a blocklab checkpoint (bad header)."
        )
    line, sep, payload = body.partition(b"\n")
    try:
        header = json.loads(line) if sep else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or {"class", "config", "nbytes"} - header.keys():
        raise CheckpointError(f"load: {path} has a truncated or corrupted header.")
    if len(payload) != header["nbytes"]:
        raise CheckpointError(
            f"load: {path} is truncated or corrupted: expected {header['nbytes']} "
            f"bytes of weights, found {len(payload)}."
        )
    if version >= 2:
        actual = hashlib.sha256(body).hexdigest()
        if stored != actual:
            raise CheckpointError(
                f"load: {path} is corrupted: its SHA-256 checksum does not match "
                f"(stored {stored[:16]}..., computed {actual[:16]}...). The file "
                "was changed or damaged after it was written; use another copy."
            )
    return version, header, payload


def _read_arrays(payload: bytes, skeleton: Any, dtypes: list[str] | None) -> Any:
    """Fill the array leaves of `skeleton`, in tree order, from the stored records.

    Each array keeps its stored dtype (the skeleton only fixes shapes). NumPy
    stores extension dtypes such as bfloat16 as raw bytes (`|V2`); the
    header's `dtypes` says what they were. Version-1 files have no `dtypes`:
    their 2-byte raw records can only have been bfloat16.
    """
    leaves, treedef = jax.tree_util.tree_flatten(skeleton)
    slots = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    if dtypes is not None and len(dtypes) != len(slots):
        raise CheckpointError(
            f"the header lists {len(dtypes)} arrays, the model has {len(slots)}"
        )
    f = io.BytesIO(payload)
    for n, i in enumerate(slots):
        value = np.load(f, allow_pickle=False)
        if value.shape != leaves[i].shape:
            raise CheckpointError(
                f"stored array {n} has shape {value.shape} where the model has "
                f"{leaves[i].shape}"
            )
        if dtypes is not None:
            target = np.dtype(jnp.dtype(dtypes[n]))
        elif value.dtype.kind == "V" and value.dtype.itemsize == 2:
            target = np.dtype(jnp.bfloat16)
        else:
            target = value.dtype
        if value.dtype != target:
            if value.dtype.kind != "V" or value.dtype.itemsize != target.itemsize:
                raise CheckpointError(
                    f"stored array {n} has dtype {value.dtype} where the header "
                    f"says {target}"
                )
            value = value.view(target)
        leaves[i] = jnp.asarray(value)
    if f.tell() != len(payload):
        raise CheckpointError(
            f"{len(payload) - f.tell()} bytes left after the last array"
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)


def load(path: str | Path, like: Any = None) -> Any:
    """Read a model written by `save`.

    Args:
        path: the checkpoint file.
        like: optionally, a model the checkpoint must match: its class and
            config must equal the stored ones (e.g. loading into a model of
            another width or activation is refused).

    Returns:
        The model, structure rebuilt from the stored config, weights bit-exact
        and of their stored dtypes.

    Raises:
        ConfigError: `path` names no file or a directory, or the stored
            config does not match `like`.
        CheckpointError: an unreadable, truncated or corrupted file (a
            checksum that does not match), an unknown version or class, or
            weights that do not fit the stored config.
    """
    path = _check_path("load", path)
    _, header, payload = _read_file(path)
    name, config = header["class"], header["config"]
    if name == "DecoderLM" and isinstance(config, dict) and "config" in config:
        # A file of 0.2, whose DecoderLM took config= / config_class= (its flat
        # fields are DecoderConfig's keyword spelling): the file still loads.
        config = {
            "cfg": config["config"],
            **(
                {"cfg_class": config["config_class"]}
                if "config_class" in config
                else {}
            ),
        }
    if name not in _MODELS:
        raise CheckpointError(
            f"load: {path} holds an unknown model class {name!r}; this blocklab "
            f"reads {sorted(_MODELS)}."
        )
    if not isinstance(config, dict):
        raise CheckpointError(f"load: {path} has a corrupted header (config).")
    if like is not None:
        like_name = type(like).__name__
        like_config = like.init_args() if hasattr(like, "init_args") else None
        if like_name != name or like_config != config:
            diff = (
                {
                    k: (config.get(k), like_config.get(k))
                    for k in sorted(config.keys() | like_config.keys())
                    if config.get(k) != like_config.get(k)
                }
                if like_name == name
                else {"class": (name, like_name)}
            )
            raise ConfigError(
                f"load: the checkpoint {path} does not match the given model "
                "(like=); "
                f"(stored, given) differ in {diff}."
            )
    try:
        skeleton = eqx.filter_eval_shape(
            lambda: _MODELS[name](**config, key=jax.random.key(0))
        )
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"load: the config stored in {path} does not build a {name}: {err}"
        ) from err
    try:
        return _read_arrays(payload, skeleton, header.get("dtypes"))
    except (ValueError, TypeError, OSError, EOFError) as err:
        raise CheckpointError(
            f"load: the weights in {path} do not fit a {name}({config}): {err}. "
            "The file is corrupted or was written by an incompatible version."
        ) from err
