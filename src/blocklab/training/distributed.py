r"""Joining a multi-process job: one call, the same user code on 1 or N processes.

`initialize()` is the only line a script needs. It decides from the
environment:

1. **`blocklab launch`** (local processes on one machine) sets
   `BLOCKLAB_COORDINATOR` (`host:port`), `BLOCKLAB_NUM_PROCESSES`,
   `BLOCKLAB_PROCESS_ID` and optionally `BLOCKLAB_INIT_TIMEOUT` /
   `BLOCKLAB_HEARTBEAT_TIMEOUT` (seconds). `initialize()` then calls
   `jax.distributed.initialize` with them, binding the coordinator to that
   address, and, on CPU, selects the gloo collectives
   (`jax_cpu_collectives_implementation`) so that arrays can be gathered
   across processes.
2. **A cluster JAX detects itself** (SLURM with more than one task, Open MPI,
   a Cloud TPU pod slice): `initialize()` calls `jax.distributed.initialize()`
   without arguments and JAX reads the coordinator, process count and id from
   the cluster.
3. **Otherwise** (a plain single process) it does nothing.

After it, `jax.devices()` lists the devices of every process, so
`blocklab.member_mesh()` (and every sweep) spans them all; each process runs
the same program and holds its own members. Results are gathered with
`jax.experimental.multihost_utils.process_allgather` (`train_sweep` does it
for you), and files are written once, by process 0 (`is_main_process()`,
`save_once`).

Before JAX's join, the processes meet in Python on the coordinator's port
(a pre-join handshake): process 0 listens there and waits for a line
`blocklab-join <id> <N>` from each of the processes 1 .. N-1, answers each
`go`, closes, and only then calls `jax.distributed.initialize` on the same
port; the others retry connecting until the timeout. So a process that never
joins makes the others raise `RuntimeError` after `BLOCKLAB_INIT_TIMEOUT`
seconds (default 60 under the launcher): process 0 names the missing
process ids, the address and the timeout, instead of being aborted by JAX
(SIGABRT with a C++ stack). A duplicate process id, an id outside 1 .. N-1 or
a different N is refused at once, on both sides. A process that dies after
the handshake is noticed by the coordination service's heartbeat after
`BLOCKLAB_HEARTBEAT_TIMEOUT` seconds (default 10).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from .._validate import ConfigError

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_INIT_TIMEOUT",
    "ENV_HEARTBEAT_TIMEOUT",
    "Job",
    "barrier",
    "initialize",
    "is_main_process",
    "save_once",
]

ENV_COORDINATOR = "BLOCKLAB_COORDINATOR"
ENV_NUM_PROCESSES = "BLOCKLAB_NUM_PROCESSES"
ENV_PROCESS_ID = "BLOCKLAB_PROCESS_ID"
ENV_INIT_TIMEOUT = "BLOCKLAB_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "BLOCKLAB_HEARTBEAT_TIMEOUT"

_DEFAULT_INIT_TIMEOUT = 60
_DEFAULT_HEARTBEAT_TIMEOUT = 10


@dataclass(frozen=True)
class Job:
    """The job this process belongs to (what `initialize` returns).

    Attributes:
        process_id: this process's index, `0 .. num_processes - 1`.
        num_processes: processes in the job (1 for a plain process).
        source: `"single"`, `"blocklab-launch"`, `"cluster"` (JAX's own
            detection) or `"already"` (JAX was initialized before).
    """

    process_id: int
    num_processes: int
    source: str


def _env_int(name: str, default: int | None = None, *, min: int = 0) -> int:  # noqa: A002
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"initialize: {name} is not set.")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"initialize: environment variable {name} must be an int, got {raw!r}."
        ) from None
    if value < min:
        raise ConfigError(f"initialize: {name} must be >= {min}, got {value}.")
    return value


def check_address(address: str) -> str:
    """`host:port` (IPv6 hosts in brackets, `[::1]:1234`), port in 1..65535."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 host must be bracketed
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(
            f"initialize: {ENV_COORDINATOR} must be host:port, got {address!r} "
            "(a port in 1..65535; an IPv6 host in brackets, e.g. [::1]:1234)."
        )
    return address


def _check_slurm() -> None:
    """JAX's SLURM detection needs these; without them it asks for a
    `coordinator_address`, which names nothing the user set."""
    env = os.environ
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if tasks is None or "OMPI_COMM_WORLD_SIZE" in env:
        return
    missing = [
        v for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID")
        if v not in env
    ]  # fmt: skip
    if missing:
        raise ConfigError(
            f"initialize: SLURM_NTASKS={tasks} asks for a SLURM job, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: "
            "start the job step with srun, or unset SLURM_NTASKS, or describe the "
            f"job with {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}."
        )


