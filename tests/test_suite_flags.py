"""`tests/conftest.py` sets LLVM's optimisation level 0 for the suite's XLA
programs before JAX starts, keeps the caller's other flags, and keeps a level
the caller chose (checked in fresh interpreters that import the conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SHOW = (
    f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
    "import os, conftest; print(os.environ['XLA_FLAGS'])"
)


@pytest.mark.parametrize(
    "given, want",
    [
        (None, "--xla_backend_optimization_level=0"),
        ("--x=1", "--x=1 --xla_backend_optimization_level=0"),
        ("--xla_backend_optimization_level=3", "--xla_backend_optimization_level=3"),
    ],
)
def test_the_suite_compiles_at_level_0_unless_the_caller_chose(given, want):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if given is not None:
        env["XLA_FLAGS"] = given
    run = subprocess.run(
        [sys.executable, "-c", SHOW], capture_output=True, text=True,
        timeout=120, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == want
