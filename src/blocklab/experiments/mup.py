r"""μP in practice: the coordinate check and the learning-rate transfer study.

**Coordinate check** (`coord_check`; Yang et al. 2022, Tensor Programs V,
section 8): train models of several widths $d$ for a few Adam steps at one
learning rate and record, at every step $t$, the root mean square of the
coordinates of six activations on a fixed batch,
$$\mathrm{RMS}(x) = \Big(\tfrac1n \textstyle\sum_i x_i^2\Big)^{1/2},$$
averaged over the layers: the embedding output $h_0$, the attention logits
(causal pairs), the attention branch output, the FFN branch output, the block
output, and the output logits. The slope of $\log \mathrm{RMS}$ against
$\log d$ (least squares over the widths) says how the activation scales with
width: under μP every slope stays near 0 after training steps; under the
standard parametrization with Adam the hidden updates scale like
$\eta\,\text{fan\_in}$, so the activations grow with width (slope up to 1).

**Learning-rate transfer** (`run_transfer`): for each width, one
`blocklab.train_sweep` over a grid of base rates (half-decade steps) x seeds,
in both parametrizations; the final validation loss (mean over seeds) gives
the optimal rate per width. Under μP the optimum should move by at most one
grid step across widths; under standard it drifts to smaller rates as the
width grows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from .._validate import ConfigError, check_choice, check_float, check_int
from ..data.datasets import TimeMachine
from ..models import DecoderConfig, DecoderLM
from ..models.charlm import CharLM
from ..nn.functional import causal_lengths
from ..nn.parametrization import PARAMETRIZATIONS
from ..training.optimizers import optimizer as make_optimizer
from ..training.run_config import RunConfig, SweepConfig
from ..training.step import init_state, make_train_step
from ..training.sweep import sweep_grid, train_sweep
from ._render import figure_links, json_floats, markdown_table
from .protocol import check_protocol, report_estimate_hook, report_section_hook

__all__ = [
    "ACTIVATIONS",
    "CoordCheckResult",
    "TransferResult",
    "coord_check",
    "decoder_factory",
    "estimate_seconds",
    "log_slope",
    "run_transfer",
]

#: The activations the coordinate check measures, in the order of the table.
ACTIVATIONS = (
    "embedding", "attn_logits", "attn_out", "ffn_out", "block_out", "logits"
)  # fmt: skip


def log_slope(widths: Any, values: Any) -> float:
    r"""Least-squares slope of $\log y$ against $\log d$ (NaN if any $y \le 0$)."""
    x = np.log(np.asarray(widths, np.float64))
    y = np.asarray(values, np.float64)
    if y.shape != x.shape or not np.all(np.isfinite(y)) or np.any(y <= 0):
        return math.nan
    y = np.log(y)
    xc = x - x.mean()
    return float(np.sum(xc * (y - y.mean())) / np.sum(xc * xc))


def decoder_factory(
    parametrization: str,
    base_width: int,
    *,
    vocab_size: int = 28,
    num_heads: int = 4,
    num_blks: int = 2,
    max_len: int = 64,
    qk_norm: bool = False,
) -> Callable[..., DecoderLM]:
    """`make_model(width, key)`: a Llama-style `DecoderLM` (untied head, RMSNorm,
    SwiGLU, RoPE) of width `width` in `parametrization` with `base_width`."""
    return functools.partial(
        _decoder, parametrization, base_width, vocab_size, num_heads, num_blks,
        max_len, qk_norm,
    )  # fmt: skip


@functools.cache
def _config(parametrization, base_width, vocab_size, heads, blks, max_len, qk, width):
    return DecoderConfig.llama(
        vocab_size, width, heads, blks, num_kv_heads=None, max_len=max_len,
        qk_norm=qk, parametrization=parametrization, base_width=base_width,
    )  # fmt: skip


def _decoder(parametrization, base_width, vocab, heads, blks, max_len, qk, width, key):
    cfg = _config(parametrization, base_width, vocab, heads, blks, max_len, qk, width)
    return DecoderLM(cfg, key=key)


def _rms(x, mask=None):
    x = jnp.asarray(x, jnp.float32)
    if mask is None:
        return jnp.sqrt(jnp.mean(jnp.square(x)))
    mask = jnp.broadcast_to(mask, x.shape)
    return jnp.sqrt(jnp.sum(jnp.where(mask, jnp.square(x), 0.0)) / jnp.sum(mask))


def activation_rms(model: Any, tokens: jax.Array) -> dict[str, jax.Array]:
    """The RMS of each of `ACTIVATIONS` on a `(B, T)` batch (layers averaged).

    `model` is a `DecoderLM` or a `CharLM`; the stack is run once with
    `Stack.scan(..., collect=...)` reading every block's `trace`.
    """
    T = tokens.shape[-1]
    causal = causal_lengths(tokens.shape)
    visible = jnp.tril(jnp.ones((T, T), bool))
    extra: dict[str, Any] = {}
    if isinstance(model, DecoderLM):
        cfg = model.cfg
        h = model.token_emb.weight[tokens]
        if cfg.embed_scale is not None:
            h = h * cfg.embed_scale
        if model.pos_emb is not None:
            h = h + model.pos_emb.weight[:T]
        else:
            extra = {"positions": jnp.arange(T)}
    elif isinstance(model, CharLM):
        h = model.token_emb.weight[tokens] + model.pos_emb.weight[:T]
    else:
        raise ConfigError(
            f"coord_check: the model must be a DecoderLM or a CharLM, got "
            f"{type(model).__name__}."
        )

    def collect(block, x, key):
        tr = block.trace(x, causal, key=key, **extra)
        stats = {
            "attn_logits": _rms(tr.attention.logits, visible),
            "attn_out": _rms(tr.attn_out),
            "ffn_out": _rms(tr.ffn_out),
            "block_out": _rms(tr.output),
        }
        return tr.output, stats

    emb = _rms(h)
    _, per_layer = model.stack.scan(h, causal, collect=collect, **extra)
    out = {k: jnp.mean(v) for k, v in per_layer.items()}
    out["embedding"] = emb
    out["logits"] = _rms(model(tokens))
    return out


@dataclasses.dataclass(frozen=True)
class CoordCheckResult:
    """What `coord_check` returns.

    Attributes:
        widths: `(W,)` model widths.
        steps: `(S + 1,)` the steps measured (0 is the initialization).
        rms: activation -> `(W, S + 1)` RMS of its coordinates (mean over seeds).
        slopes: activation -> `(S + 1,)` slope of log RMS vs log width per step
            (NaN where an RMS is 0, e.g. μP's attention logits at init).
        parametrization: the label the caller gave (e.g. `"mup"`).
        learning_rate: the Adam base rate.
    """

    widths: tuple[int, ...]
    steps: np.ndarray
    rms: dict[str, np.ndarray]
    slopes: dict[str, np.ndarray]
    parametrization: str
    learning_rate: float

    def final_slopes(self) -> dict[str, float]:
        """The slope of each activation after the last step."""
        return {k: float(v[-1]) for k, v in self.slopes.items()}

    def max_abs_final_slope(self) -> float:
        return float(max(abs(v) for v in self.final_slopes().values()))

    def table(self) -> str:
        """Markdown: RMS at the last step per width and the slope per activation."""
        header = ["activation", *(f"d={w}" for w in self.widths), "slope (last step)"]
        rows = [
            [a, *(f"{v:.3g}" for v in self.rms[a][:, -1]), f"{self.slopes[a][-1]:+.3f}"]
            for a in ACTIVATIONS
        ]
        return markdown_table(header, rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "parametrization": self.parametrization,
            "learning_rate": self.learning_rate,
            "widths": list(self.widths),
            "steps": [int(s) for s in self.steps],
            "rms": {k: [json_floats(r) for r in v] for k, v in self.rms.items()},
            "slopes": {k: json_floats(v) for k, v in self.slopes.items()},
            "final_slopes": {
                k: (v if math.isfinite(v) else None)
                for k, v in self.final_slopes().items()
            },
        }

    def figures(self, out_dir: str | Path) -> list[Path]:
        """`coord_check_{parametrization}.png`: RMS vs width (log-log), one
        panel per activation, one line per step."""
        from .plotting import _save, plt

        fig, axes = plt.subplots(2, 3, figsize=(11, 6), dpi=110)
        for ax, a in zip(axes.ravel(), ACTIVATIONS, strict=True):
            for j, s in enumerate(self.steps):
                y = self.rms[a][:, j]
                if np.all(y > 0) and np.all(np.isfinite(y)):
                    ax.plot(self.widths, y, marker="o", label=f"t={int(s)}")
            ax.set(xscale="log", yscale="log", xlabel="width d", title=a)
            ax.grid(alpha=0.3)
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(
            f"coordinate check, {self.parametrization}, Adam lr "
            f"{self.learning_rate:g}: RMS of activation coordinates"
        )
        fig.tight_layout()
        path = Path(out_dir) / f"coord_check_{self.parametrization}.png"
        return [_save(fig, path)]


def coord_check(
    make_model: Callable[..., Any],
    widths: Sequence[int],
    steps: int = 5,
    *,
    learning_rate: float = 1e-2,
    seeds: Sequence[int] = (0,),
    data: TimeMachine | None = None,
    seq_len: int = 32,
    batch_size: int = 8,
    probe_batch: int = 8,
    base_optimizer_fn: Callable[..., optax.GradientTransformation] = optax.adam,
    label: str | None = None,
    progress: bool = False,
) -> CoordCheckResult:
    """Train each width for `steps` Adam steps; the RMS of each activation per step.

    Args:
        make_model: `make_model(width, key)` -> a `DecoderLM` or `CharLM`
            (e.g. `decoder_factory("mup", base_width=32)`); its
            parametrization decides the rates (`blocklab.optimizer`).
        widths: at least two distinct widths.
        steps: optimizer steps (>= 1).
        learning_rate: the base rate $\\eta$ (> 0).
        seeds: the RMS is averaged over these model/data seeds.
        data: the corpus (default `TimeMachine(seq_len=seq_len)`).
        seq_len, batch_size: the training batches; `probe_batch` sequences of
            the validation split are the fixed batch measured.
        base_optimizer_fn: the base optax optimizer (default `optax.adam`).
        label: the result's `parametrization` label (default: the first
            model's parametrization).
        progress: a tqdm bar over the widths x seeds (stderr); each width
            compiles its own programs, so the first steps are the slow ones.
    """
    owner = "coord_check"
    if not callable(make_model):
        raise ConfigError(
            f"{owner}: make_model must be a function make_model(width, key) -> "
            f"model, got {make_model!r} ({type(make_model).__name__})."
        )
    widths = tuple(check_int(owner, "widths[i]", w, min=1) for w in widths)
    if len(set(widths)) < 2:
        raise ConfigError(f"{owner}: give at least two distinct widths, got {widths}.")
    steps = check_int(owner, "steps", steps, min=1)
    learning_rate = check_float(owner, "learning_rate", learning_rate, min=0.0,
                                min_open=True)  # fmt: skip
    seeds = tuple(check_int(owner, "seeds[i]", s, min=0) for s in seeds)
    if not seeds:
        raise ConfigError(f"{owner}: seeds must hold at least one seed.")
    data = TimeMachine(seq_len=seq_len) if data is None else data
    tokens = data.val_batch()[0][:probe_batch]
    rms = {a: np.zeros((len(widths), steps + 1)) for a in ACTIVATIONS}
    name = label
    bar = tqdm(
        total=len(widths) * len(seeds), desc=f"coord check {label or ''}".strip(),
        unit="model", leave=False, disable=not progress,
    )  # fmt: skip
    for i, w in enumerate(widths):
        for seed in seeds:
            bar.set_postfix_str(f"d={w} seed={seed}")
            model = make_model(w, jax.random.key(seed))
            if name is None:
                name = getattr(getattr(model, "cfg", model), "parametrization", "?")
            opt = make_optimizer(model, base_optimizer_fn, learning_rate=learning_rate)
            step = make_train_step(opt, data, batch_size=batch_size)
            rec = _coord_run(step, init_state(model, opt), tokens,
                             jax.random.key(seed + 1), steps)  # fmt: skip
            for a in ACTIVATIONS:
                rms[a][i] += np.asarray(rec[a], np.float64) / len(seeds)
            bar.update()
    bar.close()
    slopes = {
        a: np.array([log_slope(widths, rms[a][:, j]) for j in range(steps + 1)])
        for a in ACTIVATIONS
    }
    return CoordCheckResult(
        widths, np.arange(steps + 1), rms, slopes, str(name), learning_rate
    )


def _coord_run(step, state, tokens, key, steps):
    """`steps` training steps, measuring before and after each (a Python loop
    of two compiled functions: fusing them in one scan compiles for minutes)."""
    recs = [_probe(state.model, tokens)]
    for s in range(steps):
        state = _step(step, state, jax.random.fold_in(key, s))
        recs.append(_probe(state.model, tokens))
    return {a: np.stack([np.asarray(r[a]) for r in recs]) for a in ACTIVATIONS}


@eqx.filter_jit
def _step(step, state, key):
    return step(state, key)[0]


_probe = eqx.filter_jit(activation_rms)


# Learning-rate transfer ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TransferResult:
    """What `run_transfer` returns.

    Attributes:
        widths: `(W,)` widths; `lrs`: `(L,)` base rates; `seeds`.
        val_loss: parametrization -> `(W, L, S)` final validation loss (NaN:
            diverged).
        optimum: parametrization -> `(W,)` index into `lrs` of the best mean
            validation loss at each width.
        steps, base_width: the protocol.
    """

    widths: tuple[int, ...]
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    val_loss: dict[str, np.ndarray]
    optimum: dict[str, np.ndarray]
    steps: int
    base_width: int

    def shift(self, parametrization: str) -> int:
        """How many grid steps the optimum moves across the widths (max - min)."""
        o = self.optimum[parametrization]
        return int(o.max() - o.min())

    def optimal_lrs(self, parametrization: str) -> list[float]:
        return [self.lrs[i] for i in self.optimum[parametrization]]

    def table(self) -> str:
        header = [
            "parametrization",
            *(f"d={w}" for w in self.widths),
            "shift (grid steps)",
        ]
        rows = [
            [p, *(f"{lr:.1e}" for lr in self.optimal_lrs(p)), str(self.shift(p))]
            for p in self.val_loss
        ]
        return markdown_table(header, rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "widths": list(self.widths), "lrs": list(self.lrs),
            "seeds": list(self.seeds),
            "steps": self.steps, "base_width": self.base_width,
            "val_loss": {p: json_floats(v) for p, v in self.val_loss.items()},
            "optimal_lr": {p: self.optimal_lrs(p) for p in self.val_loss},
            "shift": {p: self.shift(p) for p in self.val_loss},
        }  # fmt: skip

    def figures(self, out_dir: str | Path) -> list[Path]:
        """`transfer_{parametrization}.png`: loss vs rate, one line per width."""
        from .plotting import line_plot

        out = []
        for p, v in self.val_loss.items():
            ys = {
                f"d={w}": np.nanmean(v[i], axis=-1) for i, w in enumerate(self.widths)
            }
            out.append(
                line_plot(
                    Path(out_dir) / f"transfer_{p}.png",
                    list(self.lrs),
                    ys,
                    xlabel="base learning rate",
                    ylabel="final validation loss",
                    logx=True,
                    title=f"learning-rate transfer, {p}",
                )  # fmt: skip
            )
        return out


def run_transfer(
    widths: Sequence[int] = (32, 64, 128, 256),
    lrs: Sequence[float] | None = None,
    *,
    seeds: Sequence[int] = (0, 1),
    parametrizations: Sequence[str] = PARAMETRIZATIONS,
    base_width: int | None = None,
    steps: int = 200,
    num_blks: int = 2,
    num_heads: int = 4,
    seq_len: int = 32,
    batch_size: int = 16,
    warmup_steps: int = 10,
    data: TimeMachine | None = None,
    progress: bool = False,
) -> TransferResult:
    """The transfer study: per width, one vmapped sweep of `lrs` x `seeds`.

    Args:
        widths: at least two widths (the study: four or more, doubling).
        lrs: base rates (default $10^{-3.5}, 10^{-3}, \\ldots, 10^{-1}$).
        seeds: model/data seeds per rate.
        parametrizations: `"standard"`, `"mup"` or both.
        base_width: μP's $d_0$ (default the smallest width).
        steps, num_blks, num_heads, seq_len, batch_size: the model and run
            (a Llama-style `DecoderLM`, untied head).
        warmup_steps: linear warm-up of `blocklab.optimizer`, then constant.
    """
    owner = "run_transfer"
    widths = tuple(check_int(owner, "widths[i]", w, min=1) for w in widths)
    if len(set(widths)) < 2:
        raise ConfigError(f"{owner}: give at least two distinct widths, got {widths}.")
    lrs = tuple(10.0 ** np.arange(-3.5, -0.75, 0.5)) if lrs is None else tuple(lrs)
    lrs = tuple(check_float(owner, "lrs[i]", v, min=0.0, min_open=True) for v in lrs)
    seeds = tuple(check_int(owner, "seeds[i]", s, min=0) for s in seeds)
    params = tuple(check_choice(owner, "parametrizations[i]", p, PARAMETRIZATIONS)
                   for p in parametrizations)  # fmt: skip
    base = (
        min(widths)
        if base_width is None
        else check_int(owner, "base_width", base_width, min=1)
    )
    data = TimeMachine(seq_len=seq_len) if data is None else data
    grid = sweep_grid(learning_rate=list(lrs), seed=list(seeds))
    val, opt_idx = {}, {}
    for p in params:
        out = np.full((len(widths), len(lrs), len(seeds)), np.nan)
        for i, w in enumerate(widths):
            make = functools.partial(
                decoder_factory(p, base, vocab_size=data.vocab_size,
                                num_heads=num_heads,
                                num_blks=num_blks, max_len=seq_len),
                w,
            )  # fmt: skip
            opt = make_optimizer(
                eqx.filter_eval_shape(make, jax.random.key(0)), optax.adam,
                warmup_steps=float(warmup_steps),
            )  # fmt: skip
            res = train_sweep(
                make,
                data,
                steps,
                model_keys=grid["seed"],
                data_keys=grid["seed"] + 1000,
                run=RunConfig(
                    batch_size=batch_size,
                    steps_per_call=min(steps, 50),
                    progress=progress,
                ),
                sweep=SweepConfig(learning_rates=grid["learning_rate"], optimizer=opt),
            )
            vl = np.where(res.diverged_at > 0, np.nan, res.val_loss)
            out[i] = vl.reshape(len(lrs), len(seeds))
        val[p] = out
        mean = np.where(np.isfinite(out), out, np.inf).mean(-1)
        opt_idx[p] = np.argmin(mean, axis=-1)
    return TransferResult(widths, lrs, seeds, val, opt_idx, steps, base)


# Report and command --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MupProtocol:
    """Sizes of the μP study (coordinate check; transfer study when `transfer`).

    Attributes:
        name: how reports name it.
        widths, steps, learning_rate, seeds: the coordinate check.
        max_slope: the verdict's threshold: μP passes when every activation's
            |slope| after the last step is at most this. It depends on the
            protocol: the fewer and smaller the widths, the noisier a slope
            (see `VERDICT_NOTES`).
        transfer_widths, transfer_steps, transfer_seeds: the transfer study
            (`run_transfer`, default rate grid); `transfer=False` skips it.
        max_shift: the transfer verdict: μP passes when its optimal rate
            moves by at most this many grid steps across the widths.
    """

    name: str
    widths: tuple[int, ...]
    steps: int
    learning_rate: float = 1e-2
    seeds: tuple[int, ...] = (0,)
    max_slope: float = 0.1
    transfer: bool = False
    transfer_widths: tuple[int, ...] = (32, 64, 128, 256)
    transfer_steps: int = 200
    transfer_seeds: tuple[int, ...] = (0, 1)
    max_shift: int = 1


#: On an accelerator: coordinate check 64..1024 and the transfer study 64..512.
FULL = MupProtocol("full", (64, 128, 256, 512, 1024), 10, seeds=(0, 1, 2),
                   max_slope=0.1, transfer=True,
                   transfer_widths=(64, 128, 256, 512),
                   transfer_steps=1000)  # fmt: skip
#: About ten minutes on 2 CPU cores (`blocklab mup --protocol cpu`).
CPU = MupProtocol("cpu", (32, 64, 128, 256), 5, seeds=(0, 1), max_slope=0.3,
                  transfer=True, transfer_widths=(16, 32, 64, 128),
                  transfer_steps=100, transfer_seeds=(0, 1))  # fmt: skip
#: The report's section on a CPU: the coordinate check only, small.
REPORT = MupProtocol("report", (32, 64, 128), 3, max_slope=0.35)
#: The smallest: `--quick`.
QUICK = MupProtocol("quick", (16, 32, 64), 2, max_slope=0.35)
PROTOCOLS = {p.name: p for p in (FULL, CPU, REPORT, QUICK)}

#: Why each protocol's threshold is what it is: the slopes measured with it.
#: A slope over two octaves of small widths after two steps is noisy, so the
#: small protocols allow more; each threshold sits between μP's measured
#: max |slope| and the standard parametrization's.
VERDICT_NOTES = {
    "full": "Threshold 0.1: on an H200 (2026-11-30) μP's slopes stayed within "
    "±0.04 and the standard parametrization's reached +2.8.",
    "cpu": "Threshold 0.3: four widths 32..256 after 5 steps, two seeds. Measured "
    "on a 2-core CPU (2026-12-01): μP max |slope| 0.14 (FFN output), standard "
    "1.17 (FFN output).",
    "report": "Threshold 0.35: three widths 32..128 after 3 steps, one seed: "
    "noisy. Measured on a 2-core CPU (2026-12-01): μP max |slope| 0.25 (FFN "
    "output), standard 0.62 (attention logits).",
    "quick": "Threshold 0.35: three small widths 16..64 after 2 steps, one seed: "
    "noisy. Measured on a 2-core CPU (2026-12-01): μP max |slope| 0.14 "
    "(attention logits), standard 0.63 (FFN output).",
}


@dataclasses.dataclass(frozen=True)
class MupResult:
    """The coordinate checks (both parametrizations) and the transfer study."""

    protocol: MupProtocol
    coord: dict[str, CoordCheckResult]
    transfer: TransferResult | None

    def verdicts(self) -> list[dict[str, Any]]:
        """Pass or fail per check and parametrization, with the threshold used.

        Coordinate check: `max |slope|` over the activations after the last
        step against the protocol's `max_slope` (μP should pass; standard is
        expected to fail: its activations grow with width). Transfer: the
        optimum's shift in grid steps against `max_shift`. Each verdict:
        `check`, `parametrization`, `value`, `threshold`, `passed`,
        `expected` (whether this parametrization should pass).
        """
        p = self.protocol
        out = []
        for name, r in self.coord.items():
            slopes = np.abs(np.asarray(list(r.final_slopes().values())))
            value = (
                float(np.nanmax(slopes)) if np.any(np.isfinite(slopes)) else math.nan
            )
            out.append({
                "check": "coordinate check", "parametrization": name,
                "measure": "max |slope| after the last step", "value": value,
                "threshold": p.max_slope, "passed": bool(value <= p.max_slope),
                "expected": name == "mup",
            })  # fmt: skip
        if self.transfer is not None:
            for name in self.transfer.val_loss:
                shift = self.transfer.shift(name)
                out.append({
                    "check": "learning-rate transfer", "parametrization": name,
                    "measure": "shift of the optimal rate (grid steps)",
                    "value": shift, "threshold": p.max_shift,
                    "passed": bool(shift <= p.max_shift), "expected": name == "mup",
                })  # fmt: skip
        return out

    def verdict_table(self) -> str:
        """Markdown: one row per verdict, with its rule and the protocol's note."""
        rows = []
        for v in self.verdicts():
            ok = v["passed"]
            outcome = "PASS" if ok else "FAIL"
            if ok != v["expected"]:
                outcome += " (unexpected)"
            elif not ok:
                outcome += " (expected: no μP)"
            value = v["value"]
            shown = f"{value:.2f}" if isinstance(value, float) else str(value)
            rows.append([v["check"], v["parametrization"], v["measure"], shown,
                         f"<= {v['threshold']:g}", outcome])  # fmt: skip
        header = ["check", "parametrization", "measure", "value", "passes if",
                  "verdict"]  # fmt: skip
        note = VERDICT_NOTES.get(self.protocol.name, "")
        return markdown_table(header, rows) + (f"\n\n{note}" if note else "")

    def table(self) -> str:
        parts = []
        for p, r in self.coord.items():
            parts.append(f"Coordinate check, {p} (Adam lr {r.learning_rate:g}, "
                         f"{int(r.steps[-1])} steps):\n\n{r.table()}")  # fmt: skip
        if self.transfer is not None:
            parts.append("Optimal learning rate per width (final validation loss, "
                         f"mean over seeds):\n\n{self.transfer.table()}")  # fmt: skip
        parts.append(f"Verdicts (protocol `{self.protocol.name}`):\n\n"
                     f"{self.verdict_table()}")  # fmt: skip
        return "\n\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol": dataclasses.asdict(self.protocol),
            "coord_check": {p: r.to_json() for p, r in self.coord.items()},
            "transfer": None if self.transfer is None else self.transfer.to_json(),
            "verdicts": [
                {**v, "value": v["value"] if math.isfinite(v["value"]) else None}
                for v in self.verdicts()
            ],
        }

    def figures(self, out_dir: str | Path) -> list[Path]:
        paths = [q for r in self.coord.values() for q in r.figures(out_dir)]
        if self.transfer is not None:
            paths += self.transfer.figures(out_dir)
        return paths


