r"""Safetensors checkpoint folders on disk: the catalog of tensors, shards, writes.

A folder written by `transformers`' `save_pretrained` holds `config.json` and
either one `model.safetensors` or shards `model-0000i-of-0000N.safetensors`
listed by `model.safetensors.index.json`
(`{"metadata": {"total_size": B, ...}, "weight_map": {key: shard}}`).
A safetensors file is `u64 little-endian n` + an `n`-byte JSON header
(`{key: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`) + the raw
bytes. This module reads only headers up front (`Catalog`: every key's file,
shape and dtype, checked before any data is read) and then one tensor at a
time, through the `safetensors` package's NumPy API with the `pread` backend
(no memory map: a read tensor is the only copy in host memory). It never
imports torch.

Writing: `shard_plan` groups tensors as `transformers` does (a new shard when
the next tensor would pass `max_shard_size`; one tensor larger than it gets a
shard of its own); `write_shards` writes them with `{"format": "pt"}`
metadata, and the index when there is more than one shard.

Errors: a file that is missing, truncated or not safetensors, an index that
is not JSON or names a missing shard, a key stored twice, an index beside a
`model.safetensors` it does not list (two checkpoints in one folder):
`CheckpointError` naming the file (and key).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes  # noqa: F401 - safetensors' NumPy API reads BF16 only once imported
import numpy as np

from .._validate import ConfigError
from ..training.checkpoint import CheckpointError

__all__ = [
    "CONFIG_NAME",
    "GENERATION_CONFIG_NAME",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "Catalog",
    "TensorInfo",
    "open_catalog",
    "parse_size",
    "shard_name",
    "shard_plan",
    "write_shards",
]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

#: Safetensors dtype names -> NumPy dtypes (BF16 and FP8 through `ml_dtypes`).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lives and what it is (from the file's header)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # the safetensors name, e.g. "BF16"

    @property
    def np_dtype(self) -> np.dtype | None:
        """Its NumPy dtype, `None` when NumPy cannot hold it."""
        return DTYPES.get(self.dtype)

    def check_float(self, owner: str, key: str) -> None:
        """Refuse a tensor that cannot become parameters: floating point only
        (F32, BF16, F16, F64; F8 with `dtype=`), JAX's sense of floating,
        which includes BF16 and F8 (NumPy's does not)."""
        dt = self.np_dtype
        if dt is None or not jnp.issubdtype(dt, jnp.floating):
            raise CheckpointError(
                f"{owner}: {self.file}: tensor {key!r} is stored as {self.dtype}, "
                "which cannot be converted to parameters (floating point: F32, "
                "BF16, F16, F64; F8 with dtype=)."
            )

    @property
    def nbytes(self) -> int:
        size = self.np_dtype.itemsize if self.np_dtype is not None else 0
        return int(np.prod(self.shape, dtype=np.int64)) * size


def _safe_open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="np", backend="pread")
    except TypeError:  # an older safetensors without backend=
        return safe_open(str(path), framework="np")