_HELLO = b"blocklab-join"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _reply(conn: Any, text: str) -> None:
    """Send one line to a peer, ignoring a peer that is already gone. (No
    shutdown: the peer closes first, so the TIME_WAIT stays on its side.)"""
    try:
        conn.sendall(text.encode() + b"\n")
    except OSError:
        pass


def _gather_peers(address: str, num: int, timeout: int | float) -> None:
    r"""Process 0's side of the pre-join handshake.

    Listen on `address` (`SO_REUSEADDR`), accept connections until each of the
    processes $1 .. N-1$ has sent its line `blocklab-join <id> <N>`, answer
    every one `go` and only then return, so that `jax.distributed.initialize`
    (which aborts the whole process when a peer is missing) starts only once
    every peer is known to be alive. Each peer closes first after reading
    `go` (its end takes the TIME_WAIT, not the coordinator's port). Lines that
    are not a join are ignored (a port probe); a process id outside
    $1 .. N-1$, a different $N$, or an id that joins twice is answered
    `abort <why>` and raises here too, as does the timeout (naming the missing
    ids, the address and the timeout), after telling every waiting peer.
    """
    import selectors
    import socket
    import time

    host, port = _split(address)
    deadline = time.monotonic() + timeout
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server = socket.create_server((host, port), family=family, backlog=max(num, 8))
    except OSError as err:
        raise RuntimeError(
            f"initialize: process 0 cannot listen on the coordinator address "
            f"{address} ({err}); is another process 0 of a job using that port?"
        ) from None
    joined: dict[int, Any] = {}  # process id -> its connection
    pending: dict[Any, bytes] = {}  # connections that have not sent a full line
    sel = selectors.DefaultSelector()
    server.setblocking(False)
    sel.register(server, selectors.EVENT_READ)
    error = None
    try:
        while len(joined) < num - 1 and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num)) - set(joined))
                error = (
                    f"initialize: process 0 waited {timeout:g} s "
                    f"({ENV_INIT_TIMEOUT}) at the coordinator {address} for "
                    f"{num - 1} peer(s); process id(s) {missing} never joined "
                    f"(did they start, with {ENV_COORDINATOR}={address}?)."
                )
                break
            for sk, _ in sel.select(timeout=min(left, 0.5)):
                if sk.fileobj is server:
                    try:
                        conn, _ = server.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    pending[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = sk.fileobj
                try:
                    chunk = conn.recv(256)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                buf = pending[conn] + chunk
                if chunk and b"\n" not in buf and len(buf) < 256:
                    pending[conn] = buf
                    continue
                sel.unregister(conn)
                del pending[conn]
                parts = buf.split(b"\n")[0].split()
                if (
                    len(parts) != 3
                    or parts[0] != _HELLO
                    or not all(p.isdigit() for p in parts[1:])
                ):
                    conn.close()  # not one of ours (a probe, or closed early)
                    continue
                pid, n = int(parts[1]), int(parts[2])
                why = None
                if n != num:
                    why = (
                        f"process {pid} was started with {ENV_NUM_PROCESSES}={n}, "
                        f"process 0 with {num}"
                    )
                elif not 1 <= pid < num:
                    why = f"process id {pid} is not one of 1..{num - 1}"
                elif pid in joined:
                    why = f"process id {pid} joined twice (two processes share it)"
                if why is not None:
                    _reply(conn, f"abort {why}")
                    conn.close()
                    error = f"initialize: {why}, at the coordinator {address}."
                    break
                joined[pid] = conn
        if error is not None:
            for conn in joined.values():
                _reply(conn, "abort " + error.removeprefix("initialize: "))
            raise RuntimeError(error)
        for conn in joined.values():
            _reply(conn, "go")
        # Let each peer close first (it reads `go`, then closes), so that the
        # TIME_WAIT state stays on the peer's port, not on the coordinator's.
        for conn in joined.values():
            conn.setblocking(True)
            conn.settimeout(max(0.1, min(5.0, deadline + 5.0 - time.monotonic())))
            try:
                while conn.recv(256):
                    pass
            except OSError:
                pass
    finally:
        for conn in [*joined.values(), *pending]:
            conn.close()
        sel.close()
        server.close()


def _join_coordinator(address: str, pid: int, num: int, timeout: int | float) -> None:
    """A peer's side of the handshake (see `_gather_peers`): connect to process
    0, retrying until `timeout`, send `blocklab-join <pid> <num>`, wait for
    `go`, close first. Raises `RuntimeError` on the timeout or an `abort`."""
    import socket
    import time

    host, port = _split(address)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    connected = False
    while time.monotonic() < deadline:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=min(1.0, left)) as s:
                connected = True
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.sendall(_HELLO + f" {pid} {num}\n".encode())
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
            line = reply.decode(errors="replace").strip()
            if line == "go":
                return
            if line.startswith("abort "):
                raise RuntimeError(
                    f"initialize: process 0 at {address} refused process "
                    f"{pid}: {line[len('abort ') :]}"
                )
            last = ConnectionError(f"unexpected answer {line!r}")
        except OSError as err:  # refused, reset, timed out: retry
            last = err
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    if connected:
        raise RuntimeError(
            f"initialize: process {pid} of {num} reached the coordinator at "
            f"{address}, but process 0 did not say go within {timeout:g} s "
            f"({ENV_INIT_TIMEOUT}): another process has not joined. ({last})"
        )
    raise RuntimeError(
        f"initialize: no coordinator answered at {address} within {timeout:g} s "
        f"({ENV_INIT_TIMEOUT}) for process {pid} of {num}; is process 0 "
        f"running? ({last})"
    )


