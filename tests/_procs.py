"""Running child processes in tests: bounded by a timeout, always ended by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


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
