"""Checkpoints: bit-exact round trips, stored configs, and clear errors."""

import hashlib
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab import CharLM, MultiHeadAttention, TransformerBlock, load, save
from blocklab._validate import ConfigError
from blocklab.training.checkpoint import CheckpointError

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
    assert loaded.init_args() == noise.init_args()
    assert loaded.stack.block(0).placement == "post" and loaded.act == "gelu"
    tokens = jnp.array([2, 3, 0, 5])
    apply = eqx.filter_jit(lambda m, t: m(t))
    np.testing.assert_array_equal(apply(loaded, tokens), apply(noise, tokens))


def test_header_stores_the_hyperparameters(model, tmp_path):
    path = save(tmp_path / "lm.ckpt", model)
    magic, checksum, line = path.read_bytes().split(b"\n")[:3]
    assert magic == b"blocklab-checkpoint 2" and checksum.startswith(b"sha256 ")
    header = json.loads(line)
    assert header["class"] == "CharLM"
    assert set(header["dtypes"]) == {"float32"}
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
    other = eqx.filter_eval_shape(  # only its config is compared
        CharLM, 28, 16, 2, 2, act="swiglu", max_len=8, key=jax.random.key(1), **OPTIONS
    )
    with pytest.raises(
        ConfigError, match="does not match.*'act': \\('gelu', 'swiglu'\\)"
    ):
        load(path, like=other)
    assert load(path, like=model).act == "gelu"


def test_truncated_file_is_refused(model, tmp_path):
    path = save(tmp_path / "lm.ckpt", model)
    blob = path.read_bytes()
    path.write_bytes(blob[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupted: expected") as e:
        load(path)
    # The file is at fault, not an argument: a ValueError, never a ConfigError.
    assert isinstance(e.value, ValueError) and not isinstance(e.value, ConfigError)
    path.write_bytes(blob[:30])  # inside the header
    with pytest.raises(CheckpointError, match="truncated or corrupted header"):
        load(path)


def test_weights_that_do_not_fit_the_stored_config(model, tmp_path):
    path = save(tmp_path / "lm.ckpt", model)
    magic, _, header, payload = path.read_bytes().split(b"\n", 3)
    meta = json.loads(header)
    meta["config"]["max_len"] = 9  # the stored position embedding has 8 rows
    body = json.dumps(meta).encode() + b"\n" + payload
    digest = hashlib.sha256(body).hexdigest().encode()
    path.write_bytes(magic + b"\nsha256 " + digest + b"\n" + body)
    with pytest.raises(CheckpointError, match="do not fit a CharLM"):
        load(path)


def test_not_a_checkpoint_or_missing(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(CheckpointError, match="not a blocklab checkpoint"):
        load(path)
    with pytest.raises(ConfigError, match="no checkpoint at"):
        load(tmp_path / "missing.ckpt")


def test_unsupported_models_are_refused(tmp_path):
    blk = TransformerBlock(8, 2, key=jax.random.key(0))
    with pytest.raises(ConfigError, match="cannot checkpoint a TransformerBlock"):
        save(tmp_path / "b.ckpt", blk)
    lm = eqx.filter_eval_shape(  # the structure is enough: nothing is written
        CharLM,
        28,
        8,
        2,
        1,
        max_len=4,
        key=jax.random.key(0),
        attn_factory=lambda key: MultiHeadAttention(8, 2, key=key),
    )
    with pytest.raises(ConfigError, match="cannot be stored as JSON"):
        save(tmp_path / "f.ckpt", lm)


def test_save_refuses_a_prng_key_leaf(model, tmp_path):
    keyed = eqx.tree_at(
        lambda m: m.token_emb.weight, model, jax.random.split(jax.random.key(0), 28)
    )
    with pytest.raises(ConfigError, match=r"PRNG key at .*token_emb.*key_data"):
        save(tmp_path / "k.eqx", keyed)


def _cast(model, dtype):
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model
    )


@pytest.mark.parametrize(
    "dtype",
    [jnp.bfloat16, jnp.float16, pytest.param(jnp.float64, marks=pytest.mark.float64)],
)
def test_low_and_high_precision_round_trips_keep_dtypes(model, tmp_path, dtype):
    """bf16 is stored by NumPy as raw 2-byte records: the header's dtypes restore it."""
    # values that float32 could not hold exactly in float64, nor bf16 in fp16
    cast = _cast(model, dtype)
    cast = eqx.tree_at(
        lambda m: m.norm.weight,
        cast,
        jnp.asarray(1 + np.arange(16) * 1e-12 + np.arange(16) * 2.0**-7, dtype),
    )
    loaded = load(save(tmp_path / "lm.ckpt", cast))
    leaves = jax.tree_util.tree_leaves(cast)
    loaded_leaves = jax.tree_util.tree_leaves(loaded)
    assert len(leaves) == len(loaded_leaves)
    for a, b in zip(leaves, loaded_leaves, strict=True):
        assert b.dtype == a.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
        )


def _v1_file(model, path):
    """A checkpoint as version 1 wrote it: no checksum line, no dtypes."""
    import io

    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, model)
    payload = buf.getvalue()
    header = {"class": "CharLM", "config": model.init_args(), "nbytes": len(payload)}
    path.write_bytes(
        b"blocklab-checkpoint 1\n" + json.dumps(header).encode() + b"\n" + payload
    )
    return path


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_version_1_files_still_load(model, tmp_path, dtype):
    old = _cast(model, dtype)
    loaded = load(_v1_file(old, tmp_path / "v1.ckpt"))
    for a, b in zip(
        jax.tree_util.tree_leaves(old), jax.tree_util.tree_leaves(loaded), strict=True
    ):
        assert b.dtype == a.dtype
        np.testing.assert_array_equal(
            np.asarray(a, np.float32), np.asarray(b, np.float32)
        )


