"""A research sweep: your own model, loss and data, two hyperparameters x seeds.

The model is a small next-token MLP (not the chapter's CharLM) that reads a
token and the one before it; the data is a synthetic integer sequence (not
the Time Machine): a lagged-Fibonacci rule x[t+1] = (x[t] + x[t-1]) mod V with
10% of tokens replaced by noise, wrapped in `blocklab.TokenDataset`. The loss
returns the cross-entropy and, as aux, the accuracy. One `train_sweep` trains
every (learning rate, weight decay, seed) member of a `sweep_grid` as one
compiled program.

The same script runs unchanged in one process and in several:

    python examples/research_sweep.py
    blocklab launch --processes 2 -- python examples/research_sweep.py

Under the launcher, `blocklab.training.distributed.initialize()` joins the job, the
members are spread over the devices of both processes, every process gets the
same `SweepResult`, and only process 0 prints. Tiny by default (seconds);
`--big` trains a wider model longer.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import blocklab as bl
from blocklab.training import distributed

distributed.initialize()  # first: joins a `blocklab launch` job, else a no-op

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


class NextTokenMLP(eqx.Module):
    """logits[t] = MLP([E x[t], E x[t-1]]) for every position of a (B, T) batch."""

    emb: eqx.nn.Embedding
    mlp: eqx.nn.MLP

    def __init__(self, vocab: int, d: int, hidden: int, *, key):
        k_emb, k_mlp = jax.random.split(key)
        self.emb = eqx.nn.Embedding(vocab, d, key=k_emb)
        self.mlp = eqx.nn.MLP(2 * d, vocab, hidden, depth=2, key=k_mlp)

    def __call__(self, X):
        e = self.emb.weight[X]  # (B, T, d)
        prev = jnp.concatenate([jnp.zeros_like(e[:, :1]), e[:, :-1]], axis=1)
        h = jnp.concatenate([e, prev], axis=-1)
        return jax.vmap(jax.vmap(self.mlp))(h)


def loss_fn(model, batch, key):
    """Mean cross-entropy, and the accuracy as aux."""
    X, Y = batch
    logits = model(X).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == Y)}


def synthetic_tokens(vocab: int, length: int, noise: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.zeros(length, np.int64)
    x[:2] = rng.integers(0, vocab, 2)
    for t in range(2, length):
        x[t] = (x[t - 1] + x[t - 2]) % vocab
        if rng.random() < noise:
            x[t] = rng.integers(0, vocab)
    return x


def digest(tree) -> str:
    """SHA-256 of every array's bytes: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array)):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big", action="store_true", help="a wider model, more steps")
    p.add_argument("--seeds", type=int, default=2, help="seeds per grid point")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object")
    a = p.parse_args()
    vocab, T = 16, 16
    d, hidden, steps, batch = (64, 256, 400, 64) if a.big else (8, 16, 20, 8)
    steps = a.steps or steps

    data = bl.TokenDataset(synthetic_tokens(vocab, 20_000, 0.1, seed=0), T, num_val=0)
    grid = bl.sweep_grid(
        learning_rate=[3e-3, 3e-2], weight_decay=[0.0, 0.1], seed=range(a.seeds)
    )
    result = bl.train_sweep(
        lambda key: NextTokenMLP(vocab, d, hidden, key=key),
        data,
        steps,
        model_keys=grid["seed"],
        data_keys=grid["seed"] + 1000,
        loss_fn=loss_fn,
        run=bl.RunConfig(batch_size=batch, steps_per_call=10, progress=False),
        sweep=bl.SweepConfig(
            hyperparams={
                "learning_rate": grid["learning_rate"],
                "weight_decay": grid["weight_decay"],
            },
            optimizer=bl.training.sweep.sweep_optimizer(optax.adamw, weight_decay=0.0),
        ),
    )
    if not distributed.is_main_process():
        return
    best = result.select(learning_rate=3e-2, weight_decay=0.0)
    out = {
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "members": result.num_members,
        "learning_rate": result.hyperparams["learning_rate"].tolist(),
        "weight_decay": result.hyperparams["weight_decay"].tolist(),
        "seed": result.model_seeds.tolist(),
        "final_loss": result.losses[:, -1].tolist(),
        "final_accuracy": result.aux["accuracy"][:, -1].tolist(),
        "losses": result.losses.tolist(),
        "diverged_at": result.diverged_at.tolist(),
        "weights_sha256": digest(result.state),
        "best_final_loss": float(best.losses[:, -1].mean()),
    }
    if a.json:
        print(json.dumps(out))
        return
    print(
        f"{out['members']} members on {out['devices']} device(s) of "
        f"{out['processes']} process(es); {steps} steps\n"
    )
    print("| learning rate | weight decay | seed | final loss | final accuracy |")
    print("|---:|---:|---:|---:|---:|")
    for k in range(result.num_members):
        print(
            f"| {out['learning_rate'][k]:g} | {out['weight_decay'][k]:g} | "
            f"{out['seed'][k]} | {out['final_loss'][k]:.3f} | "
            f"{out['final_accuracy'][k]:.2f} |"
        )


if __name__ == "__main__":
    main()
