"""`blocklab.launch_local`, the library behind `blocklab launch`.

A typed result; each child's environment as `distributed.initialize()` reads
it; stderr prefixed per process; bad arguments refused before anything
starts; and nothing left running, checked by pid, when the job runs past its
timeout, when a process dies in the middle of a sweep, and when the caller is
interrupted. Every process binds only to the loopback.
"""

import io
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import blocklab as bl
from blocklab._validate import ConfigError


def gone(pid: int) -> bool:
    """Whether no process `pid` exists any more (ended and reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def end(pids) -> None:
    """Test cleanup: SIGKILL whatever a failing test left, by pid."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


ENV_AND_JSON = textwrap.dedent(
    """
    import json, os, sys
    print(f"hello from {os.environ['BLOCKLAB_PROCESS_ID']}", file=sys.stderr)
    print("not json")
    print(json.dumps({k: os.environ.get(k) for k in (
        "BLOCKLAB_COORDINATOR", "BLOCKLAB_NUM_PROCESSES", "BLOCKLAB_PROCESS_ID",
        "BLOCKLAB_INIT_TIMEOUT", "BLOCKLAB_HEARTBEAT_TIMEOUT", "XLA_FLAGS")}))
    """
)


def test_a_typed_result_and_the_environment_each_process_gets(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=7 --x=1")
    err = io.StringIO()
    r = bl.launch_local(
        [sys.executable, "-c", ENV_AND_JSON], 3, devices_per_process=2,
        init_timeout=7, heartbeat_timeout=4, stderr=err, timeout=120,
    )  # fmt: skip
    assert isinstance(r, bl.training.launcher.LaunchResult)
    assert r.processes == 3 and r.returncodes == (0, 0, 0) and len(r.pids) == 3
    assert all(gone(p) for p in r.pids)
    env = r.output()  # the last JSON line of process 0's stdout
    host, port = env["BLOCKLAB_COORDINATOR"].split(":")
    assert host == "127.0.0.1" and r.coordinator == env["BLOCKLAB_COORDINATOR"]
    assert 0 < int(port) < 65536
    assert env["BLOCKLAB_NUM_PROCESSES"] == "3" and env["BLOCKLAB_PROCESS_ID"] == "0"
    assert (env["BLOCKLAB_INIT_TIMEOUT"], env["BLOCKLAB_HEARTBEAT_TIMEOUT"]) == (
        "7",
        "4",
    )
    # the device count replaces the caller's, other flags are kept
    assert env["XLA_FLAGS"].split() == [
        "--x=1",
        "--xla_force_host_platform_device_count=2",
    ]
    assert r.stdout.startswith("not json\n")
    lines = sorted(err.getvalue().splitlines())
    assert lines == [f"[{i}] hello from {i}" for i in range(3)]
    data = r.to_json()
    assert data["output"] == env and data["returncodes"] == [0, 0, 0]
    assert data["pids"] == list(r.pids)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(cmd="python"), "cmd must be a non-empty list of str"),
        (dict(cmd=[]), "cmd must be a non-empty list of str"),
        (dict(cmd=["python", 3]), "cmd must be a non-empty list of str"),
        (dict(processes=0), "processes must lie in"),
        (dict(devices_per_process=0), "devices_per_process must lie in"),
        (dict(timeout=-1.0), "timeout must lie in"),
        (dict(init_timeout=0), "init_timeout must lie in"),
        (dict(heartbeat_timeout=0), "heartbeat_timeout must lie in"),
        (dict(stdout="out.txt"), "stdout must be a text stream"),
        (dict(stderr=3), "stderr must be a text stream"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kwargs, match, tmp_path):
    marker = tmp_path / "started"
    kwargs.setdefault("cmd", ["touch", str(marker)])
    with pytest.raises(ConfigError, match=match):
        bl.launch_local(**kwargs)
    assert not marker.exists()


def test_launcher_survives_bad_bytes_and_a_closed_sink():
    code = (
        "import sys; sys.stderr.buffer.write(b'bad \\xff\\xfe\\n' * 3); "
        "sys.stderr.flush(); sys.stdout.write('y' * 200000 + '\\n'); print('done')"
    )  # 200 kB: more than a pipe holds, so a dead reader would block the child
    closed = io.StringIO()
    closed.close()
    err = io.StringIO()
    with pytest.warns(RuntimeWarning, match="cannot write the output"):
        res = bl.launch_local(
            [sys.executable, "-c", code], 1, timeout=60, stdout=closed, stderr=err
        )
    assert err.getvalue().count("[0] bad \ufffd\ufffd") == 3
    assert res.stdout.endswith("done\n") and len(res.stdout) > 200000


