r"""Starting a multi-process JAX job on one machine: N local processes, one job.

`launch_local(cmd, processes=N)` runs `cmd` N times, as processes
$0 \dots N-1$ of one `jax.distributed` job, and waits for them. It is the
other half of `blocklab.training.distributed.initialize()`: each child gets the
environment that `initialize()` reads,

- `BLOCKLAB_COORDINATOR=127.0.0.1:PORT`, a port that is free on the loopback
  (process 0 binds the coordinator there and nowhere else),
- `BLOCKLAB_NUM_PROCESSES=N`, `BLOCKLAB_PROCESS_ID=i`,
- `BLOCKLAB_INIT_TIMEOUT`, `BLOCKLAB_HEARTBEAT_TIMEOUT` (short, so that a
  process that never joins, or dies, is noticed within seconds),
- `JAX_PLATFORMS=cpu` unless it is set (CPU collectives: gloo) and, with
  `devices_per_process=D`, `XLA_FLAGS=--xla_force_host_platform_device_count=D`.

Process 0's stdout goes to `stdout` (every process runs the same program, so
the others' would repeat it) and is kept in the result; every process's
stderr goes to `stderr` with a `[i] ` prefix.

Nothing is left running. When one process fails (a non-zero exit, or it
cannot start) or the job runs past `timeout`, every other process is ended
(SIGTERM to its process group, by pid; SIGKILL after a grace period) and
`LaunchError` names the process, its exit status and its last lines of
stderr. An interrupt of the caller ends them the same way before it
propagates.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

from .._validate import ConfigError, check_float, check_int
from .distributed import (
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

__all__ = ["LaunchError", "LaunchResult", "free_port", "launch_local"]

_TAIL_LINES = 20


class LaunchError(ChildProcessError):
    """A launched job failed; every process of it has been ended.

    Attributes:
        process: the index of the process that failed (`None` when the job
            ran past its timeout).
        returncodes: every process's exit status after it was ended
            (negative: the signal that ended it).
        stderr_tail: the last lines of the failed process's stderr.
        pids: the process ids of the processes that were started.
    """

    def __init__(
        self,
        message: str,
        *,
        process: int | None = None,
        returncodes: Sequence[int | None] = (),
        stderr_tail: Sequence[str] = (),
        pids: Sequence[int] = (),
    ):
        super().__init__(message)
        self.process = process
        self.returncodes = tuple(returncodes)
        self.stderr_tail = tuple(stderr_tail)
        self.pids = tuple(pids)

    def __str__(self) -> str:  # ChildProcessError would show the args tuple
        return self.args[0]


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What `launch_local` returns when every process exited with status 0.

    Attributes:
        processes: the number of processes.
        coordinator: the coordinator's `127.0.0.1:PORT`.
        returncodes: each process's exit status (all 0).
        seconds: wall time from the first start to the last exit.
        stdout: process 0's standard output.
        pids: the process ids the processes ran under.
    """

    processes: int
    coordinator: str
    returncodes: tuple[int, ...]
    seconds: float
    stdout: str
    pids: tuple[int, ...] = ()

    def output(self) -> Any:
        """Process 0's output as JSON (the whole text, else its last JSON line),
        or the text itself when none of it is JSON."""
        try:
            return json.loads(self.stdout)
        except json.JSONDecodeError:
            for line in reversed(self.stdout.splitlines()):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        return self.stdout

    def to_json(self) -> dict[str, Any]:
        """JSON data: the fields, with process 0's output parsed (`output`)."""
        return {
            "processes": self.processes,
            "coordinator": self.coordinator,
            "returncodes": list(self.returncodes),
            "pids": list(self.pids),
            "seconds": self.seconds,
            "output": self.output(),
        }


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_command(owner: str, cmd: Any) -> list[str]:
    if isinstance(cmd, str) or not isinstance(cmd, Sequence):
        raise ConfigError(
            f"{owner}: cmd must be a non-empty list of str (the program and its "
            f"arguments), got {type(cmd).__name__} {cmd!r}."
        )
    cmd = list(cmd)
    if not cmd or not all(isinstance(c, str) for c in cmd):
        raise ConfigError(
            f"{owner}: cmd must be a non-empty list of str (the program and its "
            f"arguments), got {cmd!r}."
        )
    # `blocklab` may not be on PATH (e.g. an uninstalled checkout).
    if cmd[0] == "blocklab" and shutil.which("blocklab") is None:
        return [sys.executable, "-m", "blocklab.cli", *cmd[1:]]
    return cmd


