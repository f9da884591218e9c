r"""The small-scale-proxies study (Wortsman et al. 2023, arXiv 2309.14322).

**Learning-rate sensitivity** as the paper defines it: for a model trained at
each rate $\eta$ of a grid, with $\ell(\eta)$ the final *validation* loss,
$\ell_0$ the validation loss at initialization and $\ell^* = \min_\eta
\ell(\eta)$,
$$\mathrm{LRS} = \mathbb{E}_{\eta}\big[\min(\ell(\eta), \ell_0) - \ell^*\big]$$
(a diverged run counts as $\ell_0$; `lr_sensitivity`, the function exercise
11 uses too). It is measured for each intervention of
`VARIANTS` against width (at the base depth) and against depth (at the base
width), on `CharLM` trained with `blocklab.optimizer` (Adam, linear warm-up,
cosine decay to 10 %), every point one vmapped `blocklab.train_sweep` over the
rates. Over training the study records the largest |attention logit| and the
largest |output logit| on a fixed batch (`LogitProbe`).

Exercise 11 (`blocklab.experiments.lr_sensitivity`) is one point of this
study: its protocol's (d, N) of the `baseline` and `qk_norm` variants at a
constant rate (`run_point(..., schedule=False)`: Adam without warm-up, decay
or weight decay, which is the chapter's AdamW at weight decay 0). Both
studies train through `run_point`; the imports point one way
(`lr_sensitivity` imports this module).

`findings` puts the paper's qualitative findings next to what was measured,
each with the number it rests on and a verdict (agrees / does not agree /
inconclusive: a difference of sensitivities within `MARGIN` = 10 % of the
larger, which one seed at this scale cannot order).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from .._validate import ConfigError, check_choice
from ..data.datasets import TimeMachine
from ..models.charlm import CharLM
from ..training.losses import lm_loss
from ..training.optimizers import optimizer as make_optimizer
from ..training.run_config import RunConfig, SweepConfig
from ..training.step import validation_loss
from ..training.sweep import SweepResult, train_sweep
from ._render import figure_links, json_floats, markdown_table
from .protocol import check_protocol, report_estimate_hook, report_section_hook

__all__ = [
    "CPU",
    "FULL",
    "QUICK",
    "VARIANTS",
    "LogitProbe",
    "ProxiesProtocol",
    "ProxiesResult",
    "Variant",
    "lr_sensitivity",
    "report_estimate",
    "report_section",
    "run_point",
    "run_study",
]


class LogitProbe(eqx.Module):
    r"""`probe(model) -> {"attn", "out"}`: largest |attention| and |output| logits.

    Both are measured on the fixed batch `tokens` (`(B, T)` token ids). The
    attention logits $q^\top k/\sqrt p$ are read, block by block, from
    `TransformerBlock.trace` inside `Stack.scan(..., collect=...)`, over the
    causal (query, key) pairs only; the output logits are `model(tokens)`.
    A module (the batch is an array field), so repeated sweeps reuse one
    compiled probe.
    """

    tokens: Int[Array, "B T"]

    def _one(self, model: CharLM, t):
        T = self.tokens.shape[1]
        causal = jnp.arange(1, T + 1)
        visible = jnp.tril(jnp.ones((T, T), bool))

        def collect(block, h, key):
            tr = block.trace(h, causal, key=key)
            logits = jnp.abs(tr.attention.logits)
            return tr.output, jnp.max(jnp.where(visible, logits, 0.0))

        h = model.token_emb.weight[t] + model.pos_emb.weight[:T]
        _, attn = model.stack.scan(h, causal, collect=collect)
        return jnp.max(attn), jnp.max(jnp.abs(model(t)))

    def __call__(self, model: CharLM) -> dict[str, Float[Array, ""]]:
        attn, out = jax.vmap(lambda t: self._one(model, t))(self.tokens)
        return {"attn": jnp.max(attn), "out": jnp.max(out)}


def lr_sensitivity(
    final: Float[np.ndarray, " L"] | Sequence[float | None], l0: float
) -> float:
    r"""$\frac1L\sum_\eta [\min(\ell(\eta), \ell_0) - \ell^*]$.

    A diverged (NaN or None) $\ell(\eta)$ counts as $\ell_0$; $\ell^*$ is the
    best capped loss.
    """
    final = np.asarray([np.nan if v is None else v for v in final], np.float64)
    capped = np.where(np.isfinite(final), np.minimum(final, l0), l0)
    return float(np.mean(capped - np.min(capped)))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One intervention: model options, loss and optimizer settings.

    Attributes:
        qk_norm: QK-norm in every block.
        z_loss: the z-loss coefficient $\\alpha$ (`lm_loss(z_loss=...)`).
        weight_decay: independent weight decay $\\lambda$ (`blocklab.optimizer`).
        warmup_fraction: warm-up steps as a fraction of the run.
        parametrization: `"standard"` or `"mup"` (base width: the protocol's
            smallest width).
    """

    qk_norm: bool = False
    z_loss: float = 0.0
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    parametrization: str = "standard"


