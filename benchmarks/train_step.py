"""Training-step throughput of CharLM at the chapter's protocol, and Stack compile time.

1. Tokens per second of `blocklab.make_train_step` at the chapter's protocol
   (vocab 28, d = 128, 4 heads, 2 blocks, batches of 64 x 128 characters,
   AdamW), with `--fuse` steps per compiled call (`TrainStep.scan`), and its
   model-FLOPs utilization (MFU): the step's FLOPs over its time, divided by
   this machine's float32 matmul peak measured in the same run
   (`blocklab.experiments.timing.matmul_peak_flops`). The step's FLOPs are counted
   analytically (`step_flops`) and cross-checked with XLA's cost analysis.
   Beside it, the step's matrix products alone (`matmul_floor_seconds`):
   what these shapes allow on this machine, since products with a
   contraction of 32 to 128 run well below the 2048^3 peak.
2. The general step (`make_train_step`: any loss, batch source and precision)
   against the chapter's step as it was before it was generalized (kept here,
   `ChapterStep`, as the reference): the same CharLM, batches and AdamW,
   timed alternately in one run; the ratio general / chapter must stay within
   1.05. Beside them, the `precision="bf16"` step (on CPU, bfloat16 products
   are emulated and slower; the policy pays off on GPUs and TPUs).
3. Compile time of a `Stack` (forward + backward) at 8 and 64 blocks: the scan
   compiles one block whatever the depth. With `--unrolled`, the same depths
   as a Python loop over blocks, for reference.

Usage: `python benchmarks/train_step.py [--act swiglu] [--fuse 10] [--unrolled]`
(`--general-only`: only part 2).
Prints a Markdown table.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, where its signal.py
# would shadow the standard library's `signal` (imported by jax).
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import blocklab as bl  # noqa: E402
from blocklab.experiments.timing import matmul_peak_flops, time_call  # noqa: E402


def step_flops(
    vocab: int, d: int, num_blks: int, T: int, batch: int, ffn: int, gated: bool
) -> float:
    """FLOPs of one training step (forward + backward = 3 x forward matmuls).

    Per token and block: the four attention projections ($8d^2$), the FFN
    ($6df$ gated, $4df$ not), the scores and the weighted values over all $T$
    keys ($4Td$, masked entries included); plus the tied head ($2dV$).
    Elementwise work (norms, softmax, activations, AdamW) is not counted.
    """
    per_block = 8 * d * d + (6 if gated else 4) * d * ffn + 4 * T * d
    forward = num_blks * per_block + 2 * d * vocab
    return 3.0 * forward * batch * T


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", float("nan")))


def matmul_floor_seconds(
    vocab: int,
    d: int,
    heads: int,
    blks: int,
    T: int,
    B: int,
    act: str,
    fuse: int,
    reps: int,
) -> float:
    """Seconds per step of the step's matrix products alone: its attainable floor.

    The same products as a CharLM training step, in the same layouts
    (`blocklab.nn.functional.linear` on the flattened batch, heads-major
    attention), forward and backward, with every other operation removed: no
    norms, softmax, mask, activation (a gated FFN keeps its elementwise
    product) or optimizer arithmetic. `fuse` steps in one `lax.scan`, each a
    plain gradient step, exactly as the real step is timed.
    """
    from blocklab.nn.functional import linear

    f = bl.nn.ffn.ffn_width(d, act)
    gated = act in bl.nn.ffn.GATED_ACTS
    p = d // heads
    keys = iter(jax.random.split(jax.random.key(0), 64))

    def w(*shape):
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

    blocks = [
        dict(
            q=w(d, d),
            k=w(d, d),
            v=w(d, d),
            o=w(d, d),
            w1=w(f, d),
            w2=w(d, f),
            **(dict(wg=w(f, d)) if gated else {}),
        )
        for _ in range(blks)
    ]
    params = dict(emb=w(vocab, d), pos=w(T, d), blocks=blocks)
    X = jax.random.randint(next(keys), (B, T), 0, vocab)

    def heads_major(z):
        return jnp.swapaxes(z.reshape(B, T, heads, p), 1, 2)

    def skeleton(params):
        h = params["emb"][X] + params["pos"]
        for b in params["blocks"]:
            q, k, v = (heads_major(linear(h, b[n])) for n in "qkv")
            s_ = jnp.einsum("bhqp,bhkp->bhqk", q, k)
            o = jnp.swapaxes(jnp.einsum("bhqk,bhkp->bhqp", s_, v), 1, 2)
            h = h + linear(o.reshape(B, T, d), b["o"])
            u = linear(h, b["w1"])
            h = h + linear(u * linear(h, b["wg"]) if gated else u, b["w2"])
        return jnp.mean(linear(h, params["emb"]) ** 2)

    def steps(params):
        def one(params, _):
            g = jax.grad(skeleton)(params)
            return jax.tree.map(lambda a, b: a - 1e-3 * b, params, g), None

        return jax.lax.scan(one, params, None, length=fuse)[0]

    return time_call(jax.jit(steps), params, reps=reps, warmup=1).median / fuse


def _setup(act: str, fuse: int):
    """The corpus, a CharLM (d = 128, 4 heads, 2 blocks), AdamW, its state and
    the keys of `fuse` steps: what every timed step here starts from."""
    data = bl.TimeMachine()
    model = bl.CharLM(
        data.vocab_size, 128, 4, 2, act, max_len=data.seq_len, key=jax.random.key(0)
    )
    opt = optax.adamw(1e-3, weight_decay=0.0)
    state = bl.training.step.init_state(model, opt)
    keys = bl.training.step.step_keys(jax.random.key(1), 0, fuse)
    return data, model, opt, state, keys


def bench_step(act: str, fuse: int, reps: int) -> dict:
    data, model, opt, state, keys = _setup(act, fuse)
    d, heads, blks, T, B = 128, 4, 2, data.seq_len, 64
    step = bl.make_train_step(opt, data, batch_size=B)

    one = jax.jit(lambda s, k: step(s, k)).lower(state, keys[0]).compile()
    run = eqx.filter_jit(step.scan)
    t0 = time.perf_counter()
    jax.block_until_ready(run(state, keys))
    compile_s = time.perf_counter() - t0
    timing = time_call(run, state, keys, reps=reps, warmup=1)
    seconds = timing.median / fuse
    flops = step_flops(
        data.vocab_size,
        d,
        blks,
        T,
        B,
        bl.nn.ffn.ffn_width(d, act),
        act in bl.nn.ffn.GATED_ACTS,
    )
    floor = matmul_floor_seconds(data.vocab_size, d, heads, blks, T, B, act, fuse, reps)
    return dict(
        act=act,
        ms=1e3 * seconds,
        floor_ms=1e3 * floor,
        tokens_per_s=B * T / seconds,
        flops=flops,
        xla_flops=xla_flops(one),
        compile_s=compile_s,
    )


class ChapterStep(eqx.Module):
    """The chapter's training step before `make_train_step` was generalized:
    the batch from `data.train_batch(key, B)`, `lm_loss`, one AdamW update,
    the same divergence guard. The reference for the general step's cost."""

    data: bl.TimeMachine
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    batch_size: int = eqx.field(static=True)

    def __call__(self, state, key):
        X, Y = self.data.train_batch(key, self.batch_size)
        params, static = eqx.partition(state.model, eqx.is_inexact_array)

        def loss_fn(p):
            logits = eqx.combine(p, static)(X).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, params)
        finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(updates))
        ok = state.finite & finite
        stepped = bl.training.step.TrainState(
            eqx.apply_updates(state.model, updates), opt_state, state.step + 1, ok
        )
        kept = eqx.tree_at(lambda s: s.finite, state, ok)
        new = jax.tree_util.tree_map(
            lambda a, b: jnp.where(ok, a, b) if eqx.is_array(a) else a, stepped, kept
        )
        return new, jnp.where(ok, loss, jnp.nan)

    def scan(self, state, keys):
        return jax.lax.scan(lambda s, k: self(s, k), state, keys)


