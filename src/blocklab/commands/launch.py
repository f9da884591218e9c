"""`blocklab launch`: run one command as N local processes of one JAX job.

`blocklab launch --processes N -- COMMAND ...` starts COMMAND N times on this
machine, as processes 0 .. N-1 of one `jax.distributed` job, and waits for
them. Each child gets the environment that `blocklab.distributed.initialize()`
reads:

- `BLOCKLAB_COORDINATOR=127.0.0.1:PORT` (a free port on the loopback; process
  0 binds the coordinator there and nowhere else),
- `BLOCKLAB_NUM_PROCESSES=N`, `BLOCKLAB_PROCESS_ID=i`,
- `BLOCKLAB_INIT_TIMEOUT`, `BLOCKLAB_HEARTBEAT_TIMEOUT` (short: a process that
  never joins, or dies, is noticed within seconds),
- `JAX_PLATFORMS=cpu` unless set (CPU collectives: gloo), and with
  `--devices-per-process D`, `XLA_FLAGS=--xla_force_host_platform_device_count=D`.

Process 0's stdout is this command's stdout (every process runs the same
program, so the others' would repeat it); every process's stderr is passed
through with a `[i]` prefix. When one process fails (a non-zero exit, or it
could not start), every other one is ended (SIGTERM to its process group, by
pid, then SIGKILL) and the launch fails with an error naming the process,
its exit status and its last lines of stderr. `--timeout` bounds the whole
job. With `--json`, one JSON object: the processes' exit statuses, the wall
time and process 0's output (parsed when it is JSON).

Scripts and `blocklab` commands that call `blocklab.distributed.initialize()`
(the `blocklab` CLI does, for every command) run unchanged under it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .._validate import ConfigError, check_int
from ..distributed import (
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

NAME = "launch"
HELP = "run a command as N local processes of one JAX job (blocklab launch -- CMD)"

__all__ = ["free_port", "launch"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--processes", type=int, default=2, metavar="N", help="processes (default 2)"
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="D",
        help="simulated CPU devices per process (XLA_FLAGS); default: JAX's",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="end every process and fail after S seconds (default: no limit)",
    )
    parser.add_argument(
        "--init-timeout",
        type=int,
        default=60,
        metavar="S",
        help="seconds for every process to join the job (default 60)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=10,
        metavar="S",
        help="seconds after which a silent process counts as dead (default 10)",
    )
    parser.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="the command every process runs",
    )


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError(
            "blocklab launch: give the command after --, e.g. blocklab launch "
            "--processes 2 -- python train.py"
        )
    return cmd


def validate(args: argparse.Namespace) -> None:
    owner = "blocklab launch"
    check_int(owner, "--processes", args.processes, min=1)
    check_int(owner, "--devices-per-process", args.devices_per_process, min=1,
              optional=True)  # fmt: skip
    check_int(owner, "--init-timeout", args.init_timeout, min=1)
    check_int(owner, "--heartbeat-timeout", args.heartbeat_timeout, min=1)
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"{owner}: --timeout must be > 0, got {args.timeout}.")
    _command(args)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(cmd: list[str]) -> list[str]:
    # `blocklab` may not be on PATH (e.g. an uninstalled checkout).
    if cmd[0] == "blocklab" and shutil.which("blocklab") is None:
        return [sys.executable, "-m", "blocklab.cli", *cmd[1:]]
    return cmd


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _pump(stream, sink, prefix: str, keep: collections.deque, lines: list | None):
    """Copy lines of a child's pipe to `sink` (with `prefix`), keeping the tail."""
    for line in iter(stream.readline, ""):
        keep.append(line.rstrip("\n"))
        if lines is not None:
            lines.append(line)
        if sink is not None:
            sink.write(prefix + line)
            sink.flush()
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


