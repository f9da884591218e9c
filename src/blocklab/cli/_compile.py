"""The command line's compiles: JAX's persistent compilation cache, and a line
on stderr when a compile takes long.

**Cache.** `blocklab` turns on JAX's persistent compilation cache
(`jax_compilation_cache_dir`) before any work, in the user's cache folder:
`$XDG_CACHE_HOME/blocklab/jax`, else `~/.cache/blocklab/jax` (macOS:
`~/Library/Caches/blocklab/jax`; Windows: `%LOCALAPPDATA%/blocklab/jax`).
Every compile is written (`jax_persistent_cache_min_compile_time_secs = 0`,
no size floor: JAX's defaults, 1 s and a filesystem-dependent size, leave
most of a CPU run's compiles out), so a second run of the same command
reads its programs instead of compiling them. Off with `--no-compile-cache`
or `BLOCKLAB_COMPILE_CACHE=off`; `BLOCKLAB_COMPILE_CACHE=DIR` picks the
folder; a folder the user gave JAX (`JAX_COMPILATION_CACHE_DIR`) is kept.

**Notices.** `CompileNotices` listens to JAX's compile events
(`jax.monitoring`): a compile still running after `threshold` seconds gets a
line (`compiling jit(step) ... 10 s so far`), and its end another.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["CompileNotices", "cache_dir", "cache_setting", "enable_cache"]

#: The environment variable: `off` (or 0, false, no), or a folder.
ENV = "BLOCKLAB_COMPILE_CACHE"
_OFF = {"0", "off", "false", "no", "none", ""}

#: JAX's event around every backend compile (start: a scalar, end: a duration).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def cache_dir() -> Path:
    """The user's cache folder for blocklab's compiled programs."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        base = Path(xdg)
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"])
    else:
        base = Path.home() / ".cache"
    return base / "blocklab" / "jax"


def cache_setting(no_cache: bool = False) -> Path | None:
    """The folder the cache goes to, or `None` (off: the flag or `ENV`)."""
    if no_cache:
        return None
    value = os.environ.get(ENV)
    if value is None:
        return cache_dir()
    if value.strip().lower() in _OFF:
        return None
    return Path(value).expanduser()


def enable_cache(folder: Path | None) -> Path | None:
    """Point JAX's persistent compilation cache at `folder` (None: leave it
    off). A folder already set (`JAX_COMPILATION_CACHE_DIR`) wins. Returns
    the folder in use, or None. A folder that cannot be created leaves the
    cache off (the command still runs)."""
    import jax

    if folder is None:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return folder


class CompileNotices:
    """Say on stderr when a compile runs past `threshold` seconds.

    `start()` registers the listeners and a polling thread; `stop()` removes
    them. `cached`: the persistent cache is on (the line says the next run
    skips the compile). `write(line)` prints (default: `tqdm.write` to
    stderr, which keeps progress bars intact). `events` lists
    `(fun_name, seconds)` of the compiles that were announced, for tests.
    """

    def __init__(
        self,
        threshold: float = 10.0,
        *,
        write: Callable[[str], None] | None = None,
        poll: float = 0.5,
        cached: bool = False,
    ):
        self.threshold = threshold
        self.cached = cached
        self.poll = poll
        self.write = write or _tqdm_write
        self.events: list[tuple[str, float]] = []
        self._running: dict[int, list] = {}  # thread -> [name, t0, announced]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _on_scalar(self, event, value, **kw):
        if event == _COMPILE_EVENT:
            with self._lock:
                self._running[threading.get_ident()] = [
                    str(kw.get("fun_name", "?")),
                    time.monotonic(),
                    False,
                ]

    def _on_duration(self, event, seconds, **kw):
        if event != _COMPILE_EVENT:
            return
        with self._lock:
            entry = self._running.pop(threading.get_ident(), None)
        if entry is not None and entry[2]:
            self.events.append((entry[0], float(seconds)))
            self.write(f"blocklab: compiled {entry[0]} in {seconds:.0f} s")

    def _watch(self):
        while not self._stop.wait(self.poll):
            self.check()

    def check(self) -> None:
        """Announce every compile running past the threshold (once each)."""
        now = time.monotonic()
        with self._lock:
            due = [e for e in self._running.values()
                   if not e[2] and now - e[1] >= self.threshold]  # fmt: skip
            for e in due:
                e[2] = True
        for name, t0, _ in due:
            then = "; the next run reads it from the compile cache" * self.cached
            self.write(f"blocklab: compiling {name} ({now - t0:.0f} s so far{then})")

    def start(self) -> CompileNotices:
        from jax import monitoring

        monitoring.register_scalar_listener(self._on_scalar)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        self._thread = threading.Thread(
            target=self._watch, name="blocklab-compile-notices", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        from jax import monitoring

        self._stop.set()
        for unregister, fn in (
            (monitoring.unregister_scalar_listener, self._on_scalar),
            (monitoring.unregister_event_duration_listener, self._on_duration),
        ):
            try:
                unregister(fn)
            except (AssertionError, ValueError):
                pass

    def __enter__(self) -> CompileNotices:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _tqdm_write(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)
