"""Speed of `blocklab.signal_stats`: compile time vs depth, warm calls, vmapped seeds.

1. Compile time and warm run time of `signal_stats` (one forward and one
   backward pass through the scanned stack, all per-block statistics) on the
   chapter's setup (pre-LN MiniBlocks, d = 256, 4 heads, X of shape
   (2, 64, 256)) at depths 8, 32 and 128. The scan compiles one block, so the
   compile time should not grow with depth.
2. The 32-block call against the chapter's own implementations measured on
   this project's 2-core CPUs (eager PyTorch about 0.5 s warm; Flax NNX as
   written, eager, 3.9 s warm and 11.8 s cold) and against the FLOP limit: its
   FLOPs (counted analytically, cross-checked with XLA's cost analysis) over
   this machine's float32 matmul peak measured in the same run
   (`blocklab.experiments.timing.matmul_peak_flops`).
3. 16 seeds of the whole experiment (build, Xavier init, input, readout,
   statistics) vmapped in one compiled program (`signal_sweep`) against 16
   sequential calls of the jitted single-seed program (`signal_run`).

Usage: `python benchmarks/signal.py [--depths 8 32 128] [--seeds 16] [--json]`.
Prints Markdown tables.
"""

import os
import sys

# Run as a script, this file's folder comes first on sys.path and its name
# would shadow the standard library's `signal` module (imported by jax).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from blocklab import chapter_stack, signal_stats, signal_sweep  # noqa: E402
from blocklab.diagnostics.propagation import signal_run  # noqa: E402
from blocklab.experiments.timing import matmul_peak_flops, time_call  # noqa: E402

#: The chapter's implementations on this project's 2-core CPUs (seconds).
PEERS = {"PyTorch (eager), warm": 0.5, "Flax NNX as written, warm": 3.9}
NNX_COLD = 11.8


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", nargs="+", type=int, default=[8, 32, 128])
    p.add_argument("--seeds", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def call_flops(num_blks: int, batch: int = 2, T: int = 64, d: int = 256) -> float:
    """Matmul FLOPs of one forward + backward `signal_stats` call (analytic).

    Per block and sequence, the forward pass does 4 projections (2 T d^2 each),
    scores and mixing (2 T^2 d each) and the MLP (2 x 2 T d 4d). The backward
    pass needs input gradients of every matmul (one forward's worth) plus the
    weight gradients of W_q, W_k, W_v, W_o only (4 x 2 T d^2).
    """
    proj, attn, mlp = 4 * 2 * T * d * d, 2 * 2 * T * T * d, 2 * 2 * T * d * 4 * d
    forward = proj + attn + mlp
    return float(batch * num_blks * (2 * forward + proj))


def depth_row(depth: int, reps: int) -> dict:
    stack = chapter_stack("pre", num_blks=depth, key=jax.random.key(0))
    X = jax.random.normal(jax.random.key(1), (2, 64, 256), jnp.float32)
    key = jax.random.key(2)
    jax.block_until_ready((stack, X))
    t0 = time.perf_counter()
    jax.block_until_ready(signal_stats(stack, X, key))
    first_s = time.perf_counter() - t0
    warm = time_call(signal_stats, stack, X, key, reps=reps, warmup=1)
    params, static = eqx.partition(stack, eqx.is_array)
    fn = jax.jit(lambda p, x, k: signal_stats(eqx.combine(p, static), x, k))
    t0 = time.perf_counter()
    compiled = fn.lower(params, X, key).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(
        depth=depth,
        compile_s=compile_s,
        first_call_s=first_s,
        warm_s=warm.median,
        warm_best_s=warm.best,
        flops=call_flops(depth),
        xla_flops=float(cost.get("flops", float("nan"))),
    )


def seeds_row(num_seeds: int, reps: int) -> dict:
    keys = jax.vmap(jax.random.key)(jnp.arange(num_seeds, dtype=jnp.uint32))
    swept = time_call(lambda: signal_sweep("pre", keys), reps=reps, warmup=1)
    single = time_call(lambda: signal_run(keys[0], "pre"), reps=reps, warmup=1)

    def sequential():
        return [signal_run(k, "pre") for k in keys]

    seq = time_call(sequential, reps=max(1, reps // 2), warmup=0)
    return dict(
        seeds=num_seeds,
        vmapped_s=swept.median,
        sequential_s=seq.median,
        single_s=single.median,
        speedup=seq.median / swept.median,
    )


def main() -> None:
    args = parse()
    peak = matmul_peak_flops()
    rows = [depth_row(d, args.reps) for d in args.depths]
    seeds = seeds_row(args.seeds, max(2, args.reps // 2))
    if args.json:
        print(json.dumps({"peak_flops": peak, "depths": rows, "seeds": seeds}))
        return
    print(
        f"float32 matmul peak (this run): {peak / 1e9:.0f} GFLOP/s; "
        f"devices: {jax.devices()}\n"
    )
    print(
        "| depth | trace + compile (s) | first call (s) | warm call (s) | GFLOP (XLA) "
        "| achieved GFLOP/s | fraction of peak |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rate = r["flops"] / r["warm_s"]
        print(
            f"| {r['depth']} | {r['compile_s']:.2f} | {r['first_call_s']:.3f} | "
            f"{r['warm_s']:.3f} | {r['flops'] / 1e9:.1f} "
            f"({r['xla_flops'] / 1e9:.1f}) | "
            f"{rate / 1e9:.0f} | {rate / peak:.2f} |"
        )
    ref = next((r for r in rows if r["depth"] == 32), None)
    if ref is not None:
        limit = ref["flops"] / peak
        cold = ref["first_call_s"]
        print("\n| 32-block signal_stats vs | their time (s) | ours (s) | speed-up |")
        print("|---|---|---|---|")
        for name, t in PEERS.items():
            print(
                f"| {name} | {t:.1f} | {ref['warm_s']:.3f} | {t / ref['warm_s']:.1f}x |"
            )
        print(
            f"| Flax NNX as written, cold | {NNX_COLD:.1f} | {cold:.2f} | "
            f"{NNX_COLD / cold:.1f}x |"
        )
        print(
            f"| FLOP limit ({ref['flops'] / 1e9:.1f} GFLOP at peak) | {limit:.3f} | "
            f"{ref['warm_s']:.3f} | {limit / ref['warm_s']:.2f}x |"
        )
    print(f"\n| {seeds['seeds']} seeds of the whole experiment | time (s) | seeds/s |")
    print("|---|---|---|")
    print(
        f"| vmapped (`signal_sweep`) | {seeds['vmapped_s']:.2f} | "
        f"{seeds['seeds'] / seeds['vmapped_s']:.1f} |"
    )
    print(
        f"| sequential (`signal_run` x {seeds['seeds']}) | "
        f"{seeds['sequential_s']:.2f} | "
        f"{seeds['seeds'] / seeds['sequential_s']:.1f} |"
    )
    print(f"\nvmapped / sequential throughput: {seeds['speedup']:.2f}x")


if __name__ == "__main__":
    main()