def estimate_seconds(protocol: MupProtocol) -> float:
    """Seconds of `run_study(protocol)` on 2 idle CPU cores (mostly
    compilation: about 10 s per width and parametrization; `full`, sized for
    an accelerator with widths to 1024, about 40 times more)."""
    p = protocol
    est = 2 * len(p.widths) * (10.0 + 0.5 * p.steps * len(p.seeds))
    if p.transfer:
        est += 2 * len(p.transfer_widths) * (15.0 + 0.05 * p.transfer_steps * 12)
    return est * (40.0 if p.name == "full" else 1.0)


def run_study(protocol: Any = CPU, *, progress: bool = False) -> MupResult:
    """Coordinate check in both parametrizations (base width: the smallest),
    then the transfer study when `protocol.transfer`."""
    check_protocol("mup.run_study", protocol, MupProtocol, str(sorted(PROTOCOLS)))
    p = protocol
    coord = {
        name: coord_check(
            decoder_factory(name, min(p.widths)),
            p.widths,
            p.steps,
            learning_rate=p.learning_rate,
            seeds=p.seeds,
            label=name,
            progress=progress,
        )  # fmt: skip
        for name in PARAMETRIZATIONS
    }
    transfer = None
    if p.transfer:
        transfer = run_transfer(p.transfer_widths, seeds=p.transfer_seeds,
                                steps=p.transfer_steps, progress=progress)  # fmt: skip
    return MupResult(p, coord, transfer)


