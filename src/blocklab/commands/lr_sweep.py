r"""`blocklab lr-sweep`: learning-rate sensitivity with and without QK-norm.

The chapter's exercise 11.

Wortsman et al. (2024) summarize the final loss $\ell(\eta)$ of a model over
learning rates $\eta$ by its learning-rate sensitivity
$$\mathbb{E}_\eta\big[\min(\ell(\eta), \ell_0) - \ell^*\big],$$
$\ell_0$ the loss at initialization and $\ell^*$ the best final loss over the
rates tried. This command trains `CharLM` with and without QK-norm at seven
rates $10^{-4}, 10^{-3.5}, \ldots, 10^{-1}$, each model's seven rates as ONE
`blocklab.sweep.train_sweep` (vmapped over the rates, sharded over the
devices), and records every `record_every` steps the mean training loss of
the last `record_every` steps, the largest |attention logit| and the largest
|output logit| on a fixed batch.

**Decision rule** (for every rate where the model without QK-norm ends worse,
i.e. its final loss exceeds the QK-norm model's by more than `GAP` nats, or it
diverged and the other did not): attention-logit growth explains the gap if
the no-QK-norm model's largest |attention logit| over the recorded steps is at
least `GROWTH` times its value at initialization *and* at least `RATIO` times
the QK-norm model's largest at the same rate. If not, output-logit growth
explains it if the no-QK-norm model's largest |output logit| is at least
`RATIO` times the QK-norm model's. Otherwise neither does.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int
from tqdm.auto import tqdm

from ..data import TimeMachine
from ..models import CharLM
from ..plotting import line_plot
from ..sweep import SweepResult, train_sweep

NAME = "lr_sweep"
HELP = "learning-rate sensitivity of CharLM with and without QK-norm (exercise 11)"

#: The exercise's rates: 10^-4, 10^-3.5, ..., 10^-1.
LRS = tuple(float(10.0**e) for e in np.arange(-4.0, -0.75, 0.5))
#: The exercise's protocol (the chapter's, section 11.1.4.2, at d = 256, 6 blocks).
FULL = dict(
    num_hiddens=256,
    num_blks=6,
    num_heads=4,
    seq_len=128,
    batch_size=64,
    steps=1000,
    record_every=100,
    probe_batch=8,
)
#: The reduced protocol of `--quick` (minutes on 2 CPU cores).
QUICK = dict(
    num_hiddens=64,
    num_blks=2,
    num_heads=4,
    seq_len=32,
    batch_size=16,
    steps=300,
    record_every=30,
    probe_batch=8,
)
#: Decision rule: a gap is a final-loss excess of more than GAP nats ...
GAP = 0.02
#: ... attention logits "grew" if their max reached GROWTH x their init value ...
GROWTH = 10.0
#: ... and "explain" a gap if also RATIO x the QK-norm model's (same for output logits).
RATIO = 2.0
MODELS = ("qk_norm", "no_qk_norm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the reduced protocol (see QUICK) instead of the full one",
    )
    parser.add_argument(
        "--lrs",
        nargs="+",
        type=float,
        default=None,
        help="learning rates (default: 10^-4, 10^-3.5, ..., 10^-1)",
    )
    for name in (
        "steps",
        "record_every",
        "num_hiddens",
        "num_blks",
        "batch_size",
        "seq_len",
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help="override the protocol's value",
        )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default="lr_sweep",
        metavar="DIR",
        help="folder for the PNG plots (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true")


class LogitProbe(eqx.Module):
    """`probe(model) -> {"attn", "out"}`: largest |attention| and |output| logits.

    Both are measured on the fixed batch `tokens` (`(B, T)` token ids). The
    attention logits $q^\\top k/\\sqrt p$ are read, block by block, from
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


@functools.cache
def _model_factory(vocab_size, num_hiddens, num_heads, num_blks, max_len, qk_norm):
    # One function per configuration, so that repeated sweeps reuse compilations.
    def make_model(key):
        return CharLM(
            vocab_size, num_hiddens, num_heads, num_blks, max_len=max_len,
            qk_norm=qk_norm, key=key,
        )  # fmt: skip

    return make_model