def job_environment(
    address: str,
    processes: int,
    *,
    devices_per_process: int | None = None,
    init_timeout: int = 60,
    heartbeat_timeout: int = 10,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment shared by every process of a local job (see the module);
    each process adds its own `BLOCKLAB_PROCESS_ID`."""
    env = dict(os.environ if base is None else base)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if devices_per_process is not None:
        flags = [
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(
        {
            ENV_COORDINATOR: address,
            ENV_NUM_PROCESSES: str(processes),
            ENV_INIT_TIMEOUT: str(init_timeout),
            ENV_HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
        }
    )
    return env


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _pump(stream, sink, prefix: str, keep: collections.deque, lines: list | None):
    """Copy a child's pipe line by line to `sink` (with `prefix`), keeping the tail.

    The pipe is read as bytes and decoded as UTF-8 with replacement, so no
    output can end the reader; a sink that fails (closed, full) is dropped
    with a warning and the pipe is still drained to its end, so the child
    never blocks on a full pipe.
    """
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        keep.append(line.rstrip("\n"))
        if lines is not None:
            lines.append(line)
        if sink is not None:
            try:
                sink.write(prefix + line)
                sink.flush()
            except Exception as err:  # noqa: BLE001 - keep draining the pipe
                warnings.warn(
                    f"blocklab launch: cannot write the output of {prefix or '[0] '}"
                    f"to its sink ({type(err).__name__}: {err}); the rest is only "
                    "kept in the tail.",
                    RuntimeWarning,
                    stacklevel=1,
                )
                sink = None
    stream.close()


def _end(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    """SIGTERM every live child's process group (by pid), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()


class _Job:
    """The running processes of one launch, their pipes and their tails."""

    def __init__(self, processes: int):
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.err_tails = [
            collections.deque(maxlen=_TAIL_LINES) for _ in range(processes)
        ]
        self.stdout0: list[str] = []

    def start(self, cmd, env, stdout, stderr) -> None:
        """Start every process; one that cannot start raises (`close` ends the rest)."""
        processes = len(self.err_tails)
        for i in range(processes):
            try:
                p = subprocess.Popen(
                    cmd,
                    env=dict(env, **{ENV_PROCESS_ID: str(i)}),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    bufsize=0,  # bytes; _pump decodes with replacement
                    start_new_session=True,  # its own process group, ended by pid
                )
            except OSError as err:
                raise LaunchError(
                    f"blocklab launch: process {i} of {processes} could not start "
                    f"{cmd[0]!r}: {err}",
                    process=i,
                    returncodes=[q.poll() for q in self.procs],
                    pids=[q.pid for q in self.procs],
                ) from err
            self.procs.append(p)
            out_tail = collections.deque(maxlen=_TAIL_LINES)
            for stream, sink, prefix, keep, lines in (
                (p.stdout, stdout if i == 0 else None, "", out_tail,
                 self.stdout0 if i == 0 else None),
                (p.stderr, stderr, f"[{i}] ", self.err_tails[i], None),
            ):  # fmt: skip
                t = threading.Thread(
                    target=_pump, args=(stream, sink, prefix, keep, lines), daemon=True
                )
                t.start()
                self.threads.append(t)

    def wait(self, t0: float, timeout: float | None) -> tuple[str, int | None] | None:
        """Poll until all exit 0 (None) or a failure: (what happened, which one)."""
        n = len(self.procs)
        while True:
            codes = [p.poll() for p in self.procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i = bad[0]
                return (
                    f"process {i} of {n} (pid {self.procs[i].pid}) failed after "
                    f"{time.monotonic() - t0:.1f} s: {_describe(codes[i])}",
                    i,
                )
            if all(c == 0 for c in codes):
                return None
            if timeout is not None and time.monotonic() - t0 > timeout:
                live = [i for i, c in enumerate(codes) if c is None]
                return (
                    f"the job ran past its timeout of {timeout:g} s (processes "
                    f"{live} still running)",
                    None,
                )
            time.sleep(0.05)

    def close(self) -> None:
        _end(self.procs)
        # Every process has exited: its pipes end once the pumps have read what
        # is left in them, which on a loaded machine can take seconds.
        for t in self.threads:
            t.join(timeout=30)
        alive = sum(t.is_alive() for t in self.threads)
        if alive:
            warnings.warn(
                f"blocklab launch: {alive} output reader(s) still running 30 s after "
                "every process exited (a grandchild may hold the pipe open); the "
                "output may be cut short.",
                RuntimeWarning,
                stacklevel=2,
            )


def launch_local(
    cmd: Any,
    processes: int = 2,
    *,
    devices_per_process: int | None = None,
    timeout: float | int | None = None,
    init_timeout: int = 60,
    heartbeat_timeout: int = 10,
    stdout: Any = None,
    stderr: Any = None,
) -> LaunchResult:
    """Run `cmd` as `processes` local processes of one JAX job (see the module).

    Args:
        cmd: the program and its arguments (a list of str), run unchanged by
            every process (`"blocklab"` runs `python -m blocklab.cli` when it
            is not on PATH).
        processes: N >= 1.
        devices_per_process: simulated CPU devices per process (`XLA_FLAGS`);
            `None`: JAX's default.
        timeout: seconds for the whole job (> 0), or `None` for no limit.
        init_timeout: seconds for every process to join (>= 1).
        heartbeat_timeout: seconds after which a silent process counts as
            dead (>= 1).
        stdout: a text stream process 0's stdout is copied to as it comes
            (`None`: kept only in the result).
        stderr: a text stream every process's stderr is copied to, prefixed
            `[i] ` (`None`: `sys.stderr`).

    Returns:
        A `LaunchResult`.

    Raises:
        ConfigError: a bad argument (checked before anything starts).
        LaunchError: a process could not start or failed, or the job ran past
            `timeout`; every process has been ended.
    """
    owner = "launch_local"
    cmd = _check_command(owner, cmd)
    processes = check_int(owner, "processes", processes, min=1)
    check_int(owner, "devices_per_process", devices_per_process, min=1, optional=True)
    if timeout is not None:
        timeout = check_float(owner, "timeout", timeout, min=0.0, min_open=True)
    init_timeout = check_int(owner, "init_timeout", init_timeout, min=1)
    heartbeat_timeout = check_int(owner, "heartbeat_timeout", heartbeat_timeout, min=1)
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
        # a pump thread would die on a bad sink and leave the child's pipe full
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise ConfigError(
                f"{owner}: {name} must be a text stream (with .write) or None, got "
                f"{type(stream).__name__}."
            )
    address = f"127.0.0.1:{free_port()}"
    env = job_environment(
        address, processes, devices_per_process=devices_per_process,
        init_timeout=init_timeout, heartbeat_timeout=heartbeat_timeout,
    )  # fmt: skip
    t0 = time.monotonic()
    job = _Job(processes)
    try:
        job.start(cmd, env, stdout, sys.stderr if stderr is None else stderr)
        failure = job.wait(t0, timeout)
    finally:  # also on an interrupt or a process that cannot start
        job.close()
    seconds = time.monotonic() - t0
    codes = [p.returncode for p in job.procs]
    if failure is not None:
        what, i = failure
        shown = i if i is not None else 0
        tail = list(job.err_tails[shown])[-8:]
        raise LaunchError(
            f"blocklab launch: {what}; ended the other processes (exit statuses "
            f"{codes}). Last stderr lines of process {shown}:\n" + "\n".join(tail),
            process=i,
            returncodes=codes,
            stderr_tail=tail,
            pids=[p.pid for p in job.procs],
        )
    return LaunchResult(
        processes, address, tuple(codes), seconds, "".join(job.stdout0),
        tuple(p.pid for p in job.procs),
    )  # fmt: skip
