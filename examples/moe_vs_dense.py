"""An MoE CharLM against a dense SwiGLU CharLM with the same active parameters.

Both are CharLMs on The Time Machine. The dense one is the chapter's (SwiGLU
FFN of width w = round(8d/3)); in the MoE one every FFN is a
`blocklab.MoEFeedForward` of 8 SwiGLU experts of width w // 2 with top-2
(Mixtral) routing, so each token runs through the same number of FFN weights
(2 x w // 2 hidden units) plus the router's 8 x d. Each model trains over
seeds 0, 1, 2 as one vmapped `train_sweep` (AdamW 1e-3); the MoE loss adds
the load-balancing loss (0.01 x) and the router z-loss (0.001 x) through
`blocklab.training.losses.moe_loss`. A probe records every block's expert load
(fraction of token slots per expert) on a fixed batch during training.

Protocols:
  default   d = 64, 4 heads, 2 blocks, 16 x 64 characters per batch, 300 steps
            (a reduced protocol: minutes on 2 CPU cores);
  --full    the chapter's: d = 128, 4 heads, 2 blocks, 64 x 128 characters,
            600 steps;
  BLOCKLAB_TINY=1   a few seconds.
"""

import argparse
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import blocklab as bl

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--full", action="store_true", help="the chapter's protocol")
args = parser.parse_args()
TINY = os.environ.get("BLOCKLAB_TINY") == "1"
if TINY:
    D, HEADS, BLKS, T, B, STEPS = 16, 2, 1, 16, 4, 10
elif args.full:
    D, HEADS, BLKS, T, B, STEPS = 128, 4, 2, 128, 64, 600
else:
    D, HEADS, BLKS, T, B, STEPS = 64, 4, 2, 64, 16, 300
E, K = 8, 2
SEEDS = [0, 1, 2]
W = bl.nn.ffn.ffn_width(D, "swiglu")

data = bl.TimeMachine(
    seq_len=T, num_train=2000 if TINY else 100000, num_val=20 if TINY else 1000
)


def moe_ffn(*, key):
    return bl.MoEFeedForward(D, E, K, width=W // 2, dispatch="sorted", key=key)


def make_dense(key):
    return bl.CharLM(data.vocab_size, D, HEADS, BLKS, max_len=T, key=key)


def make_moe(key):
    return bl.CharLM(
        data.vocab_size, D, HEADS, BLKS, max_len=T, ffn_factory=moe_ffn, key=key
    )


probe_X, _ = data.train_batch(jax.random.key(123), B)


def expert_load(model):
    """`(blocks, E)` expert load of `model` on a fixed batch."""
    # jnp.copy: a traced operand (CharLM's eager id check trips on constants
    # closed over inside jit).
    _, (stats,) = bl.nn.moe.moe_forward(model, jnp.copy(probe_X))
    return stats.load


def active_ffn_params(model):
    ffn = model.stack.blocks.ffn
    if isinstance(ffn, bl.MoEFeedForward):
        per_expert = 3 * D * ffn.width
        return BLKS * (K * per_expert + E * D)
    return BLKS * 3 * D * W


runs = {}
for name, make, loss_fn, probe in (
    ("dense", make_dense, None, None),
    ("moe", make_moe, bl.training.losses.moe_loss(), expert_load),
):
    result = bl.train_sweep(
        make,
        data,
        STEPS,
        model_keys=SEEDS,
        data_keys=[1000 + s for s in SEEDS],
        loss_fn=loss_fn,
        run=bl.RunConfig(batch_size=B, steps_per_call=max(1, STEPS // 6)),
        sweep=bl.SweepConfig(learning_rates=1e-3, validate=False, probe=probe),
    )
    val = np.array(
        [
            float(
                eqx.filter_jit(bl.training.step.validation_loss)(result.model(k), data)
            )
            for k in range(len(SEEDS))
        ]
    )
    model0 = result.model(0)
    runs[name] = dict(
        result=result,
        val=val,
        params=bl.count_params(model0),
        active=active_ffn_params(model0),
    )

window = max(1, STEPS // 10)


def task_losses(result):
    """`(K, steps)` next-token losses (the MoE's without its aux terms)."""
    return np.asarray(result.losses if result.aux is None else result.aux["task"])


print(
    f"\nCharLM d={D}, {HEADS} heads, {BLKS} block(s), batch {B} x {T}, {STEPS} "
    f"steps, seeds {SEEDS}; MoE: {E} experts of width {W // 2}, top-{K}"
)
print(
    "| model | parameters | active FFN parameters | final train loss (task) "
    "| val loss |"
)
print("|---|---:|---:|---:|---:|")
final = {}
for name, r in runs.items():
    final[name] = np.nanmean(task_losses(r["result"])[:, -window:], axis=1)
    print(
        f"| {name} | {r['params']} | {r['active']} | {final[name].mean():.3f} ± "
        f"{final[name].std():.3f} | {r['val'].mean():.3f} ± {r['val'].std():.3f} |"
    )
aux = runs["moe"]["result"].aux
print(
    f"MoE aux terms over the last {window} steps (mean over seeds): "
    f"load-balancing {np.mean(aux['aux'][:, -window:]):.3f} (uniform routing: "
    f"{K}), z-loss {np.mean(aux['z'][:, -window:]):.3f}"
)

moe = runs["moe"]["result"]
load = np.asarray(moe.probes)  # (seeds, probes, blocks, E)
print(f"\nMoE expert load on a fixed batch (mean over seeds; uniform = {1 / E:.3f})")
print("| step | block | min load | max load | per expert |")
print("|---:|---:|---:|---:|---|")
for r, step in enumerate(moe.probe_steps):
    for b in range(load.shape[2]):
        row = load[:, r, b].mean(0)
        print(
            f"| {int(step)} | {b} | {row.min():.3f} | {row.max():.3f} | "
            f"{' '.join(f'{v:.2f}' for v in row)} |"
        )
gap = final["moe"] - final["dense"]
print(
    "\nMoE - dense final train loss (task; per seed): "
    + ", ".join(f"{g:+.3f}" for g in gap)
)
print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
