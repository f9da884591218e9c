r"""The activation comparison (chapter 11.1.4.2) and exercise 10.

`CharLM` is trained on the Time Machine once per FFN activation and seed with
the chapter's protocol: $d = 128$, 4 heads, 2 blocks, batches of
$64 \times 128$ characters, AdamW (learning rate $10^{-3}$, no weight decay),
600 steps. The figure of merit is the training loss averaged over the window
of (at most) 100 steps before each checkpoint, $\bar\ell_c =
\frac1w\sum_{s=c-w+1}^{c}\ell_s$ at $c = 200, 400, 600$ (thirds of any other
budget), and the validation loss of each final model.

All seeds of one activation train as ONE `blocklab.train_sweep` (vmapped over
the seeds, sharded over the devices). Seed $s$ gives the weights and the
batches (`jax.random.split(jax.random.key(s))`), so the activations of one
seed see the same batches. A run that diverges is frozen at its last finite
model and reported (its later checkpoints are `None` in JSON, its step in
`diverged`); nothing is raised.

Exercise 10 is the same study over every activation of `blocklab.nn.ACTS`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._validate import ConfigError, check_float, check_int
from ..data.datasets import TimeMachine
from ..models.charlm import CharLM
from ..nn.ffn import ACTS
from ..training.run import TrainResult, train_lm
from ..training.run_config import RunConfig, SweepConfig
from ..training.sweep import train_sweep
from ._render import json_floats, markdown_table
from ._seeds import check_seeds
from .plotting import line_plot
from .protocol import report_estimate_hook, report_section_hook

__all__ = [
    "CHAPTER_JAX",
    "REPORT_PROTOCOLS",
    "ActivationComparison",
    "compare_activations",
    "checkpoints",
    "loss_at",
    "train_one",
    "train_seeds",
]

#: The chapter's figures (JAX / Flax NNX, seed 0): loss over the 100 steps
#: before 200 / 400 / 600.
CHAPTER_JAX = {"gelu": (2.27, 1.73, 1.41), "swiglu": (2.22, 1.57, 1.24)}


def checkpoints(steps: int) -> tuple[list[int], int]:
    """The steps at which the loss is read, and the averaging window.

    600 steps give the chapter's 200 / 400 / 600 with a 100-step window; other
    budgets use thirds, with a window of `min(100, steps // 3)` (at least 1).
    """
    steps = check_int("checkpoints", "steps", steps, min=1)
    if steps < 3:
        return [steps], 1
    return [round(steps * i / 3) for i in (1, 2, 3)], max(1, min(100, steps // 3))


def loss_at(losses: np.ndarray, steps: int) -> dict[str, float]:
    r"""$\bar\ell_c$: mean training loss over the window before each checkpoint.

    `losses[s - 1]` is the loss of step s. A checkpoint the run did not reach,
    or whose window holds a non-finite loss (a diverged run), is NaN.
    """
    losses = np.asarray(losses, np.float64)
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
            max_len=data.seq_len, key=key,
        )  # fmt: skip

    return make_model


def train_one(
    act: str,
    seed: int,
    steps: int,
    *,
    data: TimeMachine,
    num_hiddens: int = 128,
    num_heads: int = 4,
    num_blks: int = 2,
    batch_size: int = 64,
    lr: float = 1e-3,
    progress: bool = False,
) -> TrainResult:
    """One run of the protocol with `train_lm`: `CharLM(act)` from `seed`, AdamW.

    `seed` gives the weights and the batches (`split(key(seed))`), so runs of
    different acts with one seed see the same batches.
    """
    model_key, data_key = jax.random.split(jax.random.key(seed))
    model = _model_factory(data, act, num_hiddens, num_heads, num_blks)(model_key)
    optimizer = optax.adamw(lr, weight_decay=0.0)
    return train_lm(
        model, data, optimizer, steps, key=data_key, batch_size=batch_size,
        progress=progress,
    )  # fmt: skip


def _sweep(act, seeds, steps, *, data, num_hiddens, num_heads, num_blks,
           batch_size, lr, progress):  # fmt: skip
    keys = [jax.random.split(jax.random.key(s)) for s in seeds]
    make_model = _model_factory(data, act, num_hiddens, num_heads, num_blks)
    return train_sweep(
        make_model,
        data,
        steps,
        model_keys=jnp.stack([k[0] for k in keys]),
        data_keys=jnp.stack([k[1] for k in keys]),
        run=RunConfig(batch_size=batch_size, progress=progress),
        sweep=SweepConfig(learning_rates=lr),
    )


def train_seeds(
    act: str,
    seeds: Sequence[int],
    steps: int,
    *,
    data: TimeMachine,
    num_hiddens: int = 128,
    num_heads: int = 4,
    num_blks: int = 2,
    batch_size: int = 64,
    lr: float = 1e-3,
    progress: bool = False,
) -> list[TrainResult]:
    """`train_one` for every seed at once: one `blocklab.train_sweep`.

    The seeds are the members of one vmapped program, sharded over the
    devices; run k equals `train_one(act, seeds[k], ...)` up to float rounding.
    """
    return _sweep(
        act, seeds, steps, data=data, num_hiddens=num_hiddens, num_heads=num_heads,
        num_blks=num_blks, batch_size=batch_size, lr=lr, progress=progress,
    ).runs()  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ActivationComparison:
    """What `compare_activations` returns (plain NumPy / Python data).

    Attributes:
        protocol: the arguments of the study (sizes, steps, learning rate, seeds).
        acts: the activations, in order.
        seeds: the seeds, in order.
        checkpoints: the steps $c$ at which the loss is read.
        window: the averaging window $w$.
        loss_at: act -> checkpoint (str) -> one $\\bar\\ell_c$ per seed (NaN
            where a run diverged before or inside the window).
        val_loss: act -> validation loss of each seed's final model.
        curves: act -> `(len(seeds), steps)` training losses (NaN after a
            divergence).
        diverged_at: act -> per seed the 1-based step of the first
            non-finite loss or update, 0 when the run never diverged.
    """

    protocol: dict[str, Any]
    acts: tuple[str, ...]
    seeds: tuple[int, ...]
    checkpoints: tuple[int, ...]
    window: int
    loss_at: dict[str, dict[str, list[float]]]
    val_loss: dict[str, list[float]]
    curves: dict[str, np.ndarray]
    diverged_at: dict[str, list[int]]

    @property
    def diverged(self) -> list[dict[str, int | str]]:
        """One `{"act", "seed", "step"}` per run that diverged."""
        return [
            {"act": a, "seed": s, "step": d}
            for a in self.acts
            for s, d in zip(self.seeds, self.diverged_at[a], strict=True)
            if d
        ]

    def table(self) -> str:
        """Markdown: mean ± std over seeds of each checkpoint loss and the val loss."""
        header = ["act", *(f"loss @ {k}" for k in self.checkpoints), "val loss"]
        rows = [
            [
                act,
                *(_mean_std(self.loss_at[act][str(k)]) for k in self.checkpoints),
                _mean_std(self.val_loss[act]),
            ]
            for act in self.acts
        ]
        return markdown_table(header, rows)

    def to_json(self) -> dict[str, Any]:
        """Strict-JSON data: non-finite numbers are `None`; `diverged` names runs."""
        return {
            "protocol": dict(self.protocol),
            "results": {
                a: {
                    "loss_at": {k: json_floats(v) for k, v in self.loss_at[a].items()},
                    "val_loss": json_floats(self.val_loss[a]),
                    "diverged_at": list(self.diverged_at[a]),
                }
                for a in self.acts
            },
            "diverged": self.diverged,
        }

    def figures(self, out_dir: str | Path) -> list[Path]:
        """`out_dir/train_losses.png`: the loss curves (`plot`)."""
        return [self.plot(Path(out_dir) / "train_losses.png")]

    def plot(self, path: str | Path, window: int | None = None) -> Path:
        """Loss curves: mean over seeds, smoothed over `window` steps; band: min-max.

        The default window is `min(20, max(1, steps // 10))`; a smoothed value
        is plotted at the last step of its window.
        """
        steps = self.protocol["steps"]
        window = min(20, max(1, steps // 10)) if window is None else max(1, window)

        def smooth(y):
            kernel = np.ones(window) / window
            return np.convolve(y, kernel, mode="valid") if len(y) >= window else y

        c = self.curves
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
            ys = {a: smooth(np.nanmean(c[a], axis=0)).tolist() for a in self.acts}
            bands = {
                a: (
                    smooth(np.nanmin(c[a], axis=0)).tolist(),
                    smooth(np.nanmax(c[a], axis=0)).tolist(),
                )
                for a in self.acts
                if len(c[a]) > 1
            }
        x = {
            a: [float(steps - len(y) + 1 + i) for i in range(len(y))]
            for a, y in ys.items()
        }
        return line_plot(
            path, x, ys, xlabel="step", ylabel="training loss (nats/char)",
            title="CharLM on the Time Machine", bands=bands,
        )  # fmt: skip


def _mean_std(values) -> str:
    v = np.asarray(values, dtype=float)
    if not np.all(np.isfinite(v)):
        ok = v[np.isfinite(v)]
        if ok.size == 0:
            return "diverged"
        return f"{_mean_std(ok)} ({v.size - ok.size} diverged)"
    return f"{v.mean():.2f} ± {v.std():.2f}" if len(v) > 1 else f"{v.mean():.2f}"


def compare_activations(
    acts: Sequence[str] = ("gelu", "swiglu"),
    seeds: Sequence[int] = (0,),
    steps: int = 600,
    *,
    num_hiddens: int = 128,
    num_heads: int = 4,
    num_blks: int = 2,
    seq_len: int = 128,
    batch_size: int = 64,
    lr: float = 1e-3,
    data: TimeMachine | None = None,
    progress: bool = False,
) -> ActivationComparison:
    """Train `CharLM` for every (act, seed) and read the chapter's checkpoints.

    Defaults are the chapter's protocol (section 11.1.4.2, seed 0 only);
    exercise 10 is `compare_activations(blocklab.nn.ACTS, seeds=(0, 1, 2))`.

    Args:
        acts: FFN activations (`blocklab.nn.ACTS`); the FFN width follows the
            matched-parameter rule (`4d` ungated, `round(8d/3)` gated).
        seeds: distinct non-negative int seeds; seed s draws the weights and
            the batches.
        steps: optimizer steps per run (>= 1).
        num_hiddens, num_heads, num_blks: width d, heads, depth.
        seq_len: characters per training sequence (ignored when `data` is given).
        batch_size: sequences per step.
        lr: AdamW learning rate (> 0), no weight decay.
        data: the corpus (default `TimeMachine(seq_len=seq_len)`).
        progress: show a tqdm bar per activation.

    Returns:
        An `ActivationComparison`.
    """
    owner = "compare_activations"
    acts = tuple(acts)
    if not acts:
        raise ConfigError(f"{owner}: acts must name at least one activation.")
    for a in acts:
        if a not in ACTS:
            raise ConfigError(f"{owner}: acts must be among {list(ACTS)}, got {a!r}.")
    if len(set(acts)) != len(acts):
        raise ConfigError(f"{owner}: acts must be distinct, got {list(acts)}.")
    seeds = check_seeds(seeds, _owner=owner)
    steps = check_int(owner, "steps", steps, min=1)
    for name, v in (("num_hiddens", num_hiddens), ("num_heads", num_heads),
                    ("num_blks", num_blks), ("seq_len", seq_len),
                    ("batch_size", batch_size)):  # fmt: skip
        check_int(owner, name, v, min=1)
    lr = check_float(owner, "lr", lr, min=0.0, min_open=True)
    if num_hiddens % num_heads:
        raise ConfigError(
            f"{owner}: num_hiddens must be a multiple of num_heads, got "
            f"num_hiddens={num_hiddens}, num_heads={num_heads}."
        )
    data = TimeMachine(seq_len=seq_len) if data is None else data
    points, window = checkpoints(steps)
    loss, val, curves, div = {}, {}, {}, {}
    for act in acts:
        res = _sweep(
            act, seeds, steps, data=data, num_hiddens=num_hiddens,
            num_heads=num_heads, num_blks=num_blks, batch_size=batch_size, lr=lr,
            progress=progress,
        )  # fmt: skip
        curves[act] = np.asarray(res.losses, np.float64)
        per_seed = [loss_at(row, steps) for row in curves[act]]
        loss[act] = {str(k): [p[str(k)] for p in per_seed] for k in points}
        val[act] = [float(v) for v in res.val_loss]
        div[act] = [int(d) for d in res.diverged_at]
    protocol = dict(
        num_hiddens=num_hiddens, num_heads=num_heads, num_blks=num_blks,
        seq_len=data.seq_len, batch_size=batch_size, lr=lr, steps=steps,
        seeds=list(seeds),
    )  # fmt: skip
    return ActivationComparison(
        protocol, acts, seeds, tuple(points), window, loss, val, curves, div
    )


def report_markdown(result: ActivationComparison, png_name: str) -> str:
    """The report's section for a comparison whose figure is `png_name`."""
    p = result.protocol
    chapter = "\n".join(
        f"| {a} | {' / '.join(map(str, v))} |" for a, v in CHAPTER_JAX.items()
    )
    return (
        "## GELU vs SwiGLU: CharLM on the Time Machine\n\n"
        f"d = {p['num_hiddens']}, {p['num_heads']} heads, {p['num_blks']} blocks, "
        f"batches of {p['batch_size']} x {p['seq_len']} characters, AdamW "
        f"(lr {p['lr']:g}, no weight decay), {p['steps']} steps, seeds "
        f"{list(result.seeds)}. Training loss averaged over the {result.window} "
        "steps before each checkpoint"
        f"{'; mean ± std over seeds' if len(result.seeds) > 1 else ''}.\n\n"
        f"{result.table()}\n\n"
        "The chapter (Flax NNX, seed 0), loss at 200 / 400 / 600:\n\n"
        f"| act | chapter |\n|---|---|\n{chapter}\n\n"
        f"![loss curves]({png_name})\n"
    )