#: The interventions of the paper, each alone on top of the baseline.
VARIANTS: dict[str, Variant] = {
    "baseline": Variant(),
    "qk_norm": Variant(qk_norm=True),
    "z_loss": Variant(z_loss=1e-4),
    "indep_wd": Variant(weight_decay=1e-4),
    "long_warmup": Variant(warmup_fraction=0.25),
    "mup": Variant(parametrization="mup"),
}


@dataclasses.dataclass(frozen=True)
class ProxiesProtocol:
    """The sizes of the study.

    Attributes:
        name: how reports name it.
        widths: model widths at the base depth (the first is the base width,
            also μP's `base_width`).
        depths: depths at the base width (the first is the base depth).
        lrs: the rate grid (half-decade steps).
        steps, seq_len, batch_size, num_heads: the runs.
        record_every: steps between two logit probes.
        seed: model and data seed.
    """

    name: str
    widths: tuple[int, ...]
    depths: tuple[int, ...]
    lrs: tuple[float, ...]
    steps: int
    seq_len: int = 32
    batch_size: int = 16
    num_heads: int = 4
    record_every: int = 50
    seed: int = 0

    def points(self) -> list[tuple[int, int]]:
        """`(width, depth)`: every width at the base depth, then every other
        depth at the base width."""
        w0, n0 = self.widths[0], self.depths[0]
        return [(w, n0) for w in self.widths] + [(w0, n) for n in self.depths[1:]]


def _grid(lo: float, hi: float) -> tuple[float, ...]:
    return tuple(float(10.0**e) for e in np.arange(lo, hi + 1e-9, 0.5))


#: On an accelerator: widths 64..512, depths 2..8, 1000 steps.
FULL = ProxiesProtocol("full", (64, 128, 256, 512), (2, 4, 8), _grid(-4.0, -0.5), 1000,
                       seq_len=128, batch_size=64, record_every=100)  # fmt: skip
#: `blocklab proxies`'s default: 30 sweeps, measured 5 min 40 s on 2 idle CPU cores
#: (all six variants; 2026-11-30), so about ten minutes on 2 busy ones.
CPU = ProxiesProtocol("cpu", (32, 64, 128), (1, 2, 4), _grid(-3.5, -1.0), 200,
                      seq_len=32, batch_size=16, record_every=50)  # fmt: skip
#: Minutes: the report's `--quick`, and the tests.
QUICK = ProxiesProtocol("quick", (16, 32), (1, 2), _grid(-3.0, -1.5), 30,
                        seq_len=16, batch_size=8, record_every=15)  # fmt: skip
PROTOCOLS = {p.name: p for p in (FULL, CPU, QUICK)}


class ZLossNextToken(eqx.Module):
    """`loss_fn(model, (X, Y), key) = lm_loss(model, X, Y, z_loss=alpha)`."""

    alpha: float = eqx.field(static=True)

    def __call__(self, model, batch, key=None):
        X, Y = batch
        return lm_loss(model, X, Y, z_loss=self.alpha)


