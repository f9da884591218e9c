"""tests/_crash_rerun.py: a crashed worker's test runs once more, and only it.

A pytest session with two xdist workers runs four tests in a fresh folder: one
passes, one aborts its worker the first time only, one aborts it every time,
and one fails an assertion. Each test appends its name to a log on every run,
so the log counts the runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))

CONFTEST = f"""
import sys
sys.path.insert(0, {TESTS!r})
from _crash_rerun import (
    pytest_handlecrashitem, pytest_report_teststatus, pytest_terminal_summary,
)
"""

CASES = """
import os

LOG = os.path.join(os.path.dirname(__file__), "runs.log")


def _ran(name):
    with open(LOG, "a") as f:
        f.write(name + "\\n")
    return open(LOG).read().split().count(name)


def test_passes():
    _ran("passes")


def test_crashes_once():
    if _ran("crashes_once") == 1:
        os.abort()


def test_crashes_always():
    _ran("crashes_always")
    os.abort()


def test_fails():
    _ran("fails")
    assert 1 == 2
"""


def test_a_crashed_test_runs_again_once_and_a_failure_never(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_cases.py").write_text(textwrap.dedent(CASES))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],  # fmt: skip
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    runs = (tmp_path / "runs.log").read_text().split()
    counts = {
        n: runs.count(n) for n in ("passes", "crashes_once", "crashes_always", "fails")
    }
    assert counts == {"passes": 1, "crashes_once": 2, "crashes_always": 2, "fails": 1}
    assert out.returncode == 1, out.stdout[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "2 failed, 2 passed, 2 rerun" in summary, out.stdout[-3000:]
    failed = [ln for ln in out.stdout.splitlines() if ln.startswith("FAILED")]
    assert sorted(ln.split()[1] for ln in failed) == [
        "test_cases.py::test_crashes_always", "test_cases.py::test_fails",
    ]  # fmt: skip
    listed = out.stdout.split("crashed a worker, so run again once")[1]
    assert "test_cases.py::test_crashes_once" in listed
    assert "test_cases.py::test_crashes_always" in listed
