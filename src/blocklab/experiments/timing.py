"""Timing helpers for benchmarks: wall-clock of jitted calls and machine peaks.

Benchmarks report ratios against references measured in the same run (a peer
implementation, this machine's float32 matmul peak, or its memory bandwidth),
never absolute timings in tests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = ["Timing", "time_call", "matmul_peak_flops"]


@dataclass(frozen=True)
class Timing:
    """Seconds per call over `reps` timed calls (after warm-up)."""

    median: float
    best: float
    reps: int

    @property
    def ms(self) -> float:
        """Median in milliseconds."""
        return 1e3 * self.median


def time_call(
    fn: Callable,
    *args,
    reps: int = 20,
    warmup: int = 2,
    make_args: Callable[[], tuple] | None = None,
) -> Timing:
    """Time `fn(*args)` (blocking on its result) `reps` times after `warmup` calls.

    With `make_args`, fresh arguments are built (untimed) before every call;
    that is how donated inputs (`donate_argnums`) are timed, since a donated
    buffer cannot be used twice.
    """

    def once() -> float:
        call_args = make_args() if make_args is not None else args
        jax.block_until_ready(call_args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*call_args))
        return time.perf_counter() - t0

    for _ in range(warmup):
        once()
    times = [once() for _ in range(reps)]
    return Timing(statistics.median(times), min(times), reps)


def matmul_peak_flops(n: int = 2048, dtype=jnp.float32, reps: int = 10) -> float:
    """This machine's achieved matmul rate in FLOP/s: best of `reps` n x n x n products.

    $2n^3$ floating-point operations per product; the best (not the median)
    time estimates the peak.
    """
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(jnp.matmul)
    return 2 * n**3 / time_call(matmul, a, b, reps=reps).best
