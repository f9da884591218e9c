"""`blocklab.training.distributed`: a plain process is left alone, a malformed job
is refused, and a 2-process sweep equals 1 process x 2 devices BIT FOR BIT."""

import json
import sys
from pathlib import Path

import jax
import pytest
from _procs import blocklab, run

from blocklab import CharLM, load
from blocklab._validate import ConfigError
from blocklab.training import distributed as distributed

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
