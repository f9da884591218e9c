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

Short timeouts make failures quick: a process that never joins makes the
others fail after `BLOCKLAB_INIT_TIMEOUT` seconds (default 60 under the
launcher), and one that dies is noticed by the coordination service's
heartbeat after `BLOCKLAB_HEARTBEAT_TIMEOUT` seconds (default 10).
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


def _wait_for_coordinator(address: str, timeout: int) -> None:
    """Raise `RuntimeError` if nothing listens at `address` within `timeout` s."""
    import socket
    import time

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as err:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"initialize: no coordinator answered at {address} within "
                    f"{timeout} s ({ENV_INIT_TIMEOUT}); is process 0 running? "
                    f"({err})"
                ) from None
            time.sleep(0.2)


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
        RuntimeError: a process other than 0 cannot reach the coordinator
            within `BLOCKLAB_INIT_TIMEOUT` seconds. (Process 0 whose peers
            never join is ended by JAX itself after that timeout, with
            SIGABRT; `blocklab launch` reports it as killed by signal 6.)
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
        if pid != 0:
            _wait_for_coordinator(address, init_timeout)
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
