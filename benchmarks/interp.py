"""Cost of looking inside a model: capture against the plain forward, and the
Jacobian lens (issue 32, performance).

A Llama-shaped `DecoderLM` as `from_huggingface` converts one (4 layers,
d = 256, 8 heads on 4 key/value heads, RoPE, SwiGLU, vocabulary 1000;
random weights from a `DecoderConfig`, nothing downloaded), on a batch of
4 x 128 token ids:

(a) the plain jitted forward `model(ids)`: the reference;
(b) `blocklab.interp.capture` of nothing, jitted; its lowered program must be
    (a)'s (checked on the StableHLO text, module name aside) - target 1.0x;
(c) `capture` of every `blocks.*.hook_resid_post`, jitted - target <= 1.2x;
(d) the Jacobian lens maps: `blocklab.interp.lenses.jacobians` for all
    layers over 64 tokens (one sequence, every position; reverse mode),
    lowered and compiled ahead of time into one executable, whose run is
    timed against (a). Its compile time and XLA's memory analysis
    (temporaries) are reported too.

(a)-(c) run round-robin (one call of each per round, after two warm-up
calls), so a shared, noisy machine slows them alike; medians and bests over
the rounds, every call blocked on with `block_until_ready`. (d) runs
`--jac-reps` times after one warm-up call.

Usage: `python benchmarks/interp.py [--reps 30] [--jac-reps 3] [--no-lens]
[--json]` (`--no-lens`: (a)-(c) only);
`--quick` (d = 64, 2 layers, batch 2 x 32, 8 lens tokens) runs in seconds,
as a smoke test.
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
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import blocklab  # noqa: E402
from blocklab.interp import capture  # noqa: E402
from blocklab.interp.lenses import jacobians  # noqa: E402

SITE = "blocks.*.hook_resid_post"


def _program(lowered) -> str:
    """The lowered StableHLO, its module's name (the Python function's) aside."""
    return re.sub(r"module @\S+", "module @m", lowered.as_text(), count=1)


def _once(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def capture_costs(model, ids, reps: int) -> dict:
    """(a) plain forward, (b) capture of nothing, (c) capture of every
    resid_post: median / best ms, round-robin; (b)'s program checked = (a)'s."""

    def plain(m, x):
        return m(x)

    def nothing(m, x):
        return capture(m, x, [])[0]

    def resid(m, x):
        return capture(m, x, SITE)

    cands = {"forward": plain, "capture_nothing": nothing, "capture_resid": resid}
    jitted = {k: jax.jit(f) for k, f in cands.items()}
    same = _program(jitted["forward"].lower(model, ids)) == _program(
        jitted["capture_nothing"].lower(model, ids)
    )
    if not same:
        raise AssertionError("capture of nothing lowered to another program")
    out = jitted["capture_resid"](model, ids)
    shape = tuple(out[1][SITE].shape)
    for fn in list(jitted.values()) * 2:  # compile and warm up
        _once(fn, model, ids)
    times = {k: [] for k in jitted}
    for _ in range(reps):
        for k, fn in jitted.items():
            times[k].append(_once(fn, model, ids))
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    return {
        "same_program_capture_nothing": same,
        "captured_shape": shape,
        **{f"{k}_ms": 1e3 * v for k, v in med.items()},
        **{f"best_{k}_ms": 1e3 * v for k, v in best.items()},
        "capture_nothing_over_forward": med["capture_nothing"] / med["forward"],
        "capture_resid_over_forward": med["capture_resid"] / med["forward"],
        "best_capture_resid_over_forward": best["capture_resid"] / best["forward"],
    }


def jacobian_cost(model, tokens: int, reps: int, forward_ms: float, chunk) -> dict:
    """(d): `jacobians` for all layers over one sequence of `tokens` tokens,
    every position, compiled ahead of time into one executable."""
    ids = jax.random.randint(jax.random.key(2), (1, tokens), 0, model.cfg.vocab_size)
    program = jax.jit(lambda m, x: jacobians(m, x, chunk=chunk))
    t0 = time.perf_counter()
    compiled = program.lower(model, ids).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    jac = compiled(model, ids)  # warm-up
    eye = float(jnp.abs(jac[-1] - jnp.eye(jac.shape[-1])).max())
    runs = [_once(compiled, model, ids) for _ in range(reps)]
    med = statistics.median(runs)
    d = int(jac.shape[-1])
    return {
        "tokens": tokens,
        "num_vjps": tokens * d,
        "chunk": d if chunk is None else chunk,
        "compile_s": compile_s,
        "temp_mib": None if temp is None else temp / 2**20,
        "jacobians_ms": 1e3 * med,
        "best_jacobians_ms": 1e3 * min(runs),
        "jacobians_over_forward": 1e3 * med / forward_ms,
        "last_layer_is_identity": eye == 0.0,
        "shape": tuple(int(n) for n in jac.shape),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lens-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=None, help="products per vmap")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--jac-reps", type=int, default=3)
    parser.add_argument("--no-lens", action="store_true", help="only (a)-(c)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.batch, args.seq = 2, 64, 2, 32
        args.lens_tokens, args.reps, args.jac_reps = 8, 5, 1
    cfg = blocklab.DecoderConfig.llama(
        1000, args.width, 8, args.layers, num_kv_heads=4, max_len=args.seq
    )
    model = blocklab.DecoderLM(cfg, key=jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, 1000)
    result = {
        "config": dict(
            layers=args.layers,
            d=args.width,
            heads=8,
            kv_heads=4,
            batch=args.batch,
            seq=args.seq,
            quick=args.quick,
        ),  # fmt: skip
        "threads": len(os.sched_getaffinity(0)),
        "jax": jax.__version__,
        "capture": capture_costs(model, ids, args.reps),
    }
    if not args.no_lens:
        result["jacobian_lens"] = jacobian_cost(
            model, args.lens_tokens, args.jac_reps, result["capture"]["forward_ms"],
            args.chunk,
        )  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    cap, jac = result["capture"], result.get("jacobian_lens")
    print(f"config: {result['config']}, {result['threads']} threads")
    print("| what | median ms | best ms | / forward (median) |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("forward", "(a) plain forward"),
        ("capture_nothing", "(b) capture of nothing (same program)"),
        ("capture_resid", "(c) capture of every hook_resid_post"),
    ):
        ratio = cap[f"{key}_ms"] / cap["forward_ms"]
        print(
            f"| {label} | {cap[f'{key}_ms']:.2f} | {cap[f'best_{key}_ms']:.2f} | "
            f"{ratio:.3f} |"
        )
    if jac is None:
        return 0
    print(
        f"| (d) Jacobian lens, {jac['tokens']} tokens, all layers "
        f"({jac['num_vjps']} VJPs, one executable) | {jac['jacobians_ms']:.0f} | "
        f"{jac['best_jacobians_ms']:.0f} | {jac['jacobians_over_forward']:.0f} |"
    )
    print(
        f"(d) compile {jac['compile_s']:.1f} s, temporaries "
        f"{np.nan if jac['temp_mib'] is None else jac['temp_mib']:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