def test_every_flipped_bit_is_refused(model, tmp_path):
    """A bit flipped anywhere (checksum line, header or weights) fails `load`."""
    path = save(tmp_path / "lm.ckpt", model)
    blob = path.read_bytes()
    start = len(b"blocklab-checkpoint 2\n")
    header_at = blob.index(b"\n", start) + 1
    payload_at = blob.index(b"\n", header_at) + 1
    rng = np.random.default_rng(0)
    positions = [start + 10, header_at + 3, payload_at + 200, len(blob) - 1]
    positions += list(rng.integers(start, len(blob), 40))
    for pos in positions:
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match="corrupted|not a blocklab"):
            load(path)
    path.write_bytes(blob)
    assert load(path).init_args() == model.init_args()


def test_unsupported_version_is_named(model, tmp_path):
    path = save(tmp_path / "lm.ckpt", model)
    path.write_bytes(path.read_bytes().replace(b"checkpoint 2", b"checkpoint 7", 1))
    with pytest.raises(
        CheckpointError, match="unsupported version '7'.*versions 1 to 2"
    ):
        load(path)


def test_load_on_a_directory_is_a_value_error(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; pass the checkpoint file"):
        load(tmp_path)


@pytest.mark.parametrize("family", ["gemma3", "mixtral"])
def test_decoder_models_round_trip(tmp_path, family):
    """DecoderLM (with per-layer window / RoPE leaves) and its MoE variant
    come back with their config class and every leaf bit-exact."""
    from blocklab import DecoderConfig, DecoderLM
    from blocklab.models import MoEDecoderConfig

    cfg = (
        DecoderConfig.gemma3(num_blks=3)
        if family == "gemma3"
        else MoEDecoderConfig.mixtral(num_blks=2)
    )
    model = DecoderLM(cfg, key=jax.random.key(0))
    loaded = load(save(tmp_path / "m.ckpt", model))
    assert type(loaded.cfg) is type(cfg) and loaded.cfg == cfg
    for a, b in zip(
        jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(loaded), strict=True
    ):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decoder_files_of_version_0_2_still_load(tmp_path):
    """0.2 wrote a DecoderLM's header as {"config": <flat fields>,
    "config_class": ...}: the block's fields beside the model's. Such a file
    loads into the same model (the flat fields are DecoderConfig's keyword
    spelling)."""
    from blocklab import DecoderLM
    from blocklab.models import MoEDecoderConfig

    cfg = MoEDecoderConfig.mixtral(num_blks=2, window=4)
    model = DecoderLM(cfg, key=jax.random.key(0))
    path = save(tmp_path / "m.ckpt", model)
    magic, _, header, payload = path.read_bytes().split(b"\n", 3)
    meta = json.loads(header)
    args = meta["config"]
    flat = {k: v for k, v in args["cfg"].items() if k != "block"}
    flat.update(args["cfg"]["block"])
    meta["config"] = {"config": flat, "config_class": args["cfg_class"]}
    body = json.dumps(meta).encode() + b"\n" + payload
    digest = hashlib.sha256(body).hexdigest().encode()
    path.write_bytes(magic + b"\nsha256 " + digest + b"\n" + body)
    loaded = load(path)
    assert type(loaded.cfg) is MoEDecoderConfig and loaded.cfg == cfg
    ids = jnp.arange(6)
    np.testing.assert_array_equal(loaded(ids), model(ids))
