"""Attention implementations: memory and speed of one forward + backward pass.

A 4-layer `DecoderLM` (d = 256, 4 heads, RoPE, vocab 256), batch 1, loss =
mean next-token cross-entropy, `jax.jit(jax.grad)`:

1. Memory: the compiled program's `memory_analysis()` (temporaries plus
   arguments and outputs, i.e. the peak the program needs beyond nothing) for
   `"reference"` and `"chunked"` at T = 512 .. 4096, and `"chunked"` at
   T = 16384 (compiled only, not run). The issue's target: `"chunked"` grows
   at most 12x from 512 to 4096 (linear is 8x; the reference's logits grow
   as 64x).
2. Speed: forward + backward time at T = 2048 (CPU) of `"chunked"` and
   `"reference"`, round-robin, median of `--reps`; the ratio chunked /
   reference (target <= 1.5 on a CPU). On a GPU also `"fused"` (float32 and
   bfloat16) against the reference.

Prints human-readable lines and one JSON line. Usage:
`python benchmarks/attention.py [--reps 3] [--speed-len 2048] [--skip-speed]`.
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
import statistics  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import blocklab as bl  # noqa: E402

VOCAB = 256


def _model(T, impl, dtype=jnp.float32):
    cfg = bl.DecoderConfig(
        vocab_size=VOCAB, num_hiddens=256, num_heads=4, num_blks=4, max_len=T,
        attention_impl=impl,
    )  # fmt: skip
    model = bl.DecoderLM(cfg, key=jax.random.key(0))
    if dtype != jnp.float32:
        model = jax.tree.map(
            lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model
        )
    return model


def _step(model, ids):
    def loss(m):
        logits = m(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, ids[:, 1:]
        ).mean()

    return eqx.filter_value_and_grad(loss)(model)


def _compiled(T, impl, dtype=jnp.float32):
    """`(compiled fwd+bwd, its array arguments, ids)`: `jax.jit` of the weights."""
    dynamic, static = eqx.partition(_model(T, impl, dtype), eqx.is_array)
    ids = jnp.zeros((1, T + 1), jnp.int32)

    def step(dynamic, ids):
        return _step(eqx.combine(dynamic, static), ids)

    return jax.jit(step).lower(dynamic, ids).compile(), dynamic, ids


def _peak_bytes(T, impl, dtype=jnp.float32) -> int:
    mem = _compiled(T, impl, dtype)[0].memory_analysis()
    return int(
        mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    )


def _time(fns, reps):
    """Round-robin medians (s) of the compiled callables `fns` (name -> thunk)."""
    for f in fns.values():
        jax.block_until_ready(f())  # warm
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _thunk(T, impl, dtype=jnp.float32):
    step, dynamic, ids = _compiled(T, impl, dtype)
    ids = jax.random.randint(jax.random.key(1), ids.shape, 0, VOCAB)
    return lambda: step(dynamic, ids)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--speed-len", type=int, default=2048)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    platform = jax.devices()[0].platform
    result = {"platform": platform, "device": str(jax.devices()[0])}

    mib = 2**20
    lengths = (512, 1024, 2048, 4096)
    memory = {"reference": {}, "chunked": {}}
    for T in lengths:
        for impl in ("reference", "chunked"):
            memory[impl][T] = _peak_bytes(T, impl)
            print(f"T={T:6d} {impl:9s} peak {memory[impl][T] / mib:9.1f} MiB")
    memory["chunked"][16384] = _peak_bytes(16384, "chunked")
    print(f"T= 16384 chunked   peak {memory['chunked'][16384] / mib:9.1f} MiB")
    growth = {k: memory[k][4096] / memory[k][512] for k in ("reference", "chunked")}
    print(
        f"growth 512 -> 4096: reference {growth['reference']:.1f}x, chunked "
        f"{growth['chunked']:.1f}x (target <= 12x; linear 8x)"
    )
    result["peak_mib"] = {
        impl: {str(T): round(b / mib, 1) for T, b in v.items()}
        for impl, v in memory.items()
    }
    result["growth_512_to_4096"] = {k: round(v, 2) for k, v in growth.items()}

    if not args.skip_speed:
        T = args.speed_len
        fns = {impl: _thunk(T, impl) for impl in ("reference", "chunked")}
        if platform == "gpu":
            fns["fused"] = _thunk(T, "fused")
            fns["reference_bf16"] = _thunk(T, "reference", jnp.bfloat16)
            fns["fused_bf16"] = _thunk(T, "fused", jnp.bfloat16)
            fns["chunked_bf16"] = _thunk(T, "chunked", jnp.bfloat16)
        losses = {name: float(f()[0]) for name, f in fns.items()}
        result["loss_diff_vs_reference"] = {
            name: abs(v - losses["reference"]) for name, v in losses.items()
        }
        print("losses:", {k: round(v, 6) for k, v in losses.items()})
        med = _time(fns, args.reps)
        for name, t in med.items():
            print(f"T={T} fwd+bwd {name:15s} {t * 1e3:9.1f} ms")
        ratios = {"chunked_over_reference": med["chunked"] / med["reference"]}
        if platform == "gpu":
            ratios["reference_over_fused"] = med["reference"] / med["fused"]
            ratios["reference_over_fused_bf16"] = (
                med["reference_bf16"] / med["fused_bf16"]
            )
        for name, r in ratios.items():
            print(f"{name}: {r:.2f}")
        result["speed_len"] = T
        result["fwd_bwd_ms"] = {k: round(v * 1e3, 2) for k, v in med.items()}
        result["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
