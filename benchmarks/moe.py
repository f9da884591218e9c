"""Mixture-of-experts cost: the two dispatch paths and a training step, as ratios.

1. Dispatch. `MoEFeedForward` with top-2 routing at E = 4, 8 and 32 experts
   (each expert a SwiGLU FFN of width w = round(8d/3)), forward + backward
   (gradient of the sum of the outputs with respect to every weight) on a
   batch of tokens, with `dispatch="dense"` (every expert on every token:
   E/2 times the active FLOPs) and `dispatch="sorted"` (each token on its two
   experts, tile by tile). Both against a dense SwiGLU FFN of width 2w: the
   same active parameters and FLOPs per token, measured in the same run.
2. Training step. A CharLM whose FFNs are 8-expert top-2 MoEs against a dense
   SwiGLU CharLM with the same active parameters (FFN width 2w), one AdamW
   step each (the MoE step includes the router's auxiliary losses through
   `blocklab.training.losses.moe_loss`). Target: the MoE step within 1.5x of
   the dense one.

Usage: `python benchmarks/moe.py [--tokens 4096] [--d 128] [--batch 32]`.
Prints Markdown tables.
"""

from __future__ import annotations

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import blocklab as bl  # noqa: E402
from blocklab.experiments.timing import time_call  # noqa: E402


def _fwd_bwd(module):
    params, static = eqx.partition(module, eqx.is_inexact_array)

    @jax.jit
    def run(params, x):
        def f(p):
            return jnp.sum(eqx.combine(p, static)(x))

        return jax.value_and_grad(f)(params)

    return run, params


def dispatch_table(d: int, tokens: int, reps: int) -> list[str]:
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), (tokens, d), jnp.float32)
    w = bl.nn.ffn.ffn_width(d, "swiglu")
    dense_ffn = bl.FeedForward(d, "swiglu", ffn_width=2 * w, key=key)
    run, p = _fwd_bwd(dense_ffn)
    ref = time_call(run, p, x, reps=reps).median
    rows = [
        f"Dispatch, forward + backward, {tokens} tokens, d = {d}, expert width "
        f"{w}, top-2; reference: dense SwiGLU FFN of width {2 * w} = "
        f"{1e3 * ref:.1f} ms",
        "",
        "| experts | dense dispatch / dense FFN | sorted dispatch / dense FFN "
        "| sorted / dense dispatch |",
        "|---:|---:|---:|---:|",
    ]
    for E in (4, 8, 32):
        t = {}
        for dispatch in ("dense", "sorted"):
            moe = bl.MoEFeedForward(d, E, 2, dispatch=dispatch, key=key)
            run, p = _fwd_bwd(moe)
            t[dispatch] = time_call(run, p, x, reps=reps).median
        rows.append(
            f"| {E} | {t['dense'] / ref:.2f} | {t['sorted'] / ref:.2f} | "
            f"{t['sorted'] / t['dense']:.2f} |"
        )
    return rows


def train_table(d: int, batch: int, seq: int, dispatch: str, reps: int) -> list[str]:
    data = bl.TimeMachine(seq)
    w = bl.nn.ffn.ffn_width(d, "swiglu")

    def moe_factory(*, key):
        return bl.MoEFeedForward(d, 8, 2, dispatch=dispatch, key=key)

    def dense_factory(*, key):
        return bl.FeedForward(d, "swiglu", ffn_width=2 * w, key=key)

    opt = optax.adamw(1e-3, weight_decay=0.0)
    X, Y = data.train_batch(jax.random.key(2), batch)

    def lm(logits, Y):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), Y
        ).mean()

    moe_loss = bl.training.losses.moe_loss(lm)

    def dense_loss(model, batch, key=None):
        return lm(model(batch[0]), batch[1]), {}

    times = {}
    for name, factory, loss_fn in (
        ("dense", dense_factory, dense_loss),
        ("moe", moe_factory, moe_loss),
    ):
        model = bl.CharLM(
            data.vocab_size,
            d,
            4,
            2,
            max_len=seq,
            ffn_factory=factory,
            key=jax.random.key(0),
        )
        params, static = eqx.partition(model, eqx.is_inexact_array)
        state = opt.init(params)

        @jax.jit
        def step(params, state, X, Y, static=static, loss_fn=loss_fn):
            def f(p):
                return loss_fn(eqx.combine(p, static), (X, Y))

            (loss, _), g = jax.value_and_grad(f, has_aux=True)(params)
            updates, state = opt.update(g, state, params)
            return optax.apply_updates(params, updates), state, loss

        times[name] = time_call(step, params, state, X, Y, reps=reps).median
    return [
        f"Training step, CharLM d = {d}, 2 blocks, batch {batch} x {seq}, AdamW; "
        f"MoE: 8 experts top-2 ({dispatch} dispatch) with aux + z losses; dense: "
        f"SwiGLU width {2 * w}",
        "",
        "| dense step | MoE step | MoE / dense |",
        "|---:|---:|---:|",
        f"| {1e3 * times['dense']:.1f} ms | {1e3 * times['moe']:.1f} ms | "
        f"{times['moe'] / times['dense']:.2f} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dispatch", default="sorted", choices=["dense", "sorted"])
    parser.add_argument("--skip-train", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print("\n".join(dispatch_table(args.d, args.tokens, args.reps)))
    if not args.skip_train:
        print()
        print(
            "\n".join(
                train_table(args.d, args.batch, args.seq, args.dispatch, args.reps)
            )
        )


if __name__ == "__main__":
    main()
