"""One width of the μP transfer study: 8 rates x 2 seeds as one vmapped sweep
against the same 16 runs one after another, in one process.

Both sides train the same 16 μP `DecoderLM`s (Llama-style, untied head) with
`blocklab.optimizer` (Adam, warm-up), each side after a warm-up run that
compiles it; the times below are of a second, compiled run:

- sweep: `blocklab.train_sweep` over the 16 (rate, seed) members;
- sequential: `blocklab.train_model` once per member with the sweep's
  optimizer object and the member's rate written into the optimizer state (the
  rate is an injected hyperparameter, so the 16 runs share one compiled
  program; before 2026-11-30 18:00 each run built its own `blocklab.optimizer`
  and so compiled again, which the 34x H200 figure of that day includes).

The JSON also lists each member's final training loss on both sides
(`final_loss_sweep`, `final_loss_sequential`): they agree to float rounding
(~1e-6) at stable rates and part only where training is chaotic (see
benchmarks/README.md).

Prints a human-readable line and one JSON line: `{"sweep_s", "sequential_s",
"speedup" (= sequential / sweep), ...}`. Sizes follow the platform (a CPU: d =
64, 40 steps; a GPU/TPU: d = 256, 200 steps); `--width`, `--steps` override.

Run: `python benchmarks/transfer.py [--width D] [--steps N] [--json]`.
"""

from __future__ import annotations

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import blocklab as bl  # noqa: E402
from blocklab.experiments.mup import decoder_factory  # noqa: E402
from blocklab.training.step import init_state  # noqa: E402


def _num(v) -> float | None:
    v = float(v)
    return v if np.isfinite(v) else None


def main(argv=None) -> dict:
    gpu = jax.devices()[0].platform != "cpu"
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256 if gpu else 64)
    ap.add_argument("--steps", type=int, default=200 if gpu else 40)
    ap.add_argument("--batch-size", type=int, default=32 if gpu else 8)
    ap.add_argument("--seq-len", type=int, default=64 if gpu else 32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    data = bl.TimeMachine(seq_len=args.seq_len)
    lrs = [float(10.0**e) for e in np.arange(-4.0, -0.4, 0.5)]  # 8 rates
    seeds = [0, 1]
    grid = bl.sweep_grid(learning_rate=lrs, seed=seeds)
    make_w = decoder_factory("mup", 32, vocab_size=data.vocab_size, num_blks=2,
                             max_len=args.seq_len)  # fmt: skip

    def make(key):
        return make_w(args.width, key)

    opt = bl.optimizer(eqx.filter_eval_shape(make, jax.random.key(0)), optax.adam,
                       warmup_steps=10.0)  # fmt: skip
    steps, chunk = args.steps, min(args.steps, 50)

    def sweep():
        r = bl.train_sweep(
            make,
            data,
            steps,
            model_keys=grid["seed"],
            data_keys=grid["seed"] + 7,
            run=bl.RunConfig(
                batch_size=args.batch_size, steps_per_call=chunk, progress=False
            ),
            sweep=bl.SweepConfig(
                learning_rates=grid["learning_rate"], optimizer=opt, validate=False
            ),
        )
        return np.asarray(r.losses[:, -1])

    def sequential():
        # The sweep's optimizer object, its rate set in each run's state: the
        # 16 runs share one compiled chunk (a new `bl.optimizer(...)` per run
        # is a new static closure, and every run would compile again).
        out = []
        for lr, seed in zip(grid["learning_rate"], grid["seed"], strict=True):
            model = make(jax.random.key(int(seed)))
            state = eqx.tree_at(
                lambda s: s.opt_state.hyperparams["learning_rate"],
                init_state(model, opt), jnp.asarray(lr, jnp.float32),
            )  # fmt: skip
            r = bl.train_model(
                model,
                data,
                opt,
                steps,
                key=jax.random.key(int(seed) + 7),
                state=state,
                run=bl.RunConfig(
                    batch_size=args.batch_size, steps_per_call=chunk, progress=False
                ),
            )
            out.append(r.losses[-1] if len(r.losses) == steps else np.nan)
        return np.asarray(out)

    times = {}
    finals = {}
    for name, fn in (("sweep", sweep), ("sequential", sequential)):
        fn()  # compile
        t = time.perf_counter()
        finals[name] = fn()
        times[name] = time.perf_counter() - t
    both = np.isfinite(finals["sweep"]) & np.isfinite(finals["sequential"])
    result = {
        "benchmark": "transfer",
        "platform": jax.devices()[0].platform,
        "device": str(jax.devices()[0].device_kind),
        "width": args.width, "steps": steps, "members": len(lrs) * len(seeds),
        "batch_size": args.batch_size, "seq_len": args.seq_len,
        "sweep_s": times["sweep"], "sequential_s": times["sequential"],
        "speedup": times["sequential"] / times["sweep"],
        "max_final_loss_diff": (
            float(np.max(np.abs(finals["sweep"] - finals["sequential"])[both]))
            if both.any() else None
        ),
        # Per member (rate, seed): where the two sides part (see the README).
        "learning_rates": [float(v) for v in grid["learning_rate"]],
        "seeds": [int(v) for v in grid["seed"]],
        "final_loss_sweep": [_num(v) for v in finals["sweep"]],
        "final_loss_sequential": [_num(v) for v in finals["sequential"]],
    }  # fmt: skip
    print(
        f"transfer width d={args.width}, {result['members']} runs x {steps} steps on "
        f"{result['platform']}: sweep {times['sweep']:.2f} s, one after another "
        f"{times['sequential']:.2f} s, speed-up {result['speedup']:.2f}x"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