@functools.cache
def _factory(vocab, width, heads, depth, max_len, qk_norm, parametrization, base):
    def make(key):
        return CharLM(
            vocab, width, heads, depth, max_len=max_len, qk_norm=qk_norm,
            parametrization=parametrization,
            base_width=base if parametrization == "mup" else None, key=key,
        )  # fmt: skip

    return make


@eqx.filter_jit
def _val_losses(models, data):
    return eqx.filter_vmap(lambda m: validation_loss(m, data))(models)


def run_point(
    variant: Variant,
    width: int,
    depth: int,
    lrs: Sequence[float],
    *,
    data: TimeMachine,
    steps: int,
    batch_size: int,
    num_heads: int = 4,
    base_width: int | None = None,
    seed: int = 0,
    record_every: int = 50,
    probe: LogitProbe | None = None,
    schedule: bool = True,
    progress: bool = False,
) -> SweepResult:
    """One point of the study: `variant` at `(width, depth)`, all `lrs` as one sweep.

    `schedule=False` trains at a constant rate (exercise 11); otherwise a
    linear warm-up over `variant.warmup_fraction` of the steps and a cosine
    decay to 10 % over the rest. Returns the `SweepResult` (members = rates).
    """
    make = _factory(
        data.vocab_size, width, num_heads, depth, data.seq_len, variant.qk_norm,
        variant.parametrization, base_width or width,
    )  # fmt: skip
    warm = round(variant.warmup_fraction * steps) if schedule else 0
    opt = make_optimizer(
        eqx.filter_eval_shape(make, jax.random.key(0)), optax.adam,
        weight_decay=variant.weight_decay, warmup_steps=float(warm),
        decay_steps=float(steps - warm) if schedule else 0.0,
        final_fraction=0.1 if schedule else 0.0,
    )  # fmt: skip
    K = len(lrs)
    return train_sweep(
        make,
        data,
        steps,
        model_keys=[seed] * K,
        data_keys=[seed + 1] * K,
        loss_fn=ZLossNextToken(variant.z_loss) if variant.z_loss else None,
        run=RunConfig(
            batch_size=batch_size,
            steps_per_call=min(record_every, steps),
            progress=progress,
        ),
        sweep=SweepConfig(
            learning_rates=list(lrs), optimizer=opt, probe=probe, validate=False
        ),
    )


AGREES, DISAGREES, INCONCLUSIVE = "agrees", "does not agree", "inconclusive"
#: Two sensitivities closer than this fraction of the larger are not ordered.
MARGIN = 0.1


def _less(a: float, b: float) -> str:
    """The verdict on the claim a < b: within `MARGIN` of each other, inconclusive."""
    if abs(b - a) < MARGIN * max(abs(a), abs(b)):
        return INCONCLUSIVE
    return AGREES if a < b else DISAGREES