def lr_sensitivity(
    final: Float[np.ndarray, " L"] | Sequence[float], l0: float
) -> float:
    r"""$\frac1L\sum_\eta [\min(\ell(\eta), \ell_0) - \ell^*]$.

    A diverged (NaN) $\ell(\eta)$ counts as $\ell_0$; $\ell^*$ is the best capped loss.
    """
    final = np.asarray(final, np.float64)
    capped = np.where(np.isfinite(final), np.minimum(final, l0), l0)
    return float(np.mean(capped - np.min(capped)))


def _window_means(losses: np.ndarray, every: int) -> np.ndarray:
    """Mean loss over each window of `every` steps: `(K, steps // every)`."""
    K, S = losses.shape
    n = S // every
    return losses[:, : n * every].reshape(K, n, every).mean(-1)


def run_study(
    protocol: dict[str, int],
    lrs=LRS,
    *,
    seed: int = 0,
    data: TimeMachine | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train both models at every rate; returns the JSON-ready result (see `to_json`).

    Both models start from the same key and see the same batches at every
    rate; each model's rates run as one `train_sweep`.
    """
    p = protocol
    data = TimeMachine(num_steps=p["seq_len"]) if data is None else data
    stride = max(1, data.num_train // p["probe_batch"])
    tokens = data.windows(jnp.arange(p["probe_batch"]) * stride)[0]
    probe = LogitProbe(tokens)
    K = len(lrs)
    results: dict[str, SweepResult] = {}
    for name in MODELS:
        make_model = _model_factory(
            data.vocab_size, p["num_hiddens"], p["num_heads"], p["num_blks"],
            p["seq_len"], name == "qk_norm",
        )  # fmt: skip
        results[name] = train_sweep(
            make_model,
            data,
            p["steps"],
            model_keys=[seed] * K,
            data_keys=[seed + 1] * K,
            learning_rates=lrs,
            batch_size=p["batch_size"],
            steps_per_call=p["record_every"],
            probe=probe,
            validate=False,
            progress=progress,
        )
    return summarize(results, p["record_every"], lrs)


def summarize(results: dict[str, SweepResult], every: int, lrs) -> dict[str, Any]:
    """Final losses, sensitivities, logit records and the per-rate verdicts."""
    any_res = results[MODELS[0]]
    out: dict[str, Any] = {
        "lrs": [float(x) for x in lrs],
        "steps": [int(s) for s in any_res.probe_steps],
    }
    final, sens, attn, logit, diverged, curves, l0 = {}, {}, {}, {}, {}, {}, {}
    for name, res in results.items():
        windows = _window_means(res.losses, every)
        curves[name] = windows
        final[name] = windows[:, -1]
        l0[name] = float(np.nanmean(res.losses[:, 0]))
        sens[name] = lr_sensitivity(final[name], l0[name])
        attn[name] = np.asarray(res.probes["attn"], np.float64)
        logit[name] = np.asarray(res.probes["out"], np.float64)
        diverged[name] = [int(d) for d in res.diverged_at]
    out.update(
        final_loss={k: _clean(v) for k, v in final.items()},
        sensitivity=sens,
        initial_loss=l0,
        max_attn_logit={k: [_clean(r) for r in v] for k, v in attn.items()},
        max_output_logit={k: [_clean(r) for r in v] for k, v in logit.items()},
        diverged=diverged,
        loss_curves={k: [_clean(r) for r in v] for k, v in curves.items()},
        verdicts=verdicts(final, attn, logit),
    )
    return out


def _clean(values) -> list[float | None]:
    """Floats for JSON, NaN as `null`."""
    return [float(v) if math.isfinite(v) else None for v in np.asarray(values, float)]


def verdicts(final, attn, logit) -> list[dict[str, Any]]:
    """The decision rule (module docstring) at each rate where no-QK-norm ends worse."""
    q, n = (np.asarray(final[m], np.float64) for m in MODELS)
    out = []
    for i in range(len(q)):
        worse = (np.isnan(n[i]) and not np.isnan(q[i])) or n[i] - q[i] > GAP
        if not worse:
            continue
        a_n, a_q = np.nanmax(attn["no_qk_norm"][i]), np.nanmax(attn["qk_norm"][i])
        o_n, o_q = np.nanmax(logit["no_qk_norm"][i]), np.nanmax(logit["qk_norm"][i])
        growth = a_n / attn["no_qk_norm"][i][0]
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
                attn_growth=float(growth),
                attn_ratio=float(a_n / a_q),
                output_ratio=float(o_n / o_q),
                explained_by=cause,
            )
        )
    return out


def _fmt(x) -> str:
    return "diverged" if x is None else f"{x:.3f}"


def table(result: dict[str, Any]) -> str:
    """Markdown: final loss and largest logits per rate, both models."""
    lines = [
        "| lr | final loss QK-norm | final loss no QK-norm | max attn logit QK / no | "
        "max output logit QK / no |",
        "|---:|---:|---:|---:|---:|",
    ]
    for i, lr in enumerate(result["lrs"]):
        f = [result["final_loss"][m][i] for m in MODELS]
        a = [
            max(
                (v for v in result["max_attn_logit"][m][i] if v is not None),
                default=math.nan,
            )
            for m in MODELS
        ]
        o = [
            max(
                (v for v in result["max_output_logit"][m][i] if v is not None),
                default=math.nan,
            )
            for m in MODELS
        ]
        lines.append(
            f"| {lr:.2e} | {_fmt(f[0])} | {_fmt(f[1])} | {a[0]:.1f} / {a[1]:.1f} | "
            f"{o[0]:.1f} / {o[1]:.1f} |"
        )
    return "\n".join(lines)


def explanation(result: dict[str, Any]) -> str:
    """One line per rate where the model without QK-norm ends worse."""
    if not result["verdicts"]:
        return (
            f"The model without QK-norm ends worse (by more than {GAP} nats) at "
            "no learning rate."
        )
    lines = []
    for v in result["verdicts"]:
        lr = result["lrs"][v["index"]]
        gap = "it diverged" if v["gap"] is None else f"gap {v['gap']:.3f} nats"
        lines.append(
            f"- lr {lr:.2e} ({gap}): attention logits grew {v['attn_growth']:.1f}x "
            f"from init, {v['attn_ratio']:.1f}x the QK-norm model's; output logits "
            f"{v['output_ratio']:.1f}x the QK-norm model's: explained by "
            f"**{v['explained_by']}**."
        )
    return "\n".join(lines)


def plots(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Final loss vs lr (both models); attention- and output-logit growth, per model."""
    out_dir = Path(out_dir)
    lrs = result["lrs"]
    nan = float("nan")

    def nums(v):
        return [nan if x is None else x for x in v]

    paths = [
        line_plot(
            out_dir / "lr_final_loss.png",
            lrs,
            {m: nums(result["final_loss"][m]) for m in MODELS},
            xlabel="learning rate",
            ylabel="final training loss (nats/char)",
            logx=True,
            title="CharLM: final loss vs learning rate",
            hlines={"loss at init": result["initial_loss"]["no_qk_norm"]},
        )
    ]
    # One figure per quantity and model: seven rates keep distinct colours.
    for key, label, stem in (
        ("max_attn_logit", "largest |attention logit|", "lr_attn_logits"),
        ("max_output_logit", "largest |output logit|", "lr_output_logits"),
    ):
        for m in MODELS:
            ys = {
                f"lr {lr:.0e}": nums(r)
                for lr, r in zip(lrs, result[key][m], strict=True)
            }
            paths.append(
                line_plot(
                    out_dir / f"{stem}_{m}.png",
                    [float(s) for s in result["steps"]],
                    ys,
                    xlabel="step",
                    ylabel=label,
                    logy=True,
                    title=f"{label} on a fixed batch, {m.replace('_', ' ')}",
                )
            )
    return paths


def protocol_of(args: argparse.Namespace) -> dict[str, int]:
    p = dict(QUICK if args.quick else FULL)
    for name in (
        "steps",
        "record_every",
        "num_hiddens",
        "num_blks",
        "batch_size",
        "seq_len",
    ):
        if getattr(args, name) is not None:
            p[name] = getattr(args, name)
    if p["steps"] < p["record_every"]:
        raise ValueError(
            f"lr-sweep: steps must be >= record_every, got steps={p['steps']}, "
            f"record_every={p['record_every']}."
        )
    return p


def study_flops(p: dict[str, int], lrs) -> float:
    """Training FLOPs of the study: 2 models x len(lrs) rates x steps.

    Per token, forward and backward: 6 x the matmul weights (about $12 d^2$ per
    SwiGLU block) plus $12 T d$ per block for the attention scores and mixing.
    """
    d, L, T = p["num_hiddens"], p["num_blks"], p["seq_len"]
    per_token = 6 * 12 * L * d * d + 12 * L * T * d
    return 2.0 * len(lrs) * p["steps"] * p["batch_size"] * T * per_token


def warn_if_slow(p: dict[str, int], lrs) -> None:
    """On a CPU backend, say on stderr how long a large study will take."""
    flops = study_flops(p, lrs)
    hours = flops / 200e9 / 3600  # about what a 2-core CPU sustains on this model
    if jax.default_backend() == "cpu" and hours > 0.5:
        tqdm.write(  # keeps any progress bar on stderr intact
            f"lr-sweep: this protocol is {flops / 1e15:.1f} PFLOP of training, about "
            f"{hours:.0f} h on a 2-core CPU at 200 GFLOP/s (minutes on a GPU); "
            "--quick runs a reduced protocol in minutes.",
            file=sys.stderr,
        )


def describe(p: dict[str, int], lrs) -> str:
    return (
        f"CharLM d = {p['num_hiddens']}, {p['num_blks']} blocks, "
        f"{p['num_heads']} heads, "
        f"batches of {p['batch_size']} x {p['seq_len']} characters, AdamW (no weight "
        f"decay), {p['steps']} steps, {len(lrs)} learning rates "
        f"{lrs[0]:.0e} .. {lrs[-1]:.0e}; losses are means over each window of "
        f"{p['record_every']} steps, logits on a fixed batch of {p['probe_batch']} "
        "sequences."
    )


def run(args: argparse.Namespace) -> int:
    protocol = protocol_of(args)
    lrs = tuple(args.lrs) if args.lrs else LRS
    warn_if_slow(protocol, lrs)
    result = run_study(
        protocol, lrs, seed=args.seed, progress=not (args.no_progress or args.json)
    )
    paths = plots(result, args.out)
    if args.json:
        print(json.dumps({**result, "protocol": protocol}, allow_nan=False))
        return 0
    print(describe(protocol, lrs) + "\n")
    print(table(result))
    print(
        "\nlearning-rate sensitivity: "
        + ", ".join(f"{m} {result['sensitivity'][m]:.3f}" for m in MODELS)
    )
    print("\n" + explanation(result))
    print("\nplots: " + ", ".join(str(p) for p in paths))
    return 0


def report_section(out_dir: Path, *, quick: bool) -> str:
    protocol = dict(QUICK if quick else FULL)
    warn_if_slow(protocol, LRS)
    result = run_study(protocol, progress=False)
    paths = plots(result, out_dir)
    s = result["sensitivity"]
    return (
        "## Learning-rate sensitivity with and without QK-norm (exercise 11)\n\n"
        f"{describe(protocol, LRS)}\n\n{table(result)}\n\n"
        f"Learning-rate sensitivity E[min(l, l0) - l*]: QK-norm {s['qk_norm']:.3f}, "
        f"no QK-norm {s['no_qk_norm']:.3f} (l0 = "
        f"{result['initial_loss']['no_qk_norm']:.3f}).\n\n"
        f"Decision rule: a gap is a final loss worse by more than {GAP} nats; "
        f"attention-logit growth explains it if the largest |attention logit| grew "
        f">= {GROWTH:g}x from init and reached >= {RATIO:g}x the QK-norm model's; "
        f"otherwise output-logit growth explains it if the largest |output logit| "
        f"reached >= {RATIO:g}x the QK-norm model's.\n\n{explanation(result)}\n\n"
        + "\n".join(f"![{p.stem}]({p.name})" for p in paths)
        + "\n"
    )
