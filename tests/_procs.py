"""Running child processes in tests: bounded by a timeout, always ended by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap


def run(args, *, env=None, timeout=300):
    """`subprocess.run` that ends the child's whole process group (by its pid)
    on a timeout or an error; returns (returncode, stdout, stderr)."""
    env = dict(env or {})
    if "XLA_FLAGS" in env and os.environ.get("XLA_FLAGS"):
        # the child adds its flags to the suite's (a user's XLA_FLAGS), so that
        # every process of a comparison runs the same XLA configuration
        env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {env['XLA_FLAGS']}"
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    for name in list(full_env):
        if name.startswith(("BLOCKLAB_COORDINATOR", "BLOCKLAB_NUM_PROCESSES",
                            "BLOCKLAB_PROCESS_ID", "SLURM_", "OMPI_")):  # fmt: skip
            del full_env[name]
    full_env.update(env)
    p = subprocess.Popen(
        args, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, out, err


def blocklab(*args, **kw):
    return run([sys.executable, "-m", "blocklab.cli", *args], **kw)


def devices_env(devices):
    """The environment of a process with `devices` simulated CPU devices (added
    to the suite's XLA flags by `run`)."""
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def script_json(code, *args, devices, timeout=900):
    """Run `python -c code *args` in a fresh process with `devices` simulated
    CPU devices (fixed when JAX starts); return the JSON object it prints on
    its last line of stdout. A failed child fails the test with its stderr."""
    rc, out, err = run(
        [sys.executable, "-c", code, *args], env=devices_env(devices), timeout=timeout
    )
    assert rc == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


#: The first lines of a child script in which `import torch` and `import
#: transformers` raise ImportError (the script checks that they do).
NO_TORCH_PRELUDE = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` raises ImportError
    sys.modules["transformers"] = None
    for name in ("torch", "transformers"):
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"the shim let {name} in")
    """
)
