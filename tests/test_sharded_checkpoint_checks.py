"""Sharded checkpoints check what they read and refuse what they cannot write.

- Every array carries a checksum (two 32-bit sums of hashed elements,
  `blocklab.training.sharded_checkpoint`), checked here against a NumPy
  transcription of the formula, for every dtype a state holds; a byte flipped
  in the largest array file of a folder is refused by `restore_sharded`,
  naming the array that orbax reads back changed.
- A `data_position` that JSON does not give back equal is refused by name
  before anything is written; a write that fails in orbax's thread removes
  its temporary folder.
- `restore_sharded(mesh=None)` is refused by name.

Runs on one device (the layout independence of the checksum, on 8 simulated
devices, is in tests/test_explicit_meshes.py).
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from blocklab import ConfigError, DecoderConfig, DecoderLM
from blocklab.training import sharded_checkpoint as sc
from blocklab.training.checkpoint import CheckpointError
from blocklab.training.sharded_checkpoint import (
    restore_sharded,
    save_sharded,
    sharded_metadata,
)
from blocklab.training.step import init_state

CFG = DecoderConfig.llama(vocab_size=32, num_hiddens=32, num_heads=4, num_blks=1,
                          num_kv_heads=2, ffn_width=64, max_len=16)  # fmt: skip
OPT = optax.adam(1e-3)


def _state():
    return init_state(DecoderLM(CFG, key=jax.random.key(0)), OPT)


def _mesh():
    return Mesh(np.asarray(jax.devices()[:1]), ("data",))


# -- the checksum against NumPy ------------------------------------------------


def _fmix32(x):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def _np_checksum(a: np.ndarray) -> str:
    """The module docstring's formula, in NumPy: words w_i of element i (its
    bits: integers as two's complement in 32 bits, floats reinterpreted,
    little-endian words for 8 bytes), index i in row-major order."""
    if a.dtype == bool or (np.issubdtype(a.dtype, np.integer) and a.itemsize <= 4):
        w = a.astype(np.int64).astype(np.uint64).astype(np.uint32)[..., None]
    elif a.itemsize == 8:
        w = a.view(np.uint32).reshape(*a.shape, 2)
    else:
        w = a.view({2: np.uint16, 4: np.uint32}[a.itemsize]).astype(np.uint32)
        w = w[..., None]
    index = (np.arange(w.size, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
    key = index.reshape(w.shape) * np.uint32(0x9E3779B9)
    with np.errstate(over="ignore"):
        sums = [
            int(np.sum(_fmix32(w ^ _fmix32(key + np.uint32(s))), dtype=np.uint64))
            % 2**32
            for s in sc._SEEDS
        ]
    return "".join(f"{s:08x}" for s in sums)


ARRAYS = {
    "float32": np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32),
    "bfloat16": np.random.default_rng(1).normal(size=(4, 2)).astype(ml_dtypes.bfloat16),
    "float16": np.random.default_rng(2).normal(size=(7,)).astype(np.float16),
    "int32": np.array([[-(2**31), -1, 0, 7, 2**31 - 1]], np.int32),
    "int8": np.array([-128, -1, 0, 127], np.int8),
    "uint8": np.array([0, 1, 255], np.uint8),
    "bool": np.array([[True, False], [False, True]]),
    "scalar": np.array(3, np.int32),
}


@pytest.mark.parametrize("dtype", sorted(ARRAYS))
def test_checksum_is_the_formula_and_sees_every_flipped_bit(dtype):
    a = ARRAYS[dtype]
    assert sc._checksums([("x", jnp.asarray(a))]) == {"x": _np_checksum(a)}
    if dtype == "bool":
        return
    # every bit of one element: both 32-bit sums change (f is a bijection)
    base = _np_checksum(a)
    bits = a.reshape(-1).view(f"u{a.itemsize}")
    for bit in range(8 * a.itemsize):
        flipped = bits.copy()
        flipped[-1] ^= np.array(1 << bit).astype(bits.dtype)
        b = flipped.view(a.dtype).reshape(a.shape)
        got = sc._checksums([("x", jnp.asarray(b))])["x"]
        assert got == _np_checksum(b)
        assert got[:8] != base[:8] and got[8:] != base[8:], bit


@pytest.mark.float64
def test_checksum_of_float64_is_the_formula():
    a = np.random.default_rng(3).normal(size=(2, 3))
    x = jnp.asarray(a)
    assert x.dtype == jnp.float64
    assert sc._checksums([("x", x)]) == {"x": _np_checksum(a)}


# -- a flipped byte on disk ----------------------------------------------------


def _read_raw(path) -> dict:
    """The arrays as orbax reads them, by leaf name, without blocklab's checks."""
    ocp = sc._ocp()
    meta = json.loads((path / "meta" / "metadata").read_text())
    ckpt = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        got = ckpt.restore(
            path, args=ocp.args.Composite(arrays=ocp.args.StandardRestore())
        )["arrays"]
    finally:
        ckpt.close()
    return {n: np.asarray(got[f"a{i:05d}"]) for i, (n, *_) in enumerate(meta["leaves"])}


