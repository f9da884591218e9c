r"""Learning-rate sensitivity with and without QK-norm: the chapter's exercise 11.

Wortsman et al. (2024) summarize the final loss $\ell(\eta)$ of a model over
learning rates $\eta$ by its learning-rate sensitivity
$$\mathbb{E}_\eta\big[\min(\ell(\eta), \ell_0) - \ell^*\big],$$
$\ell_0$ the loss at initialization and $\ell^*$ the best final loss over the
rates tried. `run_study` trains `CharLM` with and without QK-norm at seven
rates $10^{-4}, 10^{-3.5}, \ldots, 10^{-1}$, each model's rates as ONE
`blocklab.train_sweep` (vmapped over the rates, sharded over the devices),
and records every `record_every` steps the mean training loss of the last
`record_every` steps, the largest |attention logit| and the largest |output
logit| on a fixed batch (`LogitProbe`).

The exercise is one point of the small-scale-proxies study
(`blocklab.experiments.proxies`): each model is `proxies.run_point` of the
`baseline` or `qk_norm` variant at (d, N) = (`num_hiddens`, `num_blks`) with
`schedule=False`, i.e. `blocklab.optimizer(model, optax.adam)` at a constant
rate and no weight decay, which is the chapter's AdamW at weight decay 0
(`test_exercise_11_is_a_point_of_the_proxies_study` checks both). The
sensitivity and the probe are the study's (`proxies.lr_sensitivity`,
`proxies.LogitProbe`, re-exported here).

**Protocols** (`LRProtocol`): `FULL` is the exercise's (d = 256, 6 blocks,
$64 \times 128$ batches, 1000 steps: about 3.5 PFLOP, hours on a 2-core CPU,
minutes on a GPU); `CPU` is the reduced protocol `blocklab report` runs
without an accelerator (a few minutes on 2 cores); `QUICK` is smaller still
(`blocklab lr-sensitivity --quick`, `blocklab report --quick`).

**Decision rule** (for every rate where the model without QK-norm ends worse,
i.e. its final loss exceeds the QK-norm model's by more than `GAP` nats, or it
diverged and the other did not): attention-logit growth explains the gap if
the no-QK-norm model's largest |attention logit| over the recorded steps is at
least `GROWTH` times its value at initialization *and* at least `RATIO` times
the QK-norm model's largest at the same rate. If not, output-logit growth
explains it if the no-QK-norm model's largest |output logit| is at least
`RATIO` times the QK-norm model's. Otherwise neither does.

A member that diverges is frozen at its last finite model and reported (its
final loss is `None` in JSON and its step in `diverged`); divergence at high
rates is a result of the study, not an error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._validate import ConfigError, check_float, check_int
from ..data.datasets import TimeMachine
from ..training.sweep import SweepResult
from . import proxies
from ._render import figure_links, json_floats, markdown_table
from ._seeds import check_seed
from .plotting import line_plot
from .protocol import check_protocol, report_estimate_hook, report_section_hook
from .proxies import LogitProbe, lr_sensitivity

__all__ = [
    "CPU",
    "FULL",
    "GAP",
    "GROWTH",
    "LRS",
    "LRProtocol",
    "LRSensitivityResult",
    "LogitProbe",
    "MODELS",
    "QUICK",
    "RATIO",
    "estimate_seconds",
    "lr_sensitivity",
    "run_study",
    "study_flops",
    "verdicts",
]

#: The exercise's rates: 10^-4, 10^-3.5, ..., 10^-1.
LRS = tuple(float(10.0**e) for e in np.arange(-4.0, -0.75, 0.5))
#: Decision rule: a gap is a final-loss excess of more than GAP nats ...
GAP = 0.02
#: ... attention logits "grew" if their max reached GROWTH x their init value ...
GROWTH = 10.0
#: ... and "explain" a gap if also RATIO x the QK-norm model's (same for output logits).
RATIO = 2.0
MODELS = ("qk_norm", "no_qk_norm")
#: Sustained training FLOP/s of this model on a 2-core CPU (measured, rounded).
CPU_FLOPS = 200e9


@dataclasses.dataclass(frozen=True)
class LRProtocol:
    """The sizes of one learning-rate study (validated at construction).

    Attributes:
        name: how the report and the tables name it.
        num_hiddens, num_blks, num_heads: width d, depth, heads of `CharLM`.
        seq_len: characters per training sequence T.
        batch_size: sequences per step.
        steps: optimizer steps per run (a multiple of `record_every` is best;
            the loss is read per window of `record_every` steps).
        record_every: steps per window and between two logit probes.
        probe_batch: sequences in the fixed batch of `LogitProbe`.
    """

    name: str
    num_hiddens: int
    num_blks: int
    num_heads: int
    seq_len: int
    batch_size: int
    steps: int
    record_every: int
    probe_batch: int = 8

    def __post_init__(self):
        owner = f"LRProtocol({self.name!r})"
        for f in dataclasses.fields(self):
            if f.name != "name":
                check_int(owner, f.name, getattr(self, f.name), min=1)
        if self.num_hiddens % self.num_heads:
            raise ConfigError(
                f"{owner}: num_hiddens must be a multiple of num_heads, got "
                f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}."
            )
        if self.steps < self.record_every:
            raise ConfigError(
                f"{owner}: steps must be >= record_every, got steps={self.steps}, "
                f"record_every={self.record_every}."
            )

    def replace(self, **changes: Any) -> LRProtocol:
        """A copy with some sizes changed (named `"custom"` unless `name` is given)."""
        changes.setdefault("name", "custom" if changes else self.name)
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self, lrs: Sequence[float] = LRS) -> str:
        """One sentence: the model, data, optimizer, steps and rates."""
        return (
            f"Protocol `{self.name}`: CharLM d = {self.num_hiddens}, {self.num_blks} "
            f"blocks, {self.num_heads} heads, batches of {self.batch_size} x "
            f"{self.seq_len} characters, AdamW (no weight decay), {self.steps} steps, "
            f"{len(lrs)} learning rates {lrs[0]:.0e} .. {lrs[-1]:.0e}; losses are "
            f"means over each window of {self.record_every} steps, logits on a "
            f"fixed batch of {self.probe_batch} sequences."
        )


#: The exercise's protocol (the chapter's, section 11.1.4.2, at d = 256, 6 blocks).
FULL = LRProtocol("full", 256, 6, 4, 128, 64, 1000, 100, 8)
#: The reduced protocol of `blocklab report` on a CPU (a few minutes on 2 cores).
CPU = LRProtocol("cpu", 64, 2, 4, 64, 32, 400, 40, 8)
#: The smallest protocol: `blocklab lr-sensitivity --quick`, `blocklab report --quick`.
QUICK = LRProtocol("quick", 64, 2, 4, 32, 16, 300, 30, 8)
PROTOCOLS = {p.name: p for p in (FULL, CPU, QUICK)}


def _window_means(losses: np.ndarray, every: int) -> np.ndarray:
    """Mean loss over each window of `every` steps: `(K, steps // every)`."""
    K, S = losses.shape
    n = S // every
    return losses[:, : n * every].reshape(K, n, every).mean(-1)


def study_flops(p: LRProtocol, lrs: Sequence[float] = LRS) -> float:
    """Training FLOPs of the study: 2 models x len(lrs) rates x steps.

    Per token, forward and backward: 6 x the matmul weights (about $12 d^2$ per
    SwiGLU block) plus $12 T d$ per block for the attention scores and mixing.
    """
    d, L, T = p.num_hiddens, p.num_blks, p.seq_len
    per_token = 6 * 12 * L * d * d + 12 * L * T * d
    return 2.0 * len(lrs) * p.steps * p.batch_size * T * per_token


def estimate_seconds(p: LRProtocol, lrs: Sequence[float] = LRS) -> float:
    """Rough wall time of `run_study(p, lrs)` on an idle 2-core CPU (s).

    `study_flops` at `CPU_FLOPS` scaled by `min(1, d / 256)` (narrow models
    use the cores less well), plus about 20 s of compilation and probing.
    """
    rate = CPU_FLOPS * min(1.0, p.num_hiddens / 256)
    return study_flops(p, lrs) / rate + 20.0


def _fmt(x) -> str:
    return "diverged" if x is None or not math.isfinite(x) else f"{x:.3f}"


def _nanmax(v) -> float:
    v = np.asarray(v, np.float64)
    v = v[np.isfinite(v)]
    return float(v.max()) if v.size else math.nan


def _ratio(a, b) -> float:
    with np.errstate(all="ignore"):
        return float(np.float64(a) / np.float64(b))


def verdicts(final, attn, logit) -> list[dict[str, Any]]:
    """The decision rule (module docstring) at each rate where no-QK-norm ends worse.

    `final[m]` is `(L,)` final losses, `attn[m]` / `logit[m]` are `(L, R)`
    recorded largest logits (step 0 first), for m in `MODELS`.
    """
    q, n = (np.asarray(final[m], np.float64) for m in MODELS)
    out = []
    for i in range(len(q)):
        worse = (np.isnan(n[i]) and not np.isnan(q[i])) or n[i] - q[i] > GAP
        if not worse:
            continue
        a_n, a_q = _nanmax(attn["no_qk_norm"][i]), _nanmax(attn["qk_norm"][i])
        o_n, o_q = _nanmax(logit["no_qk_norm"][i]), _nanmax(logit["qk_norm"][i])
        growth = _ratio(a_n, attn["no_qk_norm"][i][0])
        if growth >= GROWTH and a_n >= RATIO * a_q:
            cause = "attention logits"
        elif o_n >= RATIO * o_q:
            cause = "output logits"
        else:
            cause = "neither"
        out.append(
            dict(
                index=i,
                gap=None if np.isnan(n[i]) or np.isnan(q[i]) else float(n[i] - q[i]),
                attn_growth=growth,
                attn_ratio=_ratio(a_n, a_q),
                output_ratio=_ratio(o_n, o_q),
                explained_by=cause,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class LRSensitivityResult:
    """What `run_study` returns (NumPy float64 arrays; NaN marks a diverged value).

    Attributes:
        protocol: the `LRProtocol` that ran.
        lrs: `(L,)` learning rates.
        seed: the model/data seed.
        steps: `(R,)` the steps of the logit records (0 is the initialization).
        final_loss: model -> `(L,)` mean loss of the last window (NaN: diverged).
        initial_loss: model -> mean loss of the first step over the rates.
        sensitivity: model -> `lr_sensitivity(final_loss, initial_loss)`.
        max_attn_logit, max_output_logit: model -> `(L, R)` largest logits.
        loss_curves: model -> `(L, steps // record_every)` window means.
        diverged_at: model -> `(L,)` 1-based step of the first non-finite loss or
            update, 0 for a run that never diverged.
        verdicts: the decision rule's verdict at each rate where the model
            without QK-norm ends worse.
    """

    protocol: LRProtocol
    lrs: tuple[float, ...]
    seed: int
    steps: np.ndarray
    final_loss: dict[str, np.ndarray]
    initial_loss: dict[str, float]
    sensitivity: dict[str, float]
    max_attn_logit: dict[str, np.ndarray]
    max_output_logit: dict[str, np.ndarray]
    loss_curves: dict[str, np.ndarray]
    diverged_at: dict[str, np.ndarray]
    verdicts: list[dict[str, Any]]

    @property
    def diverged(self) -> list[dict[str, Any]]:
        """One `{"model", "lr", "step"}` per run that diverged."""
        return [
            {"model": m, "lr": lr, "step": int(d)}
            for m in MODELS
            for lr, d in zip(self.lrs, self.diverged_at[m], strict=True)
            if d
        ]

    def to_json(self) -> dict[str, Any]:
        """Strict-JSON data (non-finite -> `None`), with `diverged` naming the runs."""
        return {
            "protocol": self.protocol.as_dict(),
            "lrs": list(self.lrs),
            "seed": self.seed,
            "steps": [int(s) for s in self.steps],
            "final_loss": {m: json_floats(v) for m, v in self.final_loss.items()},
            "initial_loss": {m: json_floats(v) for m, v in self.initial_loss.items()},
            "sensitivity": {m: json_floats(v) for m, v in self.sensitivity.items()},
            "max_attn_logit": {
                m: json_floats(v) for m, v in self.max_attn_logit.items()
            },
            "max_output_logit": {
                m: json_floats(v) for m, v in self.max_output_logit.items()
            },
            "loss_curves": {m: json_floats(v) for m, v in self.loss_curves.items()},
            "diverged_at": {
                m: [int(d) for d in v] for m, v in self.diverged_at.items()
            },
            "diverged": self.diverged,
            "verdicts": [
                {
                    k: (json_floats(v) if isinstance(v, float) else v)
                    for k, v in d.items()
                }
                for d in self.verdicts
            ],
        }

    def table(self) -> str:
        """Markdown: final loss and largest logits per rate, both models."""
        header = (
            "lr", "final loss QK-norm", "final loss no QK-norm",
            "max attn logit QK / no", "max output logit QK / no",
        )  # fmt: skip
        rows = []
        for i, lr in enumerate(self.lrs):
            f = [self.final_loss[m][i] for m in MODELS]
            a = [_nanmax(self.max_attn_logit[m][i]) for m in MODELS]
            o = [_nanmax(self.max_output_logit[m][i]) for m in MODELS]
            rows.append(
                (
                    f"{lr:.2e}",
                    _fmt(f[0]),
                    _fmt(f[1]),
                    f"{a[0]:.1f} / {a[1]:.1f}",
                    f"{o[0]:.1f} / {o[1]:.1f}",
                )
            )
        return markdown_table(header, rows, align="rrrrr")

    def explanation(self) -> str:
        """One line per rate where the model without QK-norm ends worse."""
        if not self.verdicts:
            return (
                f"The model without QK-norm ends worse (by more than {GAP} nats) at "
                "no learning rate."
            )
        lines = []
        for v in self.verdicts:
            lr = self.lrs[v["index"]]
            gap = "it diverged" if v["gap"] is None else f"gap {v['gap']:.3f} nats"
            lines.append(
                f"- lr {lr:.2e} ({gap}): attention logits grew {v['attn_growth']:.1f}x"
                f" from init, {v['attn_ratio']:.1f}x the QK-norm model's; output "
                f"logits {v['output_ratio']:.1f}x the QK-norm model's: explained by "
                f"**{v['explained_by']}**."
            )
        return "\n".join(lines)

    def sensitivity_line(self) -> str:
        s = self.sensitivity
        return (
            f"Learning-rate sensitivity E[min(l, l0) - l*]: QK-norm "
            f"{s['qk_norm']:.3f}, no QK-norm {s['no_qk_norm']:.3f} (l0 = "
            f"{self.initial_loss['no_qk_norm']:.3f})."
        )

    def figures(self, out_dir: str | Path) -> list[Path]:
        """Final loss vs lr (both models); attention- and output-logit growth per model.

        Writes `lr_final_loss.png`, `lr_attn_logits_{model}.png` and
        `lr_output_logits_{model}.png` into `out_dir`; diverged (NaN) points
        and extreme rates are handled by `blocklab.experiments.plotting`.
        """
        out_dir = Path(out_dir)
        lrs = list(self.lrs)
        paths = [
            line_plot(
                out_dir / "lr_final_loss.png",
                lrs,
                {m: self.final_loss[m].tolist() for m in MODELS},
                xlabel="learning rate",
                ylabel="final training loss (nats/char)",
                logx=True,
                title="CharLM: final loss vs learning rate",
                hlines={"loss at init": self.initial_loss["no_qk_norm"]},
            )  # fmt: skip
        ]
        # One figure per quantity and model: seven rates keep distinct colours.
        for data, label, stem in (
            (self.max_attn_logit, "largest |attention logit|", "lr_attn_logits"),
            (self.max_output_logit, "largest |output logit|", "lr_output_logits"),
        ):
            for m in MODELS:
                ys = {
                    f"lr {lr:.0e}": r.tolist()
                    for lr, r in zip(lrs, data[m], strict=True)
                }
                paths.append(
                    line_plot(
                        out_dir / f"{stem}_{m}.png",
                        [float(s) for s in self.steps],
                        ys,
                        xlabel="step",
                        ylabel=label,
                        logy=True,
                        title=f"{label} on a fixed batch, {m.replace('_', ' ')}",
                    )  # fmt: skip
                )
        return paths


def figure_paths(out_dir: str | Path) -> list[Path]:
    """The files `LRSensitivityResult.figures(out_dir)` writes (to check them
    before a run)."""
    out_dir = Path(out_dir)
    return [out_dir / "lr_final_loss.png"] + [
        out_dir / f"{stem}_{m}.png"
        for stem in ("lr_attn_logits", "lr_output_logits")
        for m in MODELS
    ]


def _check_lrs(owner: str, lrs) -> tuple[float, ...]:
    lrs = tuple(lrs)
    if not lrs:
        raise ConfigError(f"{owner}: lrs must hold at least one learning rate.")
    out = tuple(
        check_float(owner, f"lrs[{i}]", v, min=0.0, min_open=True)
        for i, v in enumerate(lrs)
    )
    if len(set(out)) != len(out):
        raise ConfigError(f"{owner}: lrs must be distinct, got {list(out)}.")
    return out


def run_study(
    protocol: LRProtocol = FULL,
    lrs: Sequence[float] = LRS,
    *,
    seed: int = 0,
    data: TimeMachine | None = None,
    progress: bool = False,
) -> LRSensitivityResult:
    """Train both models at every rate under `protocol`; returns the typed result.

    Both models start from `jax.random.key(seed)` and see the batches of
    `key(seed + 1)` at every rate; each model's rates run as one
    `proxies.run_point(..., schedule=False)`, i.e. one `train_sweep` (the
    rates vmapped, sharded over the devices).

    Args:
        protocol: an `LRProtocol` (`FULL`, `CPU`, `QUICK`, or `FULL.replace(...)`).
        lrs: distinct positive learning rates (default the exercise's seven).
        seed: a non-negative int seed.
        data: the corpus (default `TimeMachine(seq_len=protocol.seq_len)`).
        progress: a tqdm bar per model.
    """
    owner = "run_study"
    check_protocol(
        owner,
        protocol,
        LRProtocol,
        "FULL, CPU, QUICK or FULL.replace(...)",
        article="an",
    )
    lrs = _check_lrs(owner, lrs)
    seed = check_seed(owner, "seed", seed)
    p = protocol
    data = TimeMachine(seq_len=p.seq_len) if data is None else data
    stride = max(1, data.num_train // p.probe_batch)
    tokens = data.windows(jnp.arange(p.probe_batch) * stride)[0]
    probe = LogitProbe(tokens)
    results: dict[str, SweepResult] = {}
    for name in MODELS:
        # The study's point (d, N) of its baseline / QK-norm variant, at a
        # constant rate: Adam without weight decay, as the chapter's AdamW.
        variant = proxies.VARIANTS["qk_norm" if name == "qk_norm" else "baseline"]
        results[name] = proxies.run_point(
            variant, p.num_hiddens, p.num_blks, lrs, data=data, steps=p.steps,
            batch_size=p.batch_size, num_heads=p.num_heads, seed=seed,
            record_every=p.record_every, probe=probe, schedule=False,
            progress=progress,
        )  # fmt: skip
    return _summarize(results, p, lrs, seed)


def _summarize(results: dict[str, SweepResult], p: LRProtocol, lrs, seed):
    final, sens, attn, logit, div, curves, l0 = {}, {}, {}, {}, {}, {}, {}
    for name, res in results.items():
        losses = np.asarray(res.losses, np.float64)
        curves[name] = _window_means(losses, p.record_every)
        final[name] = curves[name][:, -1]
        l0[name] = float(np.nanmean(losses[:, 0]))
        sens[name] = lr_sensitivity(final[name], l0[name])
        attn[name] = np.asarray(res.probes["attn"], np.float64)
        logit[name] = np.asarray(res.probes["out"], np.float64)
        div[name] = np.asarray(res.diverged_at, np.int64)
    steps = np.asarray(results[MODELS[0]].probe_steps, np.int64)
    return LRSensitivityResult(
        p, tuple(lrs), seed, steps, final, l0, sens, attn, logit, curves, div,
        verdicts(final, attn, logit),
    )  # fmt: skip


def rule_text() -> str:
    """The decision rule in one paragraph (for reports)."""
    return (
        f"Decision rule: a gap is a final loss worse by more than {GAP} nats; "
        f"attention-logit growth explains it if the largest |attention logit| grew "
        f">= {GROWTH:g}x from init and reached >= {RATIO:g}x the QK-norm model's; "
        f"otherwise output-logit growth explains it if the largest |output logit| "
        f"reached >= {RATIO:g}x the QK-norm model's."
    )


def report_protocol(*, quick: bool = False, full: bool = False) -> LRProtocol:
    """The protocol `blocklab report` runs: QUICK, FULL, or else CPU."""
    return QUICK if quick else FULL if full else CPU


@report_estimate_hook("lr_sensitivity")
def report_estimate(*, quick: bool, full: bool) -> float:
    """Seconds on 2 CPU cores of the protocol the report runs."""
    return estimate_seconds(report_protocol(quick=quick, full=full))


def slow_warning(protocol: LRProtocol, lrs: Sequence[float] = LRS) -> str | None:
    """A line saying how long `protocol` takes on a 2-core CPU, when that is more
    than half an hour (`None` otherwise); the CLI prints it on a CPU backend."""
    flops = study_flops(protocol, lrs)
    hours = flops / CPU_FLOPS / 3600
    if hours <= 0.5:
        return None
    return (
        f"lr-sensitivity: this protocol is {flops / 1e15:.1f} PFLOP of training, "
        f"about {hours:.0f} h on a 2-core CPU at 200 GFLOP/s (minutes on a GPU); "
        "--quick runs a reduced protocol in minutes."
    )


@report_section_hook("lr_sensitivity")
def report_section(out_dir: Path, *, quick: bool, full: bool, progress: bool) -> str:
    """Run exercise 11 for the report; write its PNGs; return the Markdown section.

    `quick` runs `QUICK`, `full` runs `FULL` (an accelerator, or `--full`),
    otherwise `CPU`; the section names the protocol, and when it is not the
    full one, how to run that. `progress`: a tqdm bar per model.
    """
    protocol = report_protocol(quick=quick, full=full)
    result = run_study(protocol, progress=progress)
    paths = result.figures(out_dir)
    note = ""
    if protocol is not FULL:
        full_text = FULL.describe().split(": ", 1)[1]
        note = (
            f"This is the reduced protocol `{protocol.name}`, sized for a CPU; the "
            f"exercise's protocol (`full`: {full_text}) runs with "
            "`blocklab report --full` (the default on a GPU or TPU) or "
            "`blocklab lr-sensitivity`, and takes hours on a 2-core CPU.\n\n"
        )
    return (
        "## Learning-rate sensitivity with and without QK-norm (exercise 11)\n\n"
        f"{protocol.describe()}\n\n{note}{result.table()}\n\n"
        f"{result.sensitivity_line()}\n\n{rule_text()}\n\n{result.explanation()}\n\n"
        + figure_links(paths)
        + "\n"
    )
