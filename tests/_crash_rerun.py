"""pytest-xdist hooks: a test that takes its worker down runs once more.

A segfault or an abort in native code kills the worker process, and no
assertion can catch it. pytest-xdist reports such a test as failed and starts
a fresh worker; these hooks (imported by tests/conftest.py) give the crashed
test one more run there instead. A second crash fails it as before, and an
ordinary failure is never run again: only `pytest_handlecrashitem`, which
xdist calls for a crash alone, reschedules. The terminal summary lists every
test that was run again.
"""

from __future__ import annotations

import pytest

_crashed: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """Put a test whose worker crashed back in the queue, once."""
    if crashitem not in _crashed:
        _crashed.append(crashitem)
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN (worker crashed)"
    return None


def pytest_terminal_summary(terminalreporter):
    if _crashed:
        terminalreporter.write_sep("=", "crashed a worker, so run again once")
        for nodeid in _crashed:
            terminalreporter.write_line(nodeid)
