"""Shared test configuration: float32 by default, float64 per test, fast keys.

The suite runs in JAX's default precision, float32, as users run it. A test
whose reference needs float64 (an identity checked at 1e-12, a NumPy float64
loop, a closed form) carries `@pytest.mark.float64`: `jax_enable_x64` is on
for that test only (its setup, call and teardown) and restored afterwards, so
that a pytest-xdist worker running many tests never leaks the setting into
the next one. Arrays created at import time (module level) are float32,
whatever `JAX_ENABLE_X64` says in the environment. A fixture wider than one
test (module, class or session scope) is built in the precision of its scope,
float64 only where its module or class is marked, never in that of whichever
test first asks for it on a worker (which pytest-xdist's worksteal decides).
A cached helper has no scope: cache it per precision (as `_moe` in
tests/test_moe.py does) or give it explicit dtypes.

Slow tests carry `@pytest.mark.slow` (`pytest.param(..., marks=...)` for one
case of a parametrized test); the default run, `-m "not slow"` in
pyproject.toml, leaves them out.

A test that crashes its pytest-xdist worker (a segfault or an abort in
native code, which no assertion can catch) runs once more on a fresh worker;
a second crash fails it, and an ordinary failure is never run again. The
crashes seen here are jaxlib 0.10.2's, not blocklab's: a segfault inside
XLA's compiler (`backend_compile_and_load`; the core dump shows libgcc's
unwinder), in `test_sweep.py` and `test_proxies.py` in two runs, and
YNNPACK's reduction crash on an XLA worker thread (jax-ml/jax#39257,
#40412). The summary lists every test that was run again, and the crash's
traceback stays in the log.

The compiler crash needs a long history: replaying, in one process, the
1353 tests a crashed worker had run before it crashed reproduced the
segfault in the same compile (`generate_text`'s sliding loop), while
either half of that history alone, or the whole of it with JAX's caches
cleared between test modules, ran clean. So each module's compiled
programs are dropped when the module is done (`jax.clear_caches()`, a
module-scoped fixture): a worker then holds only the programs of the module
it is running.

The suite is compile-bound: most tests trace and compile small programs and
run them for microseconds. So it sets `--xla_backend_optimization_level=0`
in `XLA_FLAGS` before JAX starts (subprocesses inherit it; a level the
caller set is kept): XLA's HLO passes and fusions are the same, only LLVM
optimises the generated machine code less. The suite then takes about 40 %
less time on 2 CPU cores (718 s against 1239 s). Benchmarks never run under
it (tests/test_suite_flags.py checks the rule).

The `blocklab` command caches its compiled programs in the user's cache
folder by default; the processes the tests start do not
(`BLOCKLAB_COMPILE_CACHE=off`, unless the caller set it), so that a test run
neither reads nor writes the user's cache and times the same on a clean
machine. tests/test_cli_compile_cache.py turns it on for its own children.
"""

import os

_FLAGS = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _FLAGS:
    os.environ["XLA_FLAGS"] = f"{_FLAGS} --xla_backend_optimization_level=0".strip()

os.environ.setdefault("BLOCKLAB_COMPILE_CACHE", "off")

import jax  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402
from _crash_rerun import (  # noqa: E402, F401  (hooks: pytest finds them here)
    pytest_handlecrashitem,
    pytest_report_teststatus,
    pytest_terminal_summary,
)

# Module-level arrays are float32 even under JAX_ENABLE_X64=1 (the test
# modules are imported after this file).
jax.config.update("jax_enable_x64", False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run `item` with `jax_enable_x64` on iff it is marked `float64`."""
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", item.get_closest_marker("float64") is not None)
    try:
        return (yield)
    finally:
        jax.config.update("jax_enable_x64", before)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Build a fixture shared by several tests in the precision of its scope.

    `request.node` is the module, class or session the fixture lives for:
    float64 where it is marked, float32 otherwise, whichever test asked first.
    """
    if fixturedef.scope == "function":
        return (yield)
    with jax.enable_x64(request.node.get_closest_marker("float64") is not None):
        return (yield)


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_per_module():
    """Drop the module's compiled programs when it is done (see above)."""
    yield
    jax.clear_caches()


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture
def plain_python(monkeypatch):
    """No run-time type checker, as in a user's program: blocklab's own errors.

    With the suite's jaxtyping + beartype hook on, a wrong rank, a wrong
    `valid_lens` shape or a wrong type is already refused by the annotation
    (a `TypeCheckError` naming the parameter), and NumPy scalars by `int` /
    `float` hints; users normally run without it and get blocklab's own
    `ConfigError` (a `ValueError`).
    """
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
