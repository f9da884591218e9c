"""The suite's guard against jaxlib 0.10.2 / 0.11.0's YNNPACK crashes
(tests/conftest.py): the flag is set, and the upstream reproducer
(jax-ml/jax#40412), which segfaults without it, runs in a fresh interpreter
that inherits the suite's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

AFFECTED = version("jaxlib") in ("0.10.2", "0.11.0")

REPRO = """
import jax, jax.numpy as jnp
S = (3, 1, 2, 2, 8, 8, 8)
u = jax.random.normal(jax.random.key(0), S, jnp.float32)
v = jax.random.normal(jax.random.key(1), S, jnp.float32)
out = jax.jit(lambda a, b: jnp.sum(a * b, axis=3))(u, v)
ref = (u * v).sum(axis=3)  # eager: one op at a time
print(float(abs(out - ref).max()))
"""


@pytest.mark.skipif(not AFFECTED, reason="only jaxlib 0.10.2 and 0.11.0 need it")
def test_ynnpack_fusions_are_off_and_the_reproducer_runs():
    assert "--xla_cpu_experimental_ynn_fusion_type=" in os.environ["XLA_FLAGS"]
    run = subprocess.run(
        [sys.executable, "-c", REPRO], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert float(run.stdout.strip().splitlines()[-1]) < 1e-5
