"""Checkpoints: bit-exact round trips, stored configs, and clear errors."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab import CharLM, MultiHeadAttention, TransformerBlock, load, save

OPTIONS = dict(norm="layer", placement="post", bias=True)


@pytest.fixture(scope="module")
def model():
    return CharLM(28, 16, 2, 2, act="gelu", max_len=8, key=jax.random.key(0), **OPTIONS)


def test_round_trip_is_bit_exact(model, tmp_path):
    # perturb every weight so nothing is at its default value
    noise = jax.tree_util.tree_map(
        lambda a: (
            a + 0.1 * jnp.sin(jnp.arange(a.size).reshape(a.shape)).astype(a.dtype)
            if eqx.is_inexact_array(a)
            else a
        ),
        model,
    )
    loaded = load(save(tmp_path / "lm.ckpt", noise))
    leaves, loaded_leaves = (
        jax.tree_util.tree_leaves(noise),
        jax.tree_util.tree_leaves(loaded),
    )
    assert len(leaves) == len(loaded_leaves)
    for a, b in zip(leaves, loaded_leaves, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded.config() == noise.config()
    assert loaded.stack.block(0).placement == "post" and loaded.act == "gelu"
    tokens = jnp.array([2, 3, 0, 5])
    apply = eqx.filter_jit(lambda m, t: m(t))
    np.testing.assert_array_equal(apply(loaded, tokens), apply(noise, tokens))


def test_header_stores_the_hyperparameters(model, tmp_path):
    path = save(tmp_path / "lm.ckpt", model)
    header = json.loads(path.read_bytes().split(b"\n")[1])
    assert header["class"] == "CharLM"
    assert header["config"] == dict(
        vocab_size=28,
        num_hiddens=16,
        num_heads=2,
        num_blks=2,
        act="gelu",
        max_len=8,
        remat=False,
        unroll=2,  # the default, min(num_blks, 4)
        **OPTIONS,
    )


def test_mismatched_config_is_refused(model, tmp_path):
    path = save(tmp_path / "lm.ckpt", model)
    other = CharLM(
        28, 16, 2, 2, act="swiglu", max_len=8, key=jax.random.key(1), **OPTIONS
    )
    with pytest.raises(
        ValueError, match="does not match.*'act': \\('gelu', 'swiglu'\\)"
    ):
        load(path, like=other)
    assert load(path, like=model).act == "gelu"


def test_truncated_file_is_refused(model, tmp_path):
    path = save(tmp_path / "lm.ckpt", model)
    blob = path.read_bytes()
    path.write_bytes(blob[:-100])
    with pytest.raises(ValueError, match="truncated or corrupted: expected"):
        load(path)
    path.write_bytes(blob[:30])  # inside the header
    with pytest.raises(ValueError, match="truncated or corrupted header"):
        load(path)


def test_weights_that_do_not_fit_the_stored_config(model, tmp_path):
    path = save(tmp_path / "lm.ckpt", model)
    magic, header, payload = path.read_bytes().split(b"\n", 2)
    meta = json.loads(header)
    meta["config"]["max_len"] = 9  # the stored position embedding has 8 rows
    path.write_bytes(magic + b"\n" + json.dumps(meta).encode() + b"\n" + payload)
    with pytest.raises(ValueError, match="do not fit a CharLM"):
        load(path)


def test_not_a_checkpoint_or_missing(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ValueError, match="not a blocklab checkpoint"):
        load(path)
    with pytest.raises(ValueError, match="no checkpoint at"):
        load(tmp_path / "missing.ckpt")


def test_unsupported_models_are_refused(tmp_path):
    blk = TransformerBlock(8, 2, key=jax.random.key(0))
    with pytest.raises(TypeError, match="cannot checkpoint a TransformerBlock"):
        save(tmp_path / "b.ckpt", blk)
    lm = CharLM(
        28,
        8,
        2,
        1,
        max_len=4,
        key=jax.random.key(0),
        attn_factory=lambda key: MultiHeadAttention(8, 2, key=key),
    )
    with pytest.raises(TypeError, match="cannot be stored as JSON"):
        save(tmp_path / "f.ckpt", lm)