class Catalog:
    """Every tensor of a checkpoint folder: `{key: TensorInfo}` from the headers.

    Opening reads and checks every header (a truncated file fails here, before
    any weight is read); `read(key)` then returns one tensor as a NumPy array
    (bf16 as `ml_dtypes.bfloat16`). Use as a context manager, or `close()`.
    """

    def __init__(self, folder: Path, files: list[Path], declared: dict[str, str]):
        self.folder = folder
        self.files = files
        self.infos: dict[str, TensorInfo] = {}
        self._handles: dict[Path, Any] = {}
        try:
            for file in files:
                handle = self._open(file)
                for key in handle.keys():
                    if key in self.infos:
                        raise CheckpointError(
                            f"load_pretrained: key {key!r} is stored twice, in "
                            f"{self.infos[key].file.name} and {file.name}."
                        )
                    sl = handle.get_slice(key)
                    self.infos[key] = TensorInfo(
                        file, tuple(int(n) for n in sl.get_shape()), sl.get_dtype()
                    )
            for key, shard in declared.items():
                info = self.infos.get(key)
                if info is None:
                    raise CheckpointError(
                        f"load_pretrained: {INDEX_NAME} maps key {key!r} to {shard}, "
                        f"which does not hold it (the shard's keys do not match the "
                        "index)."
                    )
        except BaseException:
            self.close()
            raise

    def _open(self, file: Path):
        if not file.is_file():
            raise CheckpointError(
                f"load_pretrained: {file.name} is missing from {self.folder} "
                f"(listed in {INDEX_NAME})."
                if file.name != WEIGHTS_NAME
                else f"load_pretrained: {self.folder} has no {WEIGHTS_NAME} (and no "
                f"{INDEX_NAME} listing shards)."
            )
        try:
            handle = _safe_open(file).__enter__()
        except Exception as err:  # SafetensorError, OSError: the file is at fault
            raise CheckpointError(
                f"load_pretrained: {file} is not a readable safetensors file "
                f"(truncated or damaged?): {err}"
            ) from None
        self._handles[file] = handle
        return handle

    def keys(self) -> list[str]:
        return list(self.infos)

    def read(self, key: str) -> np.ndarray:
        """The stored tensor `key` (a fresh NumPy array, nothing else kept)."""
        info = self.infos[key]
        try:
            return self._handles[info.file].get_tensor(key)
        except Exception as err:
            raise CheckpointError(
                f"load_pretrained: cannot read {key!r} from {info.file}: {err}"
            ) from None

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_catalog(folder: Path) -> Catalog:
    """The `Catalog` of a folder: its index's shards, or its one weights file.

    Raises:
        CheckpointError: an index that is not JSON or has no `weight_map`, a
            shard it lists that is missing, a file that is truncated or not
            safetensors, an index beside a `model.safetensors` it does not list
            (each named).
    """
    index = folder / INDEX_NAME
    if not index.is_file():
        return Catalog(folder, [folder / WEIGHTS_NAME], {})
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, Mapping):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"load_pretrained: {index} is not a safetensors index "
            f'({{"weight_map": {{key: shard}}}}): {err}'
        ) from None
    files, declared = [], {}
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise CheckpointError(
                f"load_pretrained: {index} maps {key!r} to {shard!r}, not a file "
                "name in the folder."
            )
        declared[key] = shard
        if folder / shard not in files:
            files.append(folder / shard)
    single = folder / WEIGHTS_NAME
    if single not in files and single.exists():
        raise CheckpointError(
            f"load_pretrained: {folder} holds both {INDEX_NAME} (listing "
            f"{len(files)} shard(s)) and a {WEIGHTS_NAME} it does not list: two "
            f"checkpoints in one folder (transformers reads {WEIGHTS_NAME}, the "
            "index would give the shards). Remove the one that is not this "
            "checkpoint."
        )
    return Catalog(folder, files, declared)


# Writing ---------------------------------------------------------------------

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_size(owner: str, value: Any) -> int:
    """Bytes of `max_shard_size`: an int, or a string such as `"5GB"` (10^9)
    or `"500MiB"` (2^20), as `transformers` reads it."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        size = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{owner}: max_shard_size must be a number of bytes or a string "
                f"like '5GB', '200MB', '500MiB', got {value!r}."
            )
        size = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(
            f"{owner}: max_shard_size must be an int (bytes) or a string like "
            f"'5GB', got {type(value).__name__} {value!r}."
        )
    if size < 1:
        raise ConfigError(f"{owner}: max_shard_size must be >= 1 byte, got {value!r}.")
    return size


def shard_plan(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Keys grouped into shards in order: a shard is closed when the next
    tensor would take it past `max_bytes` (a larger tensor sits alone)."""
    shards: list[list[str]] = [[]]
    total = 0
    for key, nbytes in sizes:
        if shards[-1] and total + nbytes > max_bytes:
            shards.append([])
            total = 0
        shards[-1].append(key)
        total += nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    """`transformers`' shard file name: `model-00001-of-00003.safetensors`."""
    return WEIGHTS_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_shards(
    folder: Path,
    shards: list[list[str]],
    tensor: Callable[[str], np.ndarray],
    *,
    num_params: int,
) -> Iterator[str]:
    """Write each shard (its tensors made by `tensor(key)` only while it is
    written), then the index if there are several; yields the file names."""
    from safetensors.numpy import save_file

    weight_map, total = {}, 0
    for i, keys in enumerate(shards):
        name = shard_name(i, len(shards))
        arrays = {k: np.ascontiguousarray(tensor(k)) for k in keys}
        total += sum(a.nbytes for a in arrays.values())
        save_file(arrays, str(folder / name), metadata={"format": "pt"})
        del arrays
        weight_map.update((k, name) for k in keys)
        yield name
    if len(shards) > 1:
        index = {
            "metadata": {"total_parameters": num_params, "total_size": total},
            "weight_map": weight_map,
        }
        (folder / INDEX_NAME).write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )
        yield INDEX_NAME
