"""Ctrl-C that acts within seconds, and the record of what a command kept.

Python runs its signal handlers in the main thread, between two bytecodes.
A compiled JAX call (an XLA compile, a jitted training chunk) is one long C
call, so a `KeyboardInterrupt` raised the classic way waits until it returns:
75 s, once about 6 minutes, in `blocklab report`. So `blocklab` runs the
command in a worker thread (`run_interruptible`) while the main thread only
waits, and on Ctrl-C:

1. raises `KeyboardInterrupt` in the worker (`PyThreadState_SetAsyncExc`):
   at its next bytecode, so pure-Python work stops at once and a command's
   own `except KeyboardInterrupt` (`blocklab generate` keeps its text) runs;
2. waits at most `GRACE` seconds for the worker to finish;
3. if the worker is still inside a C call, returns `STILL_RUNNING`: the
   caller says what was kept and ends the process (`os._exit`).

A file being written is never cut: writes go through `shield()`, and the
interrupt waits for a shielded write to finish (and then holds the shield,
so none starts). What a command has written is recorded with `keep(...)`
(`blocklab report`: the report and its finished sections) and `kept()`
returns it for the final message.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["GRACE", "STILL_RUNNING", "keep", "kept", "reset", "run_interruptible",
           "shield"]  # fmt: skip

#: Seconds the worker gets to stop by itself after Ctrl-C.
GRACE = 2.0

#: `run_interruptible`'s answer when the work is still inside a C call.
STILL_RUNNING = object()

_shield = threading.Lock()
_kept: dict[str, Any] = {}


def reset() -> None:
    """Forget what earlier commands kept (one command per `main`)."""
    _kept.clear()


def keep(**items: Any) -> None:
    """Record what the command has written so far (strict-JSON values)."""
    _kept.update(items)


def kept() -> dict[str, Any]:
    """What the command recorded with `keep` (a copy)."""
    return dict(_kept)


@contextlib.contextmanager
def shield() -> Iterator[None]:
    """Hold an interrupt back while the body runs (a file being written)."""
    with _shield:
        yield


def _raise_in(thread: threading.Thread) -> None:
    """Raise `KeyboardInterrupt` in `thread` at its next bytecode."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
    )


def run_interruptible(
    fn: Callable[[], Any],
    *,
    grace: float = GRACE,
    on_interrupt: Callable[[], None] | None = None,
) -> Any:
    """`fn()` in a worker thread; Ctrl-C acts within `grace` seconds.

    Returns `fn`'s value or raises its exception (a `KeyboardInterrupt`
    when Ctrl-C stopped it in time). When the worker is still inside a C
    call `grace` seconds after Ctrl-C (or at a second Ctrl-C), returns
    `STILL_RUNNING` with the shield held: no write starts any more, and the
    caller ends the process. `on_interrupt()` runs at once on Ctrl-C (a
    line on stderr).
    """
    box: dict[str, Any] = {}
    # Not `Thread.join`/`is_alive`: a KeyboardInterrupt inside `join` can
    # leave the thread marked as stopped while it still runs (CPython < 3.13).
    finished = threading.Event()

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the main thread)
            box["error"] = e
        finally:
            finished.set()

    worker = threading.Thread(target=work, name="blocklab-command", daemon=True)
    worker.start()
    try:
        while not finished.wait(0.1):
            pass
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        deadline = time.monotonic() + grace
        try:
            # a write in progress finishes first; then the worker stops
            if _shield.acquire(timeout=grace):
                if not finished.is_set():
                    _raise_in(worker)
                _shield.release()
            while not finished.is_set() and time.monotonic() < deadline:
                finished.wait(0.05)
        except KeyboardInterrupt:  # a second Ctrl-C: now
            pass
        if not finished.is_set():
            _shield.acquire(timeout=grace)  # no write starts any more
            return STILL_RUNNING
    if "error" in box:
        raise box["error"]
    return box.get("value")


def flush() -> None:
    """Flush stdout and stderr before `os._exit`."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