@dataclasses.dataclass(frozen=True)
class ProxiesResult:
    """What `run_study` returns.

    Attributes:
        protocol: the `ProxiesProtocol`.
        variants: the variant names run.
        val_loss: `(variant, width, depth)` -> `(L,)` final validation loss
            per rate (NaN: diverged).
        init_loss: `(variant, width, depth)` -> validation loss at init.
        sensitivity: `(variant, width, depth)` -> LRS.
        max_attn_logit, max_output_logit: `(variant, width, depth)` -> `(L,)`
            largest value over training per rate.
    """

    protocol: ProxiesProtocol
    variants: tuple[str, ...]
    val_loss: dict[tuple[str, int, int], np.ndarray]
    init_loss: dict[tuple[str, int, int], float]
    sensitivity: dict[tuple[str, int, int], float]
    max_attn_logit: dict[tuple[str, int, int], np.ndarray]
    max_output_logit: dict[tuple[str, int, int], np.ndarray]

    def _w(self):
        p = self.protocol
        return [(w, p.depths[0]) for w in p.widths]

    def _d(self):
        p = self.protocol
        return [(p.widths[0], n) for n in p.depths]

    def table(self) -> str:
        """LRS per variant vs width (base depth) and vs depth (base width)."""
        pts = [("w", w, n) for w, n in self._w()] + [
            ("d", w, n) for w, n in self._d()[1:]
        ]
        header = ["variant", *(f"d={w}, N={n}" for _, w, n in pts)]
        rows = [
            [v, *(f"{self.sensitivity[(v, w, n)]:.3f}" for _, w, n in pts)]
            for v in self.variants
        ]
        return markdown_table(header, rows)

    def logit_table(self) -> str:
        """Largest |attention| / |output| logit over training and rates (widest)."""
        w, n = self._w()[-1]
        rows = [
            [v, f"{np.nanmax(self.max_attn_logit[(v, w, n)]):.1f}",
             f"{np.nanmax(self.max_output_logit[(v, w, n)]):.1f}"]
            for v in self.variants
        ]  # fmt: skip
        return markdown_table(
            ["variant", f"max attn logit (d={w})", f"max output logit (d={w})"], rows
        )

    def _opt_idx(self, v, w, n) -> int:
        vl = self.val_loss[(v, w, n)]
        return int(np.argmin(np.where(np.isfinite(vl), vl, np.inf)))

    def findings(self) -> list[dict[str, Any]]:
        """The paper's findings, each with what was measured and a verdict.

        `verdict` is `"agrees"`, `"does not agree"`, or `"inconclusive"` when
        the comparison it rests on is within `MARGIN` (two sensitivities that
        differ by less than that fraction of the larger: one seed at a small
        scale cannot order them), or when the standard optimum does not move
        across the widths (nothing for μP to stabilize). `agrees` is
        `verdict == "agrees"`.
        """
        s = self.sensitivity
        vs = set(self.variants)
        W, D = self._w(), self._d()
        (w0, n0), (w1, _), (_, n1) = W[0], W[-1], D[-1]
        out = []

        def add(finding, measured, verdict):
            out.append(dict(finding=finding, measured=measured,
                            agrees=verdict == AGREES, verdict=verdict))  # fmt: skip

        if {"baseline", "qk_norm"} <= vs:
            a_b = np.nanmax(self.max_attn_logit[("baseline", w1, n0)])
            a_q = np.nanmax(self.max_attn_logit[("qk_norm", w1, n0)])
            lb, lq = s[("baseline", w1, n0)], s[("qk_norm", w1, n0)]
            add("QK-norm removes attention-logit growth and lowers LR sensitivity",
                f"d={w1}: max attn logit {a_b:.1f} (baseline) vs {a_q:.1f} (QK-norm); "
                f"LRS {lb:.3f} vs {lq:.3f}",
                _less(lq, lb) if a_q < a_b else DISAGREES)  # fmt: skip
        if "baseline" in vs:
            l0, l1 = s[("baseline", w0, n0)], s[("baseline", w1, n0)]
            add(
                "LR sensitivity still rises with size (width)",
                f"baseline LRS {l0:.3f} at d={w0} -> {l1:.3f} at d={w1}",
                _less(l0, l1),
            )
        if {"baseline", "mup"} <= vs:
            shift = {v: max(self._opt_idx(v, w, n) for w, n in W)
                     - min(self._opt_idx(v, w, n) for w, n in W)
                     for v in ("baseline", "mup")}  # fmt: skip
            lm, lb = s[("mup", w1, n0)], s[("baseline", w1, n0)]
            ok = shift["mup"] <= shift["baseline"] and lm > 0.5 * lb
            add("μP stabilizes the optimal rate across widths but not the sensitivity",
                f"optimum moves {shift['mup']} grid steps (μP) vs {shift['baseline']} "
                f"(standard); LRS at d={w1} {lm:.3f} (μP) vs {lb:.3f}",
                INCONCLUSIVE if shift["baseline"] == 0 and ok
                else AGREES if ok else DISAGREES)  # fmt: skip
        for v, what in (
            ("long_warmup", "longer warm-up"),
            ("indep_wd", "independent weight decay"),
        ):
            if {"baseline", v} <= vs:
                mb = np.mean([s[("baseline", w, n)] for w, n in W + D[1:]])
                mv = np.mean([s[(v, w, n)] for w, n in W + D[1:]])
                add(
                    f"{what} lowers LR sensitivity",
                    f"mean LRS over the points {mv:.3f} vs baseline {mb:.3f}",
                    _less(mv, mb),
                )
        if "baseline" in vs and len(D) > 1:
            dw = s[("baseline", w1, n0)] - s[("baseline", w0, n0)]
            dd = s[("baseline", w0, n1)] - s[("baseline", w0, n0)]
            fw, fd = math.log2(w1 / w0), math.log2(n1 / n0)
            near = abs(dd / fd - dw / fw) < MARGIN * abs(s[("baseline", w0, n0)])
            add("depth hurts (raises LRS) more than width",
                f"baseline LRS change per doubling: depth {dd / fd:+.3f}, width "
                f"{dw / fw:+.3f}",
                INCONCLUSIVE if near else AGREES if dd / fd > dw / fw
                else DISAGREES)  # fmt: skip
        return out

    def findings_table(self) -> str:
        rows = [[f["finding"], f["measured"], f["verdict"]] for f in self.findings()]
        return markdown_table(
            ["paper's finding", "measured here", "verdict"], rows, align="llc"
        )

    def to_json(self) -> dict[str, Any]:
        def key(k):
            return f"{k[0]}/d={k[1]}/N={k[2]}"

        return {
            "protocol": dataclasses.asdict(self.protocol),
            "variants": list(self.variants),
            "sensitivity": {
                key(k): json_floats(v) for k, v in self.sensitivity.items()
            },
            "init_loss": {key(k): json_floats(v) for k, v in self.init_loss.items()},
            "val_loss": {key(k): json_floats(v) for k, v in self.val_loss.items()},
            "max_attn_logit": {
                key(k): json_floats(v) for k, v in self.max_attn_logit.items()
            },
            "max_output_logit": {
                key(k): json_floats(v) for k, v in self.max_output_logit.items()
            },
            "findings": self.findings(),
        }

    def figures(self, out_dir: str | Path) -> list[Path]:
        """`proxies_width.png`, `proxies_depth.png`: LRS per variant."""
        from .plotting import line_plot

        out = []
        for stem, pts, x, label in (
            ("proxies_width", self._w(), [w for w, _ in self._w()], "width d"),
            ("proxies_depth", self._d(), [n for _, n in self._d()], "depth (blocks)"),
        ):
            ys = {
                v: [self.sensitivity[(v, w, n)] for w, n in pts] for v in self.variants
            }
            out.append(line_plot(Path(out_dir) / f"{stem}.png", x, ys, xlabel=label,
                                 ylabel="LR sensitivity (nats)", logx=True,
                                 title=f"LR sensitivity vs {label}"))  # fmt: skip
        return out


