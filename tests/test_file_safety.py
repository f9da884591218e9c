"""No failed write destroys an earlier checkpoint, and none leaves a temporary file.

Each test saves a good checkpoint, makes a second `save` to the same path fail
part-way (a serialiser that dies after writing some bytes, a full disk, an
unserialisable config, a folder that cannot be written, a failed rename),
then checks that the first file is byte for byte what it was, still loads,
and that the folder holds nothing else. A save through a symlink writes its
target and keeps the target's mode; a folder that refuses the temporary file
is named in the error, not the temporary file.
"""

import contextlib
import os
import resource
import signal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab.training.checkpoint as ckpt
from blocklab import CharLM, MultiHeadAttention, load, save


@pytest.fixture(scope="module")
def models():
    old = CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(0))
    new = CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(1))
    return old, new


@pytest.fixture
def saved(models, tmp_path):
    path = save(tmp_path / "lm.ckpt", models[0])
    return path, path.read_bytes()


def assert_intact(path, blob, model):
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert path.read_bytes() == blob
    loaded = load(path)
    np.testing.assert_array_equal(loaded.token_emb.weight, model.token_emb.weight)


def test_serialiser_failing_part_way(models, saved, monkeypatch):
    def dies_half_way(f, model):
        f.write(b"\x93NUMPY" + b"\0" * 1000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.eqx, "tree_serialise_leaves", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        save(saved[0], models[1])
    assert_intact(*saved, models[0])


@contextlib.contextmanager
def file_size_limit(nbytes):
    """A 'full disk': writes beyond `nbytes` fail with EFBIG (RLIMIT_FSIZE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_disk_full_while_writing_the_file(models, saved):
    path, blob = saved
    with pytest.raises(OSError), file_size_limit(len(blob) // 2):
        save(path, models[1])
    assert_intact(path, blob, models[0])


def test_failed_rename_keeps_the_old_file(models, saved, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        save(saved[0], models[1])
    monkeypatch.undo()
    assert_intact(*saved, models[0])


def test_unserialisable_config_touches_nothing(models, saved):
    # the structure alone (no weights drawn): the config is checked first
    lm = eqx.filter_eval_shape(
        CharLM,
        28,
        16,
        2,
        1,
        max_len=8,
        key=jax.random.key(2),
        attn_factory=lambda key: MultiHeadAttention(16, 2, key=key),
    )
    with pytest.raises(TypeError, match="cannot be stored as JSON"):
        save(saved[0], lm)
    assert_intact(*saved, models[0])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(models, saved):
    path, blob = saved
    path.parent.chmod(0o555)
    try:
        with pytest.raises(ValueError, match="cannot be written"):
            save(path, models[1])
    finally:
        path.parent.chmod(0o755)
    assert_intact(path, blob, models[0])


def test_unwritable_folder_is_refused_before_serialising(models, saved, monkeypatch):
    """`save` checks the destination (here: a folder without write permission,
    as `os.access` reports it) before it serialises or writes anything."""
    real_access = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, **kw: False if mode & os.W_OK else real_access(p, mode),
    )
    monkeypatch.setattr(ckpt.eqx, "tree_serialise_leaves", pytest.fail)
    with pytest.raises(ValueError, match=r"save: path=.* cannot be written"):
        save(saved[0], models[1])
    monkeypatch.undo()
    assert_intact(*saved, models[0])


def test_an_unwritable_folder_is_named_not_the_temporary_file(
    models, tmp_path, monkeypatch
):
    import tempfile

    def refuse(*a, dir=None, **k):
        raise PermissionError(13, "Permission denied", f"{dir}/.m.eqx.abc.tmp.eqx")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(
        PermissionError, match=r"into the folder .*Permission denied"
    ) as err:
        save(tmp_path / "m.eqx", models[0])
    assert ".tmp" not in str(err.value)


def test_directory_as_destination(models, tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        save(tmp_path / "d", models[0])
    assert list((tmp_path / "d").iterdir()) == []


def test_a_successful_save_replaces_the_file(models, saved):
    path, _ = saved
    save(path, models[1])
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    got = load(path)
    np.testing.assert_array_equal(got.token_emb.weight, models[1].token_emb.weight)
    assert not np.array_equal(got.token_emb.weight, models[0].token_emb.weight)


def test_save_through_a_symlink_writes_the_target_and_keeps_its_mode(models, tmp_path):
    old, new = models
    real, link = tmp_path / "real.eqx", tmp_path / "link.eqx"
    save(real, old)
    real.chmod(0o600)
    link.symlink_to(real)
    save(link, new)
    assert link.is_symlink() and link.resolve() == real.resolve()
    got = load(real)
    np.testing.assert_array_equal(got.token_emb.weight, new.token_emb.weight)
    assert oct(real.stat().st_mode & 0o777) == oct(0o600)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.eqx", "real.eqx"]


def test_interrupt_during_write_keeps_the_old_file(models, saved, monkeypatch):
    def interrupted(f, model):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.eqx, "tree_serialise_leaves", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(saved[0], models[1])
    assert_intact(*saved, models[0])


def test_bf16_model_survives_a_failed_overwrite(models, tmp_path, monkeypatch):
    bf16 = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
        models[0],
    )
    path = save(tmp_path / "bf16.ckpt", bf16)
    blob = path.read_bytes()
    with pytest.raises(OSError), file_size_limit(len(blob) // 3):
        save(path, models[1])
    assert path.read_bytes() == blob
    assert load(path).token_emb.weight.dtype == jnp.bfloat16
