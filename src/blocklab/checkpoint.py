"""Checkpoints: a model's hyperparameters stored beside its weights, in one file.

File layout (version 1):

1. the line `blocklab-checkpoint 1`;
2. one line of JSON: `{"class": ..., "config": {...}, "nbytes": N}`, where
   `config` holds the constructor arguments that rebuild the model's
   structure (`model.config()`) and `N` is the size of what follows;
3. the weights, written by `equinox.tree_serialise_leaves` (NumPy `.npy`
   records, one per array, in tree order).

`load` rebuilds the structure from the config (without drawing weights,
`eqx.filter_eval_shape`) and reads the arrays back with their stored dtypes,
so a round trip is bit-exact.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .models import CharLM

__all__ = ["save", "load"]

_MAGIC = b"blocklab-checkpoint 1\n"
#: Model classes a checkpoint can hold, by name.
_MODELS: dict[str, type] = {"CharLM": CharLM}


def save(path: str | Path, model: Any) -> Path:
    """Write `model` (its config and weights) to `path`; returns the path.

    Raises:
        TypeError: `model` is not a checkpointable class, or its config holds
            values JSON cannot store (e.g. an `attn_factory` function).
    """
    name = type(model).__name__
    if _MODELS.get(name) is not type(model):
        raise TypeError(
            f"save: cannot checkpoint a {name}; supported models: {sorted(_MODELS)}."
        )
    config = model.config()
    try:
        header = json.dumps({"class": name, "config": config, "nbytes": 0})
    except TypeError as err:
        raise TypeError(
            f"save: the config of this {name} cannot be stored as JSON ({err}); "
            "options such as attn_factory / ffn_factory must be rebuilt in code."
        ) from None
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, model)
    payload = buf.getvalue()
    header = json.dumps({"class": name, "config": config, "nbytes": len(payload)})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_MAGIC + header.encode() + b"\n" + payload)
    return path


def _read_header(path: Path) -> tuple[dict, bytes]:
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"load: no checkpoint at {path}.") from None
    if not blob.startswith(_MAGIC):
        raise ValueError(f"load: {path} is not a blocklab checkpoint (bad header).")
    line, sep, payload = blob[len(_MAGIC) :].partition(b"\n")
    try:
        header = json.loads(line) if sep else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or {"class", "config", "nbytes"} - header.keys():
        raise ValueError(f"load: {path} has a truncated or corrupted header.")
    if len(payload) != header["nbytes"]:
        raise ValueError(
            f"load: {path} is truncated or corrupted: expected {header['nbytes']} "
            f"bytes of weights, found {len(payload)}."
        )
    return header, payload


def _read_leaf(f, like):
    """Read one stored array, keeping its stored dtype; the shape must match."""
    if not (eqx.is_array(like) or isinstance(like, jax.ShapeDtypeStruct)):
        return like
    value = np.load(f)
    if value.shape != like.shape:
        raise ValueError(
            f"stored array of shape {value.shape} where the model has {like.shape}"
        )
    return jnp.asarray(value)


def load(path: str | Path, like: Any = None) -> Any:
    """Read a model written by `save`.

    Args:
        path: the checkpoint file.
        like: optionally, a model the checkpoint must match: its class and
            config must equal the stored ones (e.g. loading into a model of
            another width or activation is refused).

    Returns:
        The model, structure rebuilt from the stored config, weights bit-exact.

    Raises:
        ValueError: a missing, truncated or corrupted file, or a config that
            does not match `like`.
    """
    path = Path(path)
    header, payload = _read_header(path)
    name, config = header["class"], header["config"]
    if name not in _MODELS:
        raise ValueError(f"load: {path} holds an unknown model class {name!r}.")
    if like is not None:
        like_name = type(like).__name__
        like_config = like.config() if hasattr(like, "config") else None
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
            raise ValueError(
                f"load: the checkpoint {path} does not match the given model; "
                f"(stored, given) differ in {diff}."
            )
    skeleton = eqx.filter_eval_shape(
        lambda: _MODELS[name](**config, key=jax.random.key(0))
    )
    try:
        return eqx.tree_deserialise_leaves(io.BytesIO(payload), skeleton, _read_leaf)
    except Exception as err:  # equinox wraps reader errors in its own types
        raise ValueError(
            f"load: the weights in {path} do not fit a {name}({config}): {err}. "
            "The file is corrupted or was written by an incompatible version."
        ) from err