#: The protocols of the report's comparison: name -> (steps, seeds). `cpu` is
#: the chapter's own comparison (seed 0, as the chapter prints it); `full` adds
#: seeds 1 and 2 for a mean and a spread (3x the time: about 16 min on 2 CPU
#: cores); `quick` is a smoke run.
REPORT_PROTOCOLS: dict[str, tuple[int, tuple[int, ...]]] = {
    "full": (600, (0, 1, 2)),
    "cpu": (600, (0,)),
    "quick": (90, (0,)),
}


def report_protocol(*, quick: bool = False, full: bool = False) -> str:
    """The name of the protocol `blocklab report` runs: quick, full, or else cpu."""
    return "quick" if quick else "full" if full else "cpu"


@report_estimate_hook("activations")
def report_estimate(*, quick: bool, full: bool) -> float:
    """Seconds on 2 idle CPU cores: 0.26 s per step and run, plus compilation.

    (The per-step figure's calibration: benchmarks/README.md.)
    """
    steps, seeds = REPORT_PROTOCOLS[report_protocol(quick=quick, full=full)]
    return 2 * len(seeds) * steps * 0.26 + 20


@report_section_hook("activations")
def report_section(out_dir: Path, *, quick: bool, full: bool, progress: bool) -> str:
    """Run the report's comparison (GELU vs SwiGLU) and return its Markdown section.

    `full` (an accelerator, or `blocklab report --full`): 600 steps, seeds 0, 1,
    2. Otherwise on a CPU: 600 steps, seed 0, the chapter's own comparison;
    the section names that protocol and how to run the full one. `quick`: 90
    steps, seed 0. Writes `out_dir/train_losses.png`.
    """
    name = report_protocol(quick=quick, full=full)
    steps, seeds = REPORT_PROTOCOLS[name]
    result = compare_activations(("gelu", "swiglu"), seeds, steps, progress=progress)
    (png,) = result.figures(out_dir)
    text = report_markdown(result, png.name)
    if name == "cpu":
        full_steps, full_seeds = REPORT_PROTOCOLS["full"]
        note = (
            "This is the protocol `cpu`, sized for a CPU: the chapter's own "
            "comparison, seed 0 only. The full one (`full`: "
            f"{full_steps} steps, seeds {list(full_seeds)}, a mean and a spread "
            "over seeds) runs with `blocklab report --full` (the default on a GPU "
            "or TPU) or `blocklab activations --seeds "
            f"{' '.join(map(str, full_seeds))}`, "
            "and takes about 16 min on 2 CPU cores.\n\n"
        )
        head, description, rest = text.split("\n\n", 2)
        text = f"{head}\n\n{description}\n\n{note}{rest}"
    return text
