"""Train one CharLM over several seeds and learning rates as ONE compiled program.

`blocklab.train_sweep` stacks the K models (`eqx.filter_vmap`), vmaps one
training step over them and shards the K axis over every visible device: on a
laptop that is one CPU; on a GPU/TPU host every accelerator gets K / devices
members. To try several devices on a CPU, run with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`.

Set BLOCKLAB_TINY=1 for a few-second run.
"""

import os

import jax
import numpy as np

from blocklab import CharLM, RunConfig, SweepConfig, TimeMachine, train_sweep
from blocklab.training.member_axis import member_mesh

TINY = os.environ.get("BLOCKLAB_TINY") == "1"
D, BLKS, SEQ, BATCH, STEPS = (16, 1, 16, 4, 10) if TINY else (64, 2, 64, 16, 300)

data = TimeMachine(seq_len=SEQ)
seeds = [0, 1, 2, 3]
lrs = [1e-3, 1e-2]
# K = 8 members: every (seed, lr) pair; a seed fixes both the init and the data order.
model_keys = [s for s in seeds for _ in lrs]
data_keys = [1000 + s for s in seeds for _ in lrs]
member_lrs = [lr for _ in seeds for lr in lrs]


def make_model(key):
    return CharLM(data.vocab_size, D, 4, BLKS, max_len=SEQ, key=key)


print(f"mesh: {member_mesh().devices.size} device(s), {jax.devices()[0].platform}")
result = train_sweep(
    make_model,
    data,
    STEPS,
    model_keys=model_keys,
    data_keys=data_keys,
    run=RunConfig(batch_size=BATCH, steps_per_call=max(1, STEPS // 5)),
    sweep=SweepConfig(learning_rates=member_lrs),
)

window = max(1, STEPS // 10)
final = np.nanmean(result.losses[:, -window:], axis=1).reshape(len(seeds), len(lrs))
val = result.val_loss.reshape(len(seeds), len(lrs))
print(f"\nCharLM d={D}, {BLKS} block(s), {STEPS} steps, {len(seeds)} seeds per lr")
print("| lr | final train loss (mean ± std) | val loss (mean ± std) | diverged |")
print("|---:|---:|---:|---:|")
diverged = (result.diverged_at > 0).reshape(len(seeds), len(lrs))
for j, lr in enumerate(lrs):
    print(
        f"| {lr:g} | {final[:, j].mean():.3f} ± {final[:, j].std():.3f} | "
        f"{val[:, j].mean():.3f} ± {val[:, j].std():.3f} | {diverged[:, j].sum()} |"
    )
