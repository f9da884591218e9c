"""`blocklab.training.distributed`: a plain process is left alone, a malformed job
is refused, and a 2-process sweep equals 1 process x 2 devices BIT FOR BIT.

The multi-process join meets every peer in Python first: process 0 whose peer
never starts raises `RuntimeError` naming it (no SIGABRT), a late peer still
joins, duplicate / unknown ids and a different process count are refused on
both sides. Every child process is ended by its pid.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import pytest
from _procs import blocklab, run

from blocklab import CharLM, load
from blocklab._validate import ConfigError
from blocklab.training import distributed
from blocklab.training.launcher import free_port

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "research_sweep.py")
ENV = (
    "COORDINATOR",
    "NUM_PROCESSES",
    "PROCESS_ID",
    "INIT_TIMEOUT",
    "HEARTBEAT_TIMEOUT",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(f"BLOCKLAB_{name}", raising=False)
    for name in ("SLURM_NTASKS", "SLURM_NPROCS", "OMPI_COMM_WORLD_SIZE",
                 "TPU_WORKER_HOSTNAMES"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_plain_process_is_left_alone(clean_env):
    job = distributed.initialize()
    assert job == distributed.Job(0, 1, "single")
    assert not jax.distributed.is_initialized()
    assert distributed.is_main_process()
    distributed.barrier()  # a no-op in one process


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"COORDINATOR": "localhost"}, "must be host:port, got 'localhost'"),
        ({"COORDINATOR": "127.0.0.1:1", "NUM_PROCESSES": "two", "PROCESS_ID": "0"},
         "BLOCKLAB_NUM_PROCESSES must be an int, got 'two'"),
        ({"COORDINATOR": "127.0.0.1:1", "NUM_PROCESSES": "2", "PROCESS_ID": "2"},
         "BLOCKLAB_PROCESS_ID=2 must be < BLOCKLAB_NUM_PROCESSES=2"),
        ({"COORDINATOR": "127.0.0.1:1", "NUM_PROCESSES": "2"},
         "BLOCKLAB_PROCESS_ID is not set"),
        ({"COORDINATOR": "127.0.0.1:1", "NUM_PROCESSES": "2", "PROCESS_ID": "0",
          "INIT_TIMEOUT": "0"}, "BLOCKLAB_INIT_TIMEOUT must be >= 1"),
    ],
)  # fmt: skip
def test_a_malformed_job_is_refused_before_joining(clean_env, env, match):
    for name, value in env.items():
        clean_env.setenv(f"BLOCKLAB_{name}", value)
    with pytest.raises(ConfigError, match=match):
        distributed.initialize()
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
    ("env", "detected"),
    [
        ({}, False),
        ({"SLURM_NTASKS": "1"}, False),
        ({"SLURM_NTASKS": "4"}, True),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
        ({"TPU_WORKER_HOSTNAMES": "host0"}, False),
        ({"TPU_WORKER_HOSTNAMES": "host0,host1"}, True),
        ({"SLURM_NTASKS": "garbage"}, False),
    ],
)
def test_cluster_detection(clean_env, env, detected):
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert distributed._cluster_detected() == detected


def test_save_once_writes_in_a_single_process(tmp_path):
    model = CharLM(28, 16, 2, 1, max_len=8, key=jax.random.key(0))
    path = distributed.save_once(tmp_path / "m.eqx", model)
    again = load(path, like=model)
    assert jax.numpy.array_equal(again.token_emb.weight, model.token_emb.weight)


# -- the job's variables and the pre-join handshake (issue 23, item 8) --------


def _free_address():
    return f"127.0.0.1:{free_port()}"


def _in_threads(*calls):
    """Run each `fn()` in a thread; return each one's result or exception."""
    results = [None] * len(calls)

    def go(i, fn):
        try:
            results[i] = fn()
        except Exception as err:  # noqa: BLE001 - returned to the test
            results[i] = err

    threads = [
        threading.Thread(target=go, args=(i, fn), daemon=True)
        for i, fn in enumerate(calls)
    ]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