def run_study(
    protocol: Any = CPU,
    variants: Sequence[str] = tuple(VARIANTS),
    *,
    data: TimeMachine | None = None,
    progress: bool = False,
) -> ProxiesResult:
    """Run every variant at every point of `protocol` (one sweep per point)."""
    owner = "proxies.run_study"
    check_protocol(owner, protocol, ProxiesProtocol, "FULL, CPU, QUICK")
    variants = tuple(check_choice(owner, "variants[i]", v, tuple(VARIANTS))
                     for v in variants)  # fmt: skip
    if not variants:
        raise ConfigError(f"{owner}: give at least one variant of {list(VARIANTS)}.")
    p = protocol
    data = TimeMachine(seq_len=p.seq_len) if data is None else data
    n_probe = 4
    stride = max(1, data.num_train // n_probe)
    probe = LogitProbe(data.windows(jnp.arange(n_probe) * stride)[0])
    val, init, sens, attn, out = {}, {}, {}, {}, {}
    for v in variants:
        var = VARIANTS[v]
        for w, n in p.points():
            res = run_point(
                var, w, n, p.lrs, data=data, steps=p.steps, batch_size=p.batch_size,
                num_heads=p.num_heads, base_width=p.widths[0], seed=p.seed,
                record_every=p.record_every, probe=probe, progress=progress,
            )  # fmt: skip
            k = (v, w, n)
            vl = np.asarray(_val_losses(res.state.model, data), np.float64)
            val[k] = np.where(res.diverged_at > 0, np.nan, vl)
            make = _factory(data.vocab_size, w, p.num_heads, n, data.seq_len,
                            var.qk_norm, var.parametrization, p.widths[0])  # fmt: skip
            init[k] = float(_val_one(make(jax.random.key(p.seed)), data))
            sens[k] = lr_sensitivity(val[k], init[k])
            attn[k] = np.nanmax(np.asarray(res.probes["attn"], np.float64), axis=1)
            out[k] = np.nanmax(np.asarray(res.probes["out"], np.float64), axis=1)
    return ProxiesResult(p, variants, val, init, sens, attn, out)


_val_one = eqx.filter_jit(validation_loss)


def report_protocol(*, quick: bool = False, full: bool = False) -> ProxiesProtocol:
    """The report runs `QUICK` on a CPU (its section stays small; the command's
    `--protocol cpu` is the ten-minute one) and `FULL` with `full`."""
    return FULL if full else QUICK


def report_variants(*, quick: bool = False, full: bool = False) -> tuple[str, ...]:
    """The report's variants: all with `full`; on a CPU four (the report's time
    budget; `blocklab proxies` runs all six); with `quick` the exercise-11 pair."""
    if full:
        return tuple(VARIANTS)
    return (
        ("baseline", "qk_norm") if quick else ("baseline", "qk_norm", "z_loss", "mup")
    )


def estimate_seconds(p: ProxiesProtocol, num_variants: int = len(VARIANTS)) -> float:
    """Seconds on 2 idle CPU cores: ~10 s compilation per sweep + training FLOPs
    at ~50 GFLOP/s (small models use the cores poorly)."""
    flops = 0.0
    for w, n in p.points():
        per_token = 6 * 12 * n * w * w + 12 * n * p.seq_len * w
        flops += len(p.lrs) * p.steps * p.batch_size * p.seq_len * per_token
    return num_variants * (10.0 * len(p.points()) + flops / 50e9)


@report_estimate_hook("proxies")
def report_estimate(*, quick: bool, full: bool) -> float:
    """Seconds on 2 idle CPU cores of the report's section."""
    p = report_protocol(quick=quick, full=full)
    return estimate_seconds(p, len(report_variants(quick=quick, full=full)))


@report_section_hook("proxies")
def report_section(out_dir: Path, *, quick: bool, full: bool, progress: bool) -> str:
    """Run the study at the report's size; the Markdown section with its figures."""
    p = report_protocol(quick=quick, full=full)
    res = run_study(p, report_variants(quick=quick, full=full), progress=progress)
    paths = res.figures(out_dir)
    return (
        "## Small-scale proxies: learning-rate sensitivity (Wortsman et al. 2023)\n\n"
        f"Protocol `{p.name}`: CharLM, widths {list(p.widths)} (depth {p.depths[0]}), "
        f"depths {list(p.depths)} (width {p.widths[0]}), {len(p.lrs)} rates "
        f"{p.lrs[0]:.0e}..{p.lrs[-1]:.0e}, {p.steps} steps of {p.batch_size} x "
        f"{p.seq_len}, Adam with warm-up and cosine decay; sensitivity on the final "
        "validation loss.\n\n"
        f"{res.table()}\n\n{res.logit_table()}\n\n{res.findings_table()}\n\n"
        + figure_links(paths)
        + "\n"
    )


def _check_protocol_name(name: str) -> ProxiesProtocol:
    return PROTOCOLS[check_choice("proxies", "protocol", name, tuple(PROTOCOLS))]