def launch(
    cmd: list[str],
    processes: int,
    *,
    devices_per_process: int | None = None,
    timeout: float | None = None,
    init_timeout: int = 60,
    heartbeat_timeout: int = 10,
    stream_stdout: bool = True,
) -> dict[str, Any]:
    """Run `cmd` as `processes` local processes of one job; see the module.

    Returns:
        `{"processes", "coordinator", "returncodes", "seconds", "stdout"}`
        (`stdout`: process 0's output).

    Raises:
        ChildProcessError: a process could not start, failed, or the job ran
            past `timeout`; every process has been ended.
    """
    cmd = _resolve(cmd)
    address = f"127.0.0.1:{free_port()}"
    base = dict(os.environ)
    base.setdefault("JAX_PLATFORMS", "cpu")
    if devices_per_process is not None:
        flags = base.get("XLA_FLAGS", "")
        flags = " ".join(
            f
            for f in flags.split()
            if not f.startswith("--xla_force_host_platform_device_count")
        )
        base["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
        ).strip()
    base.update(
        {
            ENV_COORDINATOR: address,
            ENV_NUM_PROCESSES: str(processes),
            ENV_INIT_TIMEOUT: str(init_timeout),
            ENV_HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
        }
    )
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    tails = [collections.deque(maxlen=20) for _ in range(processes)]
    out_tails = [collections.deque(maxlen=20) for _ in range(processes)]
    stdout0: list[str] = []
    t0 = time.monotonic()
    failure, failed = None, 0
    try:
        for i in range(processes):
            env = dict(base, **{ENV_PROCESS_ID: str(i)})
            try:
                p = subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                    start_new_session=True,  # its own process group, ended by pid
                )
            except OSError as err:
                raise ChildProcessError(
                    f"blocklab launch: process {i} of {processes} could not start "
                    f"{cmd[0]!r}: {err}"
                ) from err
            procs.append(p)
            sink = sys.stdout if (i == 0 and stream_stdout) else None
            for stream, dest, prefix, keep, lines in (
                (p.stdout, sink, "", out_tails[i], stdout0 if i == 0 else None),
                (p.stderr, sys.stderr, f"[{i}] ", tails[i], None),
            ):
                t = threading.Thread(
                    target=_pump, args=(stream, dest, prefix, keep, lines), daemon=True
                )
                t.start()
                threads.append(t)
        while True:
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i = failed = bad[0]
                failure = (
                    f"process {i} of {processes} (pid {procs[i].pid}) failed "
                    f"after {time.monotonic() - t0:.1f} s: {_describe(codes[i])}"
                )
                break
            if all(c == 0 for c in codes):
                break
            if timeout is not None and time.monotonic() - t0 > timeout:
                live = [i for i, c in enumerate(codes) if c is None]
                failure = (
                    f"the job ran past --timeout {timeout:g} s (processes {live} "
                    "still running)"
                )
                break
            time.sleep(0.05)
    finally:
        _end(procs)
        for t in threads:
            t.join(timeout=5)
    seconds = time.monotonic() - t0
    codes = [p.returncode for p in procs]
    if failure is not None:
        tail = "\n".join(list(tails[failed])[-8:])
        raise ChildProcessError(
            f"blocklab launch: {failure}; ended the other processes (exit "
            f"statuses {codes}). Last stderr lines of process {failed}:\n{tail}"
        )
    return {
        "processes": processes,
        "coordinator": address,
        "returncodes": codes,
        "seconds": seconds,
        "stdout": "".join(stdout0),
    }


def _parse_json(text: str) -> Any:
    """Process 0's output as JSON (its last JSON line), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        for line in reversed(text.splitlines()):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return text


def run(args: argparse.Namespace) -> int:
    result = launch(
        _command(args),
        args.processes,
        devices_per_process=args.devices_per_process,
        timeout=args.timeout,
        init_timeout=args.init_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        stream_stdout=not args.json,
    )
    if args.json:
        output = _parse_json(result.pop("stdout"))
        print(json.dumps({**result, "output": output}))
    else:
        print(
            f"blocklab launch: {result['processes']} processes finished in "
            f"{result['seconds']:.1f} s",
            file=sys.stderr,
        )
    return 0