def test_a_job_past_its_timeout_is_ended():
    t0 = time.monotonic()
    with pytest.raises(
        bl.training.launcher.LaunchError, match="ran past its timeout of 1 s"
    ) as info:
        bl.launch_local(
            [sys.executable, "-c", "import time; time.sleep(600)"], 2, timeout=1
        )
    e = info.value
    assert e.process is None and len(e.pids) == 2
    assert all(rc == -signal.SIGTERM for rc in e.returncodes)
    assert all(gone(p) for p in e.pids) and time.monotonic() - t0 < 30


# Both processes train members of one sweep. A host callback inside the
# compiled loss counts the steps (on whichever host runs it) and, after 30,
# leaves a marker file; process 1 watches for it and dies then.
DIES_MID_SWEEP = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path
    from blocklab.training import distributed as distributed
    job = distributed.initialize()
    import jax
    import blocklab as bl
    marker = Path(sys.argv[1])
    data = bl.TimeMachine(seq_len=8, num_train=200, num_val=10)
    calls = [0]

    def tick():
        calls[0] += 1
        if calls[0] == 30:
            marker.touch()

    def loss(model, batch, key=None):
        jax.debug.callback(tick)
        return bl.training.losses.next_token_loss(model, batch)

    def die_after_30_steps():
        while not marker.exists():
            time.sleep(0.05)
        print("process 1 dies mid-sweep", file=sys.stderr, flush=True)
        os._exit(3)

    if job.process_id == 1:
        threading.Thread(target=die_after_30_steps, daemon=True).start()
    bl.train_sweep(
        lambda key: bl.CharLM(data.vocab_size, 16, 2, 1, max_len=8, key=key),
        data, 1_000_000, model_keys=[0, 1], data_keys=[2, 3], loss_fn=loss,
        run=bl.RunConfig(batch_size=4, steps_per_call=10, progress=False),
        sweep=bl.SweepConfig(learning_rates=1e-3, validate=False),
    )
    print("finished", flush=True)
    """
)


def test_a_process_that_dies_mid_sweep_ends_the_other(tmp_path):
    marker = tmp_path / "30-steps"
    with pytest.raises(bl.training.launcher.LaunchError) as info:
        bl.launch_local(
            [sys.executable, "-c", DIES_MID_SWEEP, str(marker)], 2,
            heartbeat_timeout=120, timeout=240, stdout=io.StringIO(),
            stderr=io.StringIO(),
        )  # fmt: skip
    e = info.value
    try:
        assert e.process == 1, str(e)
        assert marker.exists()  # 30 steps of the sweep had run
        # process 0 was ended by the launcher, not by JAX's heartbeat (120 s)
        assert time.time() - marker.stat().st_mtime < 60
        assert "process 1 of 2" in str(e) and "exit status 3" in str(e)
        assert "process 1 dies mid-sweep" in e.stderr_tail
        assert e.returncodes[1] == 3 and e.returncodes[0] != 0
        assert all(gone(p) for p in e.pids)
    finally:
        end(e.pids)


# The caller of launch_local, run as its own process and interrupted.
# (A shell's background job inherits SIGINT ignored, and Python then installs
# no KeyboardInterrupt handler: the caller restores it, as a terminal has it.)
CALLER = textwrap.dedent(
    """
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import blocklab as bl
    child = "import os, sys, time; print(os.getpid(), file=sys.stderr, flush=True);"
    bl.launch_local([sys.executable, "-c", child + " time.sleep(600)"], 2)
    """
)


def test_an_interrupted_caller_ends_every_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKLAB_")}
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER], stderr=subprocess.PIPE, env=env,
        start_new_session=True,
    )  # fmt: skip
    pids: dict[str, int] = {}
    seen = b""
    try:
        # Raw reads of the pipe (a buffered readline could hold the second
        # line in its buffer while select waits on the empty pipe).
        fd = caller.stderr.fileno()
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                seen += chunk
                for line in seen.decode(errors="replace").splitlines():
                    if line.startswith("[") and "] " in line:
                        index, pid = line.strip().split("] ", 1)
                        if pid.isdigit():
                            pids[index] = int(pid)
        assert sorted(pids) == ["[0", "[1"], seen.decode(errors="replace")[-3000:]
        assert not any(gone(p) for p in pids.values())
        os.kill(caller.pid, signal.SIGINT)
        try:  # drain its stderr meanwhile: a full pipe must not hold it up
            _, rest = caller.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(caller.pid, signal.SIGKILL)
            _, rest = caller.communicate()
            pytest.fail(f"the interrupted caller did not exit:\n{rest[-3000:]!r}")
        rest = rest.decode(errors="replace")
        assert caller.returncode != 0, rest[-2000:]  # it went on after the cleanup
        assert "KeyboardInterrupt" in rest
        time.sleep(0.2)
        assert all(gone(p) for p in pids.values())
    finally:
        end(pids.values())
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
        caller.wait()
