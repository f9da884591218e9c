"""`blocklab train`: the chapter's GELU vs SwiGLU comparison (and any other acts)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..data import TimeMachine
from ..ffn import ACTS
from ..models import CharLM
from ..plotting import line_plot
from ..sweep import train_sweep
from ..train import TrainResult, train_lm

NAME = "train"
HELP = "train CharLM on the Time Machine with each FFN activation (chapter 11.1.4.2)"

#: The chapter's protocol (section 11.1.4.2).
PROTOCOL = dict(
    num_hiddens=128, num_heads=4, num_blks=2, max_len=128, batch_size=64, lr=1e-3
)
#: The chapter's figures (JAX / Flax NNX): loss over the 100 steps before 200/400/600.
CHAPTER_JAX = {"gelu": (2.27, 1.73, 1.41), "swiglu": (2.22, 1.57, 1.24)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--act", nargs="+", choices=ACTS, default=["gelu", "swiglu"])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--lr", type=float, default=PROTOCOL["lr"])
    parser.add_argument("--batch-size", type=int, default=PROTOCOL["batch_size"])
    parser.add_argument("--num-hiddens", type=int, default=PROTOCOL["num_hiddens"])
    parser.add_argument("--num-heads", type=int, default=PROTOCOL["num_heads"])
    parser.add_argument("--num-blks", type=int, default=PROTOCOL["num_blks"])
    parser.add_argument(
        "--num-steps",
        type=int,
        default=PROTOCOL["max_len"],
        help="sequence length (characters per training sequence)",
    )
    parser.add_argument(
        "--png",
        default="train_losses.png",
        help="where to write the loss curves (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true")


def checkpoints(steps: int) -> tuple[list[int], int]:
    """The steps at which the loss is read, and the averaging window.

    600 steps give the chapter's 200 / 400 / 600 with a 100-step window; other
    budgets use thirds, with a window of `min(100, steps // 3)` (at least 1).
    """
    if steps < 3:
        return [steps], 1
    return [round(steps * i / 3) for i in (1, 2, 3)], max(1, min(100, steps // 3))


def loss_at(losses: np.ndarray, steps: int) -> dict[str, float]:
    """Mean training loss over the window before each checkpoint (NaN: not reached)."""
    points, window = checkpoints(steps)
    return {
        str(k): float(np.mean(losses[k - window : k]))
        if len(losses) >= k
        else float("nan")
        for k in points
    }


def _model_factory(data: TimeMachine, act, num_hiddens, num_heads, num_blks):
    """`key -> CharLM` for the protocol (shared by `train_one` and `train_seeds`)."""

    def make_model(key):
        return CharLM(
            data.vocab_size, num_hiddens, num_heads, num_blks, act,
            max_len=data.num_steps, key=key,
        )  # fmt: skip

    return make_model


def train_one(
    act: str,
    seed: int,
    steps: int,
    *,
    data: TimeMachine,
    num_hiddens: int = PROTOCOL["num_hiddens"],
    num_heads: int = PROTOCOL["num_heads"],
    num_blks: int = PROTOCOL["num_blks"],
    batch_size: int = PROTOCOL["batch_size"],
    lr: float = PROTOCOL["lr"],
    progress: bool = True,
) -> TrainResult:
    """One run of the protocol: `CharLM(act)` from `seed`, AdamW(lr, wd 0), `steps`.

    `seed` gives the weights and the batches (`split(key(seed))`), so runs of
    different acts with one seed see the same batches.
    """
    model_key, data_key = jax.random.split(jax.random.key(seed))
    model = _model_factory(data, act, num_hiddens, num_heads, num_blks)(model_key)
    optimizer = optax.adamw(lr, weight_decay=0.0)
    return train_lm(
        model,
        data,
        optimizer,
        steps,
        key=data_key,
        batch_size=batch_size,
        progress=progress,
    )


def train_seeds(
    act: str,
    seeds: list[int],
    steps: int,
    *,
    data: TimeMachine,
    num_hiddens: int = PROTOCOL["num_hiddens"],
    num_heads: int = PROTOCOL["num_heads"],
    num_blks: int = PROTOCOL["num_blks"],
    batch_size: int = PROTOCOL["batch_size"],
    lr: float = PROTOCOL["lr"],
    progress: bool = True,
) -> list[TrainResult]:
    """`train_one` for every seed at once: one `blocklab.sweep.train_sweep`.

    The seeds are the members of one vmapped program, sharded over the
    devices; run k equals `train_one(act, seeds[k], ...)` up to float rounding.
    """
    keys = [jax.random.split(jax.random.key(s)) for s in seeds]
    make_model = _model_factory(data, act, num_hiddens, num_heads, num_blks)
    return train_sweep(
        make_model, data, steps, model_keys=jnp.stack([k[0] for k in keys]),
        data_keys=jnp.stack([k[1] for k in keys]), learning_rates=lr,
        batch_size=batch_size, progress=progress,
    ).runs()  # fmt: skip


def compare(acts, seeds, steps, *, data=None, progress=True, **options):
    """Train every (act, seed); returns `({act: {"loss_at", "val_loss"}}, curves)`.

    `curves[act]` is a `(len(seeds), steps)` array (NaN-padded after an early stop).
    """
    data = TimeMachine() if data is None else data
    results, curves = {}, {}
    for act in acts:
        runs = train_seeds(act, seeds, steps, data=data, progress=progress, **options)
        per_seed = [loss_at(r.losses, steps) for r in runs]
        results[act] = {
            "loss_at": {k: [p[k] for p in per_seed] for k in per_seed[0]},
            "val_loss": [r.val_loss for r in runs],
        }
        curves[act] = np.stack(
            [
                np.pad(r.losses, (0, steps - len(r.losses)), constant_values=np.nan)
                for r in runs
            ]
        )
    return results, curves


def _mean_std(values) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.2f} ± {v.std():.2f}" if len(v) > 1 else f"{v.mean():.2f}"


def table(results: dict) -> str:
    """Markdown table: mean ± std over seeds of each checkpoint loss and val loss."""
    points = list(next(iter(results.values()))["loss_at"])
    head = " | ".join(f"loss @ {k}" for k in points)
    lines = [f"| act | {head} | val loss |", "|---|" + "---:|" * (len(points) + 1)]
    for act, r in results.items():
        cells = " | ".join(_mean_std(r["loss_at"][k]) for k in points)
        lines.append(f"| {act} | {cells} | {_mean_std(r['val_loss'])} |")
    return "\n".join(lines)


def plot(path, curves: dict[str, np.ndarray], window: int = 20) -> Path:
    """Loss curves (mean over seeds, smoothed over `window` steps; band: min-max)."""

    def smooth(y):
        kernel = np.ones(window) / window
        return np.convolve(y, kernel, mode="valid") if len(y) >= window else y

    window = max(1, window)
    ys = {a: smooth(np.nanmean(c, axis=0)).tolist() for a, c in curves.items()}
    bands = {
        a: (
            smooth(np.nanmin(c, axis=0)).tolist(),
            smooth(np.nanmax(c, axis=0)).tolist(),
        )
        for a, c in curves.items()
        if len(c) > 1
    }
    # a smoothed value is plotted at the last step of its window
    x = {
        a: [float(curves[a].shape[1] - len(y) + 1 + i) for i in range(len(y))]
        for a, y in ys.items()
    }
    return line_plot(
        path,
        x,
        ys,
        xlabel="step",
        ylabel="training loss (nats/char)",
        title="CharLM on the Time Machine",
        bands=bands,
    )


def run(args: argparse.Namespace) -> int:
    data = TimeMachine(num_steps=args.num_steps)
    results, curves = compare(
        args.act,
        args.seeds,
        args.steps,
        data=data,
        progress=not (args.no_progress or args.json),
        num_hiddens=args.num_hiddens,
        num_heads=args.num_heads,
        num_blks=args.num_blks,
        batch_size=args.batch_size,
        lr=args.lr,
    )
    plot(args.png, curves, window=min(20, max(1, args.steps // 10)))
    if args.json:
        print(json.dumps(results))
        return 0
    print(
        f"CharLM, seeds {args.seeds}: training loss averaged over the "
        f"{checkpoints(args.steps)[1]} steps before each checkpoint "
        "(mean ± std over seeds)\n"
    )
    print(table(results))
    print(f"\nloss curves: {args.png}")
    return 0


def report_section(out_dir: Path, *, quick: bool) -> str:
    steps, seeds = (90, [0]) if quick else (600, [0, 1, 2])
    results, curves = compare(["gelu", "swiglu"], seeds, steps, progress=False)
    png = plot(
        Path(out_dir) / "train_losses.png", curves, window=min(20, max(1, steps // 10))
    )
    chapter = "\n".join(
        f"| {a} | {' / '.join(map(str, v))} |" for a, v in CHAPTER_JAX.items()
    )
    return (
        "## GELU vs SwiGLU: CharLM on the Time Machine\n\n"
        f"d = 128, 4 heads, 2 blocks, batches of 64 x 128 characters, AdamW "
        f"(lr 1e-3, no weight decay), {steps} steps, seeds {seeds}. Training loss "
        f"averaged over the {checkpoints(steps)[1]} steps before each checkpoint; "
        "mean ± std over seeds.\n\n"
        f"{table(results)}\n\n"
        "The chapter (Flax NNX, seed 0), loss at 200 / 400 / 600:\n\n"
        f"| act | chapter |\n|---|---|\n{chapter}\n\n"
        f"![loss curves]({png.name})\n"
    )