def _cluster_detected() -> bool:
    """Whether a multi-process cluster that JAX detects describes this process."""
    env = os.environ

    def count(name: str) -> int:
        try:
            return int(env.get(name, "1") or 1)
        except ValueError:
            return 1

    if max(count("SLURM_NTASKS"), count("SLURM_NPROCS")) > 1:
        return True
    if count("OMPI_COMM_WORLD_SIZE") > 1:
        return True
    # Cloud TPU pod slices: more than one worker host.
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


def initialize() -> Job:
    """Join the job described by the environment, or do nothing (see the module).

    Call it first, before any other JAX work, on every process; calling it
    again returns the same `Job`.

    Returns:
        The `Job` (process id, count, how it was found).

    Raises:
        ConfigError: a malformed `BLOCKLAB_*` variable.
        RuntimeError: the pre-join handshake failed: process 0 did not hear
            from every peer within `BLOCKLAB_INIT_TIMEOUT` seconds (the
            message names the missing process ids, the coordinator address
            and the timeout), a peer found no coordinator (or no `go`) in that
            time, process 0 cannot listen on the address, or a process id is
            duplicated, out of range or started with another process count.
    """
    if jax.distributed.is_initialized():
        return Job(jax.process_index(), jax.process_count(), "already")
    if ENV_COORDINATOR in os.environ:
        address = check_address(os.environ[ENV_COORDINATOR])
        num = _env_int(ENV_NUM_PROCESSES, min=1)
        pid = _env_int(ENV_PROCESS_ID)
        if pid >= num:
            raise ConfigError(
                f"initialize: {ENV_PROCESS_ID}={pid} must be < "
                f"{ENV_NUM_PROCESSES}={num}."
            )
        init_timeout = _env_int(ENV_INIT_TIMEOUT, _DEFAULT_INIT_TIMEOUT, min=1)
        heartbeat = _env_int(ENV_HEARTBEAT_TIMEOUT, _DEFAULT_HEARTBEAT_TIMEOUT, min=1)
        if num > 1:
            # JAX's own join aborts process 0 (SIGABRT, in C++) when a peer
            # never comes: meet every peer first, in Python, on the same port.
            if pid == 0:
                _gather_peers(address, num, init_timeout)
            else:
                _join_coordinator(address, pid, num, init_timeout)
        _use_cpu_collectives()
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=num,
            process_id=pid,
            initialization_timeout=init_timeout,
            heartbeat_timeout_seconds=heartbeat,
            coordinator_bind_address=address if pid == 0 else None,
        )
        return Job(pid, num, "blocklab-launch")
    if _cluster_detected():
        _check_slurm()
        _use_cpu_collectives()
        jax.distributed.initialize()
        return Job(jax.process_index(), jax.process_count(), "cluster")
    return Job(0, 1, "single")


def _use_cpu_collectives() -> None:
    """Cross-process collectives for CPU devices (gloo); harmless on accelerators."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_main_process() -> bool:
    """Whether this is process 0 (the one that writes files)."""
    return jax.process_index() == 0


def barrier(name: str = "blocklab") -> None:
    """Wait until every process reaches this point (no-op in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_once(path: str | Path, model: Any) -> Path:
    """`blocklab.save(path, model)` on process 0 only, then a barrier.

    Every process calls it with the same (gathered) model, e.g.
    `result.model(k)` of a `train_sweep`; the file is written once, and no
    process goes on before it exists.
    """
    from .checkpoint import save

    path = Path(path)
    error = None
    if is_main_process():
        try:
            save(path, model)
        except Exception as err:  # noqa: BLE001 - re-raised after the barrier
            error = err
    barrier(f"blocklab.save_once:{path}")
    if error is not None:
        raise error
    return path