def bench_general(act: str, fuse: int, reps: int) -> dict:
    """ms / step of the chapter's step, the general step and its bf16 policy."""
    data, model, opt, state, keys = _setup(act, fuse)
    B = 64
    steps = {
        "chapter": ChapterStep(data, opt, B),
        "general": bl.make_train_step(opt, data, batch_size=B),
        "general_bf16": bl.make_train_step(opt, data, batch_size=B, precision="bf16"),
    }
    runs = {name: eqx.filter_jit(step.scan) for name, step in steps.items()}
    for run in runs.values():  # compile and warm up
        jax.block_until_ready(run(state, keys))
    times = {name: [] for name in runs}
    for _ in range(reps):  # alternate, so that load changes hit both alike
        for name, run in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(state, keys))
            times[name].append((time.perf_counter() - t0) / fuse)
    ms = {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}
    return dict(act=act, **ms, ratio=ms["general"] / ms["chapter"])


def bench_depth(num_blks: int, unrolled: bool) -> float:
    """Seconds to compile forward + backward of a depth-`num_blks` stack (d=128)."""
    stack = bl.Stack(
        lambda k: bl.TransformerBlock(128, 4, key=k), num_blks, key=jax.random.key(0)
    )
    x = jnp.ones((8, 128, 128), jnp.float32)
    causal = jnp.arange(1, 129)
    if unrolled:
        blocks = [stack.block(i) for i in range(num_blks)]

        def forward(params, x):
            for blk in params:
                x = blk(x, causal)
            return x

        params = blocks
    else:

        def forward(params, x):
            return params(x, causal)

        params = stack

    def loss(params):
        return jnp.mean(jax.vmap(lambda s: forward(params, s))(x) ** 2)

    t0 = time.perf_counter()
    eqx.filter_jit(eqx.filter_grad(loss)).lower(params).compile()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--act", nargs="+", default=["swiglu", "gelu"])
    parser.add_argument("--fuse", type=int, default=10, help="steps per compiled call")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--unrolled",
        action="store_true",
        help="also compile the unrolled (Python loop) stacks",
    )
    parser.add_argument(
        "--general-only",
        action="store_true",
        help="only the general step against the chapter's step",
    )
    args = parser.parse_args()

    print("| act | chapter step (ms) | general step (ms) | general / chapter "
          "| general, bf16 (ms) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for a in args.act:
        g = bench_general(a, args.fuse, args.reps)
        print(
            f"| {a} | {g['chapter']:.0f} | {g['general']:.0f} | {g['ratio']:.3f} | "
            f"{g['general_bf16']:.0f} |"
        )
    print()
    if args.general_only:
        return

    peak = matmul_peak_flops()
    rows = [bench_step(a, args.fuse, args.reps) for a in args.act]
    peak_after = matmul_peak_flops()
    peak = max(peak, peak_after)
    print(
        f"float32 matmul peak (2048^3, best of 10, before/after): "
        f"{peak / 1e9:.1f} GFLOP/s\n"
    )
    print(
        "| act | ms / step | tokens / s | GFLOP / step (analytic, XLA) "
        "| GFLOP/s | MFU | matmuls alone (ms) | their MFU | step / matmuls "
        "| compile (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = r["flops"] / (r["ms"] / 1e3)
        floor_rate = r["flops"] / (r["floor_ms"] / 1e3)
        print(
            f"| {r['act']} | {r['ms']:.0f} | {r['tokens_per_s']:.0f} | "
            f"{r['flops'] / 1e9:.1f}, {r['xla_flops'] / 1e9:.1f} | {rate / 1e9:.1f} | "
            f"{rate / peak:.0%} | {r['floor_ms']:.0f} | {floor_rate / peak:.0%} | "
            f"{r['ms'] / r['floor_ms']:.2f} | {r['compile_s']:.1f} |"
        )
    print(
        "\nReference (chapter's code on the same kind of 2-core CPU): eager PyTorch "
        "about 330 ms / step, Flax NNX about 480 ms / step.\n"
    )

    print("| stack (d = 128, fwd + bwd) | 8 blocks | 64 blocks | ratio |")
    print("|---|---:|---:|---:|")
    for unrolled in [False, True] if args.unrolled else [False]:
        t8, t64 = bench_depth(8, unrolled), bench_depth(64, unrolled)
        label = "Python loop (unrolled)" if unrolled else "Stack (lax.scan)"
        print(f"| {label} compile (s) | {t8:.2f} | {t64:.2f} | {t64 / t8:.2f} |")


if __name__ == "__main__":
    main()