def report_protocol(*, quick: bool = False, full: bool = False) -> MupProtocol:
    return QUICK if quick else FULL if full else REPORT


@report_estimate_hook("mup")
def report_estimate(*, quick: bool, full: bool) -> float:
    """Seconds on 2 idle CPU cores (mostly compilation: ~10 s per width and
    parametrization)."""
    return estimate_seconds(report_protocol(quick=quick, full=full))


@report_section_hook("mup")
def report_section(out_dir: Path, *, quick: bool, full: bool, progress: bool) -> str:
    """The μP section: the coordinate check (and on `full`, the transfer study)."""
    p = report_protocol(quick=quick, full=full)
    res = run_study(p, progress=progress)
    paths = res.figures(out_dir)
    slopes = ", ".join(
        f"{name}: max |slope| {r.max_abs_final_slope():.2f}"
        for name, r in res.coord.items()
    )
    note = "" if p.transfer else (
        "The transfer study runs with `blocklab mup --protocol cpu` (about ten "
        "minutes on 2 cores) or `--protocol full` (an accelerator).\n\n"
    )  # fmt: skip
    return (
        "## μP: coordinate check and learning-rate transfer\n\n"
        f"Protocol `{p.name}`: Llama-style DecoderLM, widths {list(p.widths)}, "
        f"base width {min(p.widths)}. RMS of activation coordinates after "
        f"{p.steps} Adam steps and slope of log RMS vs log width ({slopes}).\n\n"
        f"{note}{res.table()}\n\n" + figure_links(paths) + "\n"
    )