@pytest.mark.parametrize(
    ("address", "ok"),
    [("127.0.0.1:99999", False), ("host:0", False), ("::1:1234", False),
     ("[::1]:1234", True), ("localhost:65535", True)],
)  # fmt: skip
def test_coordinator_addresses(address, ok):
    if ok:
        assert distributed.check_address(address) == address
    else:
        with pytest.raises(
            ConfigError,
            match=r"must be host:port, got .*port in 1..65535.*\[::1\]:1234",
        ):
            distributed.check_address(address)


def test_slurm_ntasks_alone_names_what_is_missing(clean_env):
    for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID"):
        clean_env.delenv(v, raising=False)
    clean_env.setenv("SLURM_NTASKS", "2")
    with pytest.raises(ConfigError, match="SLURM_JOB_ID, SLURM_STEP_NODELIST"):
        distributed.initialize()


def test_a_peer_without_a_coordinator_raises_runtime_error(clean_env):
    clean_env.setenv("BLOCKLAB_COORDINATOR", _free_address())
    clean_env.setenv("BLOCKLAB_NUM_PROCESSES", "2")
    clean_env.setenv("BLOCKLAB_PROCESS_ID", "1")
    clean_env.setenv("BLOCKLAB_INIT_TIMEOUT", "1")
    with pytest.raises(RuntimeError, match="no coordinator answered"):
        distributed.initialize()


def test_handshake_all_peers_join_in_any_order_and_a_probe_does_not_count():
    import socket

    from blocklab.training.distributed import _gather_peers, _join_coordinator

    addr = _free_address()
    host, port = addr.rsplit(":", 1)

    def probe():  # a port check that connects while process 0 waits, says nothing
        time.sleep(0.3)
        for _ in range(50):
            try:
                with socket.create_connection((host, int(port)), timeout=2):
                    return "connected"
            except OSError:
                time.sleep(0.05)
        return "never connected"

    # peers 2 and 1 first (they retry until process 0 listens), then process 0,
    # the probe, and peer 3 last
    res = _in_threads(
        lambda: _join_coordinator(addr, 2, 4, 10),
        lambda: _join_coordinator(addr, 1, 4, 10),
        lambda: (time.sleep(0.3), _gather_peers(addr, 4, 10))[1],
        probe,
        lambda: (time.sleep(1.5), _join_coordinator(addr, 3, 4, 10))[1],
    )
    assert res == [None, None, None, "connected", None], res
    # the port is free at once, even without SO_REUSEADDR: each peer closed
    # first, so no TIME_WAIT is left on the coordinator's port
    with socket.socket() as s:
        s.bind((host, int(port)))


@pytest.mark.parametrize(
    ("peers", "match"),
    [([(1, 3), (1, 3)], "process id 1 joined twice"),
     ([(1, 2)], "started with BLOCKLAB_NUM_PROCESSES=2, process 0 with 3"),
     ([(5, 3)], r"process id 5 is not one of 1..2")],
)  # fmt: skip
def test_handshake_refuses_duplicate_unknown_and_miscounted_peers_on_both_sides(
    peers, match
):
    from blocklab.training.distributed import _gather_peers, _join_coordinator

    addr = _free_address()
    t0 = time.monotonic()
    res = _in_threads(
        lambda: _gather_peers(addr, 3, 20),
        *[lambda p=p, n=n: _join_coordinator(addr, p, n, 20) for p, n in peers],
    )
    assert time.monotonic() - t0 < 10  # at once, not after the timeout
    assert isinstance(res[0], RuntimeError) and re.search(match, str(res[0])), res
    assert any(
        isinstance(r, RuntimeError) and "refused process" in str(r) for r in res[1:]
    )
    assert all(isinstance(r, RuntimeError) for r in res[1:]), res


