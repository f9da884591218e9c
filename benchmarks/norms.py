"""Normalization cost (section 11.1.2.3, exercise 9): ours vs peers vs X -> 2X.

1. The table of `blocklab norms`: `blocklab.rms_norm` / `layer_norm` (with
   gains and shifts), Equinox's `RMSNorm` / `LayerNorm` (vmapped over the
   leading axes), Flax NNX's when flax is installed, and X -> 2X, all jitted,
   on X of shape (64, 512, 1024) float32. Each is timed fresh (a new output
   buffer per call) and donated (`donate_argnums=0`, a fresh copy of X made
   untimed before each call; for blocklab, the in-place `rms_norm_` /
   `layer_norm_`). It prints ms, GB/s (one read and one write of X), the
   number of read+write sweeps over X at the speed of 2X, the max deviation
   of ours from every peer, and the issue's targets as ratios: ours donated
   >= 0.8 x donated 2X, ours no slower than any peer in either mode.
2. `--block-rows R ...`: the in-place norms at each block size against
   donated 2X in the same run (how `blocklab.nn.inplace.BLOCK_BYTES` was chosen).

Candidates run round-robin (one call of each per round), so a shared, noisy
machine slows them alike; medians and bests over the rounds are reported.

Usage: `python benchmarks/norms.py [--shape 64 512 1024] [--reps 20] [--json]`
       `python benchmarks/norms.py --block-rows 16 64 256 1024 4096 [--reps 20]`
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, and its `signal.py`
# would shadow the standard library's `signal` module (imported by jax).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from blocklab.cli import main as cli_main  # noqa: E402
from blocklab.experiments.timing import time_call  # noqa: E402
from blocklab.nn.inplace import layer_norm_, rms_norm_  # noqa: E402


def block_rows_sweep(shape, block_rows, reps: int) -> dict:
    """Median / best ms and GB/s of the in-place norms per block size, and of 2X."""
    x = jax.random.normal(jax.random.key(0), tuple(shape), jnp.float32)
    d = shape[-1]
    w, b = jnp.full((d,), 1.5, jnp.float32), jnp.full((d,), 0.25, jnp.float32)
    cands = {"X -> 2X (donated)": jax.jit(lambda x: 2 * x, donate_argnums=0)}
    for r in block_rows:
        cands[f"rms_norm_ block_rows={r}"] = lambda x, r=r: rms_norm_(
            x, w, block_rows=r
        )
        cands[f"layer_norm_ block_rows={r}"] = lambda x, r=r: layer_norm_(
            x, w, b, block_rows=r
        )

    def fresh_copy():
        return (jnp.array(x, copy=True),)

    for fn in cands.values():
        time_call(fn, reps=1, warmup=1, make_args=fresh_copy)
    times = {k: [] for k in cands}
    for _ in range(reps):
        for k, fn in cands.items():
            times[k].append(
                time_call(fn, reps=1, warmup=0, make_args=fresh_copy).median
            )
    gb = 2 * x.nbytes / 1e9
    return {
        k: {
            "ms": 1e3 * float(np.median(t)),
            "best_ms": 1e3 * min(t),
            "gbps": gb / float(np.median(t)),
        }
        for k, t in times.items()
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--block-rows", type=int, nargs="+", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.block_rows is None:
        cli = ["norms", "--shape", *map(str, args.shape), "--reps", str(args.reps)]
        return cli_main(cli + (["--json"] if args.json else []))
    result = block_rows_sweep(args.shape, args.block_rows, args.reps)
    if args.json:
        print(json.dumps(result))
        return 0
    ref = result["X -> 2X (donated)"]["gbps"]
    print("| in-place norm | median ms | best ms | GB/s | / donated 2X |")
    print("|---|---:|---:|---:|---:|")
    for k, r in result.items():
        print(
            f"| {k} | {r['ms']:.2f} | {r['best_ms']:.2f} | {r['gbps']:.1f} | "
            f"{r['gbps'] / ref:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
