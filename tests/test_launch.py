"""`blocklab launch`: N local processes on the loopback; one failure ends them all
with an error naming it; a process that cannot start or never joins fails within
the timeout; `--json` is strict JSON. Every process is ended by pid."""

import sys
import textwrap

import pytest
from _procs import blocklab
from strict_json import strict_object

# Each child joins the job, gathers its process index from every process and
# prints what it saw (process 0's stdout is the launcher's).
JOIN = textwrap.dedent(
    """
    import json, os, sys
    from blocklab.training import distributed as distributed
    job = distributed.initialize()
    import jax, numpy as np
    from jax.experimental import multihost_utils
    seen = multihost_utils.process_allgather(np.array([jax.process_index()]))
    print(json.dumps({"job": [job.process_id, job.num_processes, job.source],
                      "seen": np.ravel(seen).tolist(),
                      "devices": jax.device_count(),
                      "coordinator": os.environ["BLOCKLAB_COORDINATOR"]}))
    """
)

# Process 1 dies after joining; process 0 waits for it at a barrier forever.
DIES = textwrap.dedent(
    """
    import os, sys
    from blocklab.training import distributed as distributed
    job = distributed.initialize()
    if job.process_id == 1:
        print("process 1 dies now", file=sys.stderr, flush=True)
        os._exit(3)
    distributed.barrier("never")
    """
)

# Process 1 never joins; process 0 waits for it until the init timeout.
NEVER_JOINS = textwrap.dedent(
    """
    import os, time
    if os.environ["BLOCKLAB_PROCESS_ID"] == "1":
        time.sleep(600)
    from blocklab.training import distributed as distributed
    distributed.initialize()
    """
)


def launch(*args, timeout=240):
    return blocklab("launch", *args, timeout=timeout)


def test_two_processes_join_one_job_on_the_loopback():
    rc, out, err = launch("--processes", "2", "--devices-per-process", "2", "--json",
                          "--", sys.executable, "-c", JOIN)  # fmt: skip
    assert rc == 0, err[-3000:]
    res = strict_object(out)
    assert res["returncodes"] == [0, 0]
    assert res["coordinator"].startswith("127.0.0.1:")
    child = res["output"]
    assert isinstance(child, dict), res  # process 0's JSON line, parsed
    assert child["job"] == [0, 2, "blocklab-launch"]
    assert child["seen"] == [0, 1] and child["devices"] == 4
    assert child["coordinator"] == res["coordinator"]


def test_a_process_that_dies_ends_the_others_with_an_error_naming_it():
    rc, out, err = launch("--processes", "2", "--heartbeat-timeout", "5", "--json",
                          "--", sys.executable, "-c", DIES)  # fmt: skip
    assert rc == 1
    error = strict_object(out)["error"]
    assert "process 1 of 2" in error and "exit status 3" in error
    assert "process 1 dies now" in error  # its last stderr lines
    assert "ended the other processes" in error


def test_a_process_that_never_joins_fails_within_the_init_timeout():
    rc, out, err = launch("--processes", "2", "--init-timeout", "3", "--json",
                          "--", sys.executable, "-c", NEVER_JOINS)  # fmt: skip
    assert rc == 1
    error = strict_object(out)["error"]
    assert "process 0 of 2" in error and "failed" in error


def test_a_command_that_cannot_start_is_an_error():
    rc, out, err = launch("--processes", "2", "--json", "--", "/nonexistent/cmd")
    assert rc == 1
    assert "could not start '/nonexistent/cmd'" in strict_object(out)["error"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--processes", "0", "--", "true"], "--processes must lie in [1, inf]"),
        (["--processes", "2"], "give the command after --"),
        (["--timeout", "-1", "--", "true"], "--timeout must be > 0"),
    ],
)
def test_bad_arguments_are_usage_errors(args, match):
    rc, out, _ = launch("--json", *args)
    assert rc == 2
    assert match in strict_object(out)["error"]


def test_a_json_flag_after_the_separator_belongs_to_the_command():
    code = "import sys; print(sys.argv[1:])"
    rc, out, err = launch("--processes", "1", "--", sys.executable, "-c", code,
                          "--json")  # fmt: skip
    assert rc == 0, err[-2000:]
    assert out.strip() == "['--json']"  # process 0's stdout, untouched


@pytest.mark.slow
def test_lr_sweep_runs_under_the_launcher(tmp_path):
    rc, out, err = launch(
        "--processes", "2", "--json", "--",
        "blocklab", "lr-sweep", "--quick", "--lrs", "1e-3", "1e-2", "--steps", "4",
        "--record-every", "2", "--num-hiddens", "16", "--num-blks", "1",
        "--batch-size", "4", "--seq-len", "8", "--no-progress",
        "--out", str(tmp_path), "--json",
        timeout=500,
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    res = strict_object(out)
    assert res["returncodes"] == [0, 0]
    assert res["output"]["lrs"] == [1e-3, 1e-2]