def test_handshake_timeouts_name_the_missing_ids_the_address_and_the_timeout():
    from blocklab.training.distributed import _gather_peers, _join_coordinator

    addr = _free_address()
    res = _in_threads(
        lambda: _gather_peers(addr, 4, 2), lambda: _join_coordinator(addr, 2, 4, 5)
    )
    assert isinstance(res[0], RuntimeError), res
    msg = str(res[0])
    assert "[1, 3] never joined" in msg and addr in msg and "2 s" in msg
    # the peer that did come is told, not left waiting
    assert isinstance(res[1], RuntimeError) and "never joined" in str(res[1])
    # a peer alone: no coordinator
    with pytest.raises(
        RuntimeError, match=f"no coordinator answered at {addr} within 1 s"
    ):
        _join_coordinator(addr, 1, 2, 1)


JOIN = textwrap.dedent(
    """
    import json, os, sys, time
    time.sleep(float(os.environ.get("DELAY", "0")))
    from blocklab.training import distributed
    job = distributed.initialize()
    import jax, numpy as np
    from jax.experimental import multihost_utils
    seen = multihost_utils.process_allgather(np.array([jax.process_index()]))
    print(json.dumps({"job": [job.process_id, job.num_processes],
                      "seen": np.ravel(seen).tolist()}), flush=True)
    """
)


def _start(pid, addr, num, timeout, delay=0.0):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        BLOCKLAB_COORDINATOR=addr,
        BLOCKLAB_NUM_PROCESSES=str(num),
        BLOCKLAB_PROCESS_ID=str(pid),
        BLOCKLAB_INIT_TIMEOUT=str(timeout),
        DELAY=str(delay),
    )
    return subprocess.Popen(
        [sys.executable, "-c", JOIN], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _finish(procs, timeout):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return outs


def test_process_0_whose_peer_never_starts_raises_runtime_error_not_sigabrt():
    addr = _free_address()
    p0 = _start(0, addr, 2, 3)
    t0 = time.monotonic()
    ((out, err),) = _finish([p0], timeout=60)
    assert p0.returncode == 1, (p0.returncode, err[-2000:])  # not -SIGABRT
    assert time.monotonic() - t0 < 30
    last = err.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: initialize: process 0 waited 3 s"), err[
        -2000:
    ]
    assert "process id(s) [1] never joined" in last and addr in last


def test_a_peer_that_starts_late_within_the_timeout_joins():
    addr = _free_address()
    procs = [_start(0, addr, 2, 30), _start(1, addr, 2, 30, delay=3.0)]
    outs = _finish(procs, timeout=120)
    for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, (i, err[-2000:])
        res = json.loads(out.strip().splitlines()[-1])
        assert res == {"job": [i, 2], "seen": [0, 1]}


# -- a 2-process sweep equals 1 process x 2 devices ---------------------------


def _example(*extra, env=None, launch=None):
    cmd = [sys.executable, EXAMPLE, "--seeds", "1", "--json", *extra]
    if launch is None:
        rc, out, err = run(cmd, env=env, timeout=400)
    else:
        rc, out, err = blocklab("launch", *launch, "--", *cmd, timeout=400)
    assert rc == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_and_two():
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    one = _example(env=flags)
    two = _example(launch=["--processes", "2", "--init-timeout", "60"])
    return one, two


def test_two_processes_equal_one_process_with_two_devices_bit_for_bit(one_and_two):
    """K = 4 members (2 learning rates x 2 weight decays) over 2 devices: as 2
    processes x 1 device and as 1 process x 2 devices, the same layout. The
    members never communicate, so every loss and every weight must be the
    same bits (the weights through a SHA-256 of their bytes)."""
    one, two = one_and_two
    assert (one["processes"], one["devices"]) == (1, 2)
    assert (two["processes"], two["devices"]) == (2, 2)
    assert one["members"] == two["members"] == 4
    for name in ("losses", "final_accuracy", "diverged_at", "weights_sha256",
                 "learning_rate", "weight_decay", "seed"):  # fmt: skip
        assert one[name] == two[name], name  # floats via repr: exact
