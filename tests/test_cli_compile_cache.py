"""The CLI's persistent compilation cache and its compile notices (issue 37, item 5).

As the program, `blocklab` writes its compiled programs into the user's cache
folder (`$XDG_CACHE_HOME/blocklab/jax`); `--no-compile-cache` leaves that
folder untouched. That a second run is faster is measured, not asserted:
benchmarks/compile_cache.py.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from _procs import run

from blocklab.cli import _compile

TINY = ["norms", "--shape", "4", "8", "--reps", "1", "--json"]


def _blocklab(xdg: Path, *extra: str):
    env = {"XDG_CACHE_HOME": str(xdg), "JAX_COMPILATION_CACHE_DIR": "",
           "BLOCKLAB_COMPILE_CACHE": ""}  # fmt: skip
    rc, out, err = run(
        [sys.executable, "-c", "import os, sys\n"
         "for k in ('JAX_COMPILATION_CACHE_DIR', 'BLOCKLAB_COMPILE_CACHE'):\n"
         "    os.environ.pop(k, None)\n"
         "from blocklab.cli import main\nsys.exit(main())",
         *TINY, *extra],
        env=env, timeout=300,
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    return out


@pytest.mark.slow  # CI time: the default suite keeps the cheaper checks of this feature
def test_the_cache_folder_gets_entries_and_the_flag_leaves_it_empty(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    _blocklab(on)
    entries = list((on / "blocklab" / "jax").iterdir())
    assert len(entries) >= 3, entries  # every compile, the smallest included
    _blocklab(off, "--no-compile-cache")
    folder = off / "blocklab" / "jax"
    assert not folder.exists() or not any(folder.iterdir())


def test_where_the_cache_goes(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(_compile.ENV, raising=False)
    assert _compile.cache_setting() == tmp_path / "blocklab" / "jax"
    assert _compile.cache_setting(no_cache=True) is None
    for off in ("off", "0", "false", "OFF"):
        monkeypatch.setenv(_compile.ENV, off)
        assert _compile.cache_setting() is None
    monkeypatch.setenv(_compile.ENV, str(tmp_path / "mine"))
    assert _compile.cache_setting() == tmp_path / "mine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv(_compile.ENV)
    if sys.platform.startswith("linux"):
        assert _compile.cache_setting() == Path.home() / ".cache" / "blocklab" / "jax"


def test_a_long_compile_is_announced(monkeypatch):
    """JAX's compile events reach the notices with the function's name: with a
    threshold of 0 s the compile is announced while it runs, and its end."""
    lines = []

    class Now(_compile.CompileNotices):
        def _on_scalar(self, event, value, **kw):
            super()._on_scalar(event, value, **kw)
            self.check()  # as the polling thread would, past the threshold

    with Now(threshold=0.0, write=lines.append, poll=60.0):

        @jax.jit
        def announced_fn(x):
            return jnp.tanh(x) * 3.0

        announced_fn(jnp.ones(7)).block_until_ready()
    assert any(
        line.startswith("blocklab: compiling") and "announced_fn" in line
        for line in lines
    ), lines
    assert any(
        line.startswith("blocklab: compiled") and "announced_fn" in line
        for line in lines
    ), lines
    before = len(lines)
    with _compile.CompileNotices(threshold=3600.0, write=lines.append, poll=0.01):
        jax.jit(lambda x: x - 1.0)(jnp.ones(5)).block_until_ready()
    assert len(lines) == before  # a short compile says nothing