def test_a_flipped_byte_in_the_largest_array_file_is_refused_naming_it(tmp_path):
    state = _state()
    path = save_sharded(tmp_path / "ck", state).path
    clean = _read_raw(path)
    files = [os.path.join(r, f) for r, _, fs in os.walk(path / "arrays") for f in fs]
    largest = max(files, key=os.path.getsize)
    size = os.path.getsize(largest)
    for frac in (0.5, 0.3, 0.7, 0.1, 0.9):  # a byte of array data, not of an index
        bad = tmp_path / f"bad{frac}"
        shutil.copytree(path, bad)
        target = bad / os.path.relpath(largest, path)
        data = bytearray(target.read_bytes())
        data[int(size * frac)] ^= 0xFF
        target.write_bytes(bytes(data))
        changed = [
            n for n, a in _read_raw(bad).items() if a.tobytes() != clean[n].tobytes()
        ]
        if changed:
            break
    assert len(changed) == 1, changed
    with pytest.raises(CheckpointError) as err:
        restore_sharded(bad, state.model, OPT, mesh=_mesh())
    msg = str(err.value)
    assert f"array {changed[0]} does not match its checksum" in msg, msg
    assert "is corrupted" in msg and str(bad) in msg
    # the intact folder restores equal
    back = restore_sharded(path, state.model, OPT, mesh=_mesh())
    for a, b in zip(
        jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(back), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _rewrite_meta(path, edit):
    meta_file = path / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    edit(meta)
    meta_file.write_text(json.dumps(meta))


def test_a_version_1_folder_is_read_unchecked_and_missing_checksums_refused(
    tmp_path,
):
    state = _state()
    path = save_sharded(tmp_path / "ck", state).path
    meta = sharded_metadata(path)
    assert meta["version"] == 2 and meta["checksum"] == sc._CHECKSUM
    names = [n for n, *_ in meta["leaves"]]
    assert sorted(meta["checksums"]) == sorted(names)

    def drop(m):
        del m["checksums"]

    _rewrite_meta(path, drop)
    with pytest.raises(CheckpointError, match="checksums are missing"):
        restore_sharded(path, state.model, OPT, mesh=_mesh())

    def version_1(m):
        m["version"] = 1
        m.pop("checksum")

    _rewrite_meta(path, version_1)
    back = restore_sharded(path, state.model, OPT, mesh=_mesh())
    np.testing.assert_array_equal(
        np.asarray(back.model.token_emb.weight),
        np.asarray(state.model.token_emb.weight),
    )


# -- what save_sharded and restore_sharded refuse --------------------------------


@pytest.mark.parametrize(
    "position",
    [{1, 2}, (1, 2), {1: "a"}, float("nan"), {"epoch": np.int64(3)}, b"x"],
    ids=["set", "tuple", "int-key", "nan", "numpy-int", "bytes"],
)
def test_a_data_position_json_cannot_keep_is_refused_before_writing(tmp_path, position):
    with pytest.raises(
        ConfigError,
        match=r"save_sharded: data_position must be a JSON value that reads back "
        r"equal .*, got ",
    ) as err:
        save_sharded(tmp_path / "ck", _state(), data_position=position)
    assert repr(position) in str(err.value)
    assert os.listdir(tmp_path) == []  # no folder, no temporary folder


def test_a_write_that_fails_in_orbax_thread_leaves_nothing(tmp_path, monkeypatch):
    # past blocklab's check, orbax's JSON writer fails in its own thread
    monkeypatch.setattr(sc, "_check_position", lambda owner, value: None)
    with pytest.raises(TypeError, match="not JSON serializable"):
        save_sharded(tmp_path / "ck", _state(), data_position={1, 2})
    assert os.listdir(tmp_path) == []


def test_a_nested_data_position_is_kept(tmp_path):
    position = {"epoch": 2, "files": ["a", "b"], "offset": 0.5, "done": None}
    path = save_sharded(tmp_path / "ck", _state(), data_position=position).path
    assert sharded_metadata(path)["data_position"] == position


@pytest.mark.parametrize("mesh", [None, "data=1"])
def test_restore_without_a_mesh_is_refused_by_name(tmp_path, mesh):
    state = _state()
    path = save_sharded(tmp_path / "ck", state).path
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(
        ConfigError,
        match=rf"restore_sharded: mesh must be a jax.sharding.Mesh, got {mesh!r} "
        rf"\({type(mesh).__name__}\)",
    ):
        restore_sharded(path, state.model, OPT, mesh=mesh)
    assert sorted(os.listdir(tmp_path)) == before
