"""The README's advice for jaxlib 0.10.2 / 0.11.0's YNNPACK crash: with
`--xla_cpu_experimental_ynn_fusion_type=` in `XLA_FLAGS`, the upstream
reproducer (jax-ml/jax#40412), which segfaults here without it, runs in a
fresh interpreter and gives the eager result."""

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
def test_with_ynnpack_fusions_off_the_reproducer_runs():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_experimental_ynn_fusion_type="
    run = subprocess.run(
        [sys.executable, "-c", REPRO],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XLA_FLAGS": flags},
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert float(run.stdout.strip().splitlines()[-1]) < 1e-5
