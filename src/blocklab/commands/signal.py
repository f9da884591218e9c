"""`blocklab signal`: signal propagation at initialization (11.1.2.2, ex. 3-7)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..block import PLACEMENTS
from ..plotting import line_plot
from ..signal import (
    PROJECTIONS,
    SignalStats,
    fit_power_law,
    head_input_rms,
    logit_growth,
    signal_sweep,
    variance_budget,
)
from ..theory import c_attn_1, c_ffn_1, collapse_spread

NAME = "signal"
HELP = "signal propagation at initialization: stream RMS, token spread, gradients"

#: The exercises this command can add to its output.
EXERCISES = ("3c", "4", "5", "6c", "7")
#: The chapter's figures (Flax NNX, one seed): RMS@32, spread@8/16/32, grads@32.
CHAPTER_JAX = {
    "post": (1.00, (3.5e-1, 2.5e-2, 2.0e-4), (5.6e-9, 4.9e-9, 6.5e-2, 6.6e-2)),
    "pre": (5.22, (7.2e-1, 5.3e-1, 3.7e-1), (2.3e-3, 2.3e-3, 8.2e-2, 8.4e-2)),
}
FIELDS = ("stream_rms", "token_spread", "c_attn", "c_ffn", "attn_entropy", "max_logit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS)
    )
    parser.add_argument("--qk-norm", action="store_true", help="QK-norm in every block")
    parser.add_argument("--seeds", type=int, default=3, help="seeds (vmapped)")
    parser.add_argument("--blocks", type=int, default=32, help="depth N")
    parser.add_argument("--alpha", type=float, default=1.0, help="scale all weights")
    parser.add_argument("--no-ffn", action="store_true", help="zero FFN sublayers")
    parser.add_argument("--num-hiddens", type=int, default=256)
    parser.add_argument(
        "--out",
        default="signal-figures",
        metavar="DIR",
        help="folder for the PNG figures (default: %(default)s)",
    )
    parser.add_argument(
        "--exercises",
        nargs="+",
        choices=EXERCISES,
        default=[],
        help="also run these chapter exercises",
    )


def checkpoints(num_blks: int) -> list[int]:
    """Blocks where the table reads the spread: N/4, N/2, N (8, 16, 32 at N = 32)."""
    return sorted({max(1, num_blks // 4), max(1, num_blks // 2), num_blks})


def _options(args) -> dict:
    return dict(
        num_blks=args.blocks,
        num_hiddens=args.num_hiddens,
        num_heads=4,
        qk_norm=args.qk_norm,
        alpha=args.alpha,
        ffn=not args.no_ffn,
    )


def _check(args) -> None:
    for name in ("seeds", "blocks", "num_hiddens"):
        value = getattr(args, name)
        if value < 1:
            raise SystemExit(
                f"blocklab signal: --{name.replace('_', '-')} must be >= 1, "
                f"got {value}."
            )
    if args.num_hiddens % 4:
        raise SystemExit(
            f"blocklab signal: --num-hiddens must be a multiple of the 4 "
            f"heads, got {args.num_hiddens}."
        )


def run_placements(placements, seeds: int, **options) -> dict[str, SignalStats]:
    """`signal_sweep` per placement, as NumPy arrays of shape `(seeds, N)` per field."""
    return {
        p: jax.tree_util.tree_map(np.asarray, signal_sweep(p, seeds, **options))
        for p in placements
    }


def _cell(values: np.ndarray, fmt: str) -> str:
    """Mean over seeds, with the min-max range when there is more than one seed."""
    mean = format(float(values.mean()), fmt)
    if values.size == 1:
        return mean
    lo, hi = format(float(values.min()), fmt), format(float(values.max()), fmt)
    return f"{mean} [{lo}, {hi}]"


def table(results: dict[str, SignalStats]) -> str:
    """The chapter's table: mean [min, max] over seeds per placement."""
    n = next(iter(results.values())).stream_rms.shape[-1]
    ks = checkpoints(n)
    head = (
        f"| placement | stream RMS k={n} | "
        + " | ".join(f"spread k={k}" for k in ks)
        + " | "
        + " | ".join(f"grad {p} k={n}" for p in PROJECTIONS)
        + " |"
    )
    lines = [head, "|---" * (2 + len(ks) + len(PROJECTIONS)) + "|"]
    for placement, stats in results.items():
        r = stats.as_dict()
        cells = [_cell(r["stream_rms"][:, -1], ".2f")]
        cells += [_cell(r["token_spread"][:, k - 1], ".1e") for k in ks]
        cells += [_cell(r[f"grad_{p}"][:, -1], ".1e") for p in PROJECTIONS]
        lines.append(f"| {placement} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(out_dir: Path, results: dict[str, SignalStats]) -> list[Path]:
    """The four figures (one line per placement, min-max band over seeds)."""
    n = next(iter(results.values())).stream_rms.shape[-1]
    k = [float(i) for i in range(1, n + 1)]
    seq_len = 64
    specs = [
        ("grad_W_q", "query-projection gradient norm", True, "signal_grad_wq", None),
        ("token_spread", "token spread", True, "signal_spread", None),
        ("stream_rms", "stream RMS", False, "signal_rms", None),
        (
            "attn_entropy",
            "attention entropy (nats)",
            False,
            "signal_entropy",
            {"log 64 (uniform)": math.log(seq_len)},
        ),
    ]
    paths = []
    for field, ylabel, logy, stem, hlines in specs:
        values = {p: r.as_dict()[field] for p, r in results.items()}
        ys = {p: v.mean(0).tolist() for p, v in values.items()}
        bands = {p: (v.min(0).tolist(), v.max(0).tolist()) for p, v in values.items()}
        paths.append(
            line_plot(
                Path(out_dir) / f"{stem}.png",
                k,
                ys,
                xlabel="block index k",
                ylabel=ylabel,
                logy=logy,
                bands=bands,
                hlines=hlines,
            )
        )
    return paths


# ------------------------------------------------------------------ exercises
def exercise_7(seeds: int, num_blks: int = 32, **options) -> dict[str, dict]:
    """Four placements, with and without QK-norm: RMS, spread, W_q grads, entropy."""
    out = {}
    for qk in (False, True):
        res = run_placements(
            PLACEMENTS, seeds, num_blks=num_blks, qk_norm=qk, **options
        )
        for placement, stats in res.items():
            r = stats.as_dict()
            out[f"{placement}{' +qk' if qk else ''}"] = {
                "stream_rms": float(r["stream_rms"][:, -1].mean()),
                "token_spread": float(r["token_spread"][:, -1].mean()),
                "grad_W_q": float(r["grad_W_q"][:, -1].mean()),
                "entropy_top": float(r["attn_entropy"][:, -1].mean()),
                "entropy_min": float(r["attn_entropy"].mean(0).min()),
                "max_logit_top": float(r["max_logit"][:, -1].mean()),
            }
    return out


def exercise_7_table(rows: dict[str, dict], num_blks: int) -> str:
    lines = [
        f"| placement | RMS k={num_blks} | spread k={num_blks} | grad W_q k={num_blks}"
        f" | entropy k={num_blks} | min entropy | max logit k={num_blks} |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['stream_rms']:.2f} | {r['token_spread']:.1e} | "
            f"{r['grad_W_q']:.1e} | {r['entropy_top']:.2f} | "
            f"{r['entropy_min']:.2f} | {r['max_logit_top']:.1f} |"
        )
    return (
        "\n".join(lines)
        + f"\n\nUniform attention over 64 keys: log 64 = {math.log(64):.2f}."
    )


def exercise_4(pre: SignalStats) -> dict:
    """Variance budget vs measured mean square; power-law fits of the RMS (pre-LN)."""
    budget, measured = (np.asarray(a).mean(0) for a in variance_budget(pre))
    rms = pre.stream_rms.mean(0)
    n = len(rms)
    fits = {f"1-{n}": fit_power_law(rms)}
    if n >= 10:
        fits[f"8-{n}"] = fit_power_law(rms, first=8)
    return {
        "budget": budget,
        "measured": measured,
        "c_attn": pre.c_attn.mean(0),
        "c_ffn": pre.c_ffn.mean(0),
        "fits": fits,
    }


def exercise_4_table(ex4: dict) -> str:
    n = len(ex4["budget"])
    lines = [
        "| k | c_attn | c_ffn | budget 1 + sum c | measured mean square |",
        "|---|---|---|---|---|",
    ]
    for k in sorted({1, *checkpoints(n)}):
        lines.append(
            f"| {k} | {ex4['c_attn'][k - 1]:.3f} | {ex4['c_ffn'][k - 1]:.3f} | "
            f"{ex4['budget'][k - 1]:.2f} | {ex4['measured'][k - 1]:.2f} |"
        )
    fits = "; ".join(
        f"blocks {r}: RMS ~ {a:.2f} k^{b:.3f}" for r, (b, a) in ex4["fits"].items()
    )
    return (
        "\n".join(lines)
        + f"\n\nBlock 1 predicted by `blocklab.theory`: c_attn = {c_attn_1(64):.4f} "
        f"(large-n limit e/64), c_ffn = {c_ffn_1():.4f}."
        + f"\n\nPower-law fits of the stream RMS: {fits}."
    )


def exercise_5(
    seeds: int, num_blks: int = 32, alphas=(1.0, 0.7, 0.5), **options
) -> dict[str, np.ndarray]:
    """Post-LN token spread at N/4, N/2, N for weight scales alpha, with/without FFN."""
    ks = np.asarray(checkpoints(num_blks)) - 1
    out = {}
    for alpha in alphas:
        for ffn in (True, False):
            stats = signal_sweep(
                "post", seeds, num_blks=num_blks, alpha=alpha, ffn=ffn, **options
            )
            out[f"alpha={alpha:g}, {'full block' if ffn else 'no FFN'}"] = np.asarray(
                stats.token_spread
            )[:, ks].mean(0)
    return out


def exercise_5_table(
    rows: dict[str, np.ndarray], num_blks: int, alphas=(1.0, 0.7, 0.5)
) -> str:
    ks = checkpoints(num_blks)
    lines = [
        "| post-LN | " + " | ".join(f"spread k={k}" for k in ks) + " |",
        "|---" * (1 + len(ks)) + "|",
    ]
    for name, v in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{x:.1e}" for x in v) + " |")
    for alpha in alphas:
        pred = [collapse_spread(k, alpha, 64) for k in ks]
        lines.append(
            f"| alpha={alpha:g}, formula (no FFN, n = 64) | "
            + " | ".join(f"{x:.1e}" for x in pred)
            + " |"
        )
    return "\n".join(lines)


def exercise_6c(num_hiddens: int = 256, seeds: int = 1) -> dict[str, np.ndarray]:
    """Logit std and mean entropy for W_q, W_k scaled by lambda, +/- QK-norm."""
    lambdas = jnp.asarray([1.0, 2.0, 4.0, 8.0])
    out = {"lambda": np.asarray(lambdas)}
    for qk in (False, True):
        runs = [
            logit_growth(
                lambdas, qk_norm=qk, num_hiddens=num_hiddens, key=jax.random.key(s)
            )
            for s in range(seeds)
        ]
        tag = "qk" if qk else "plain"
        for field in ("logit_std", "entropy"):
            out[f"{field}_{tag}"] = np.mean([np.asarray(r[field]) for r in runs], 0)
    return out


def exercise_6c_table(ex6: dict[str, np.ndarray]) -> str:
    lines = [
        "| lambda | logit std | entropy | logit std (QK-norm) | entropy (QK-norm) |",
        "|---|---|---|---|---|",
    ]
    for i, lam in enumerate(ex6["lambda"]):
        lines.append(
            f"| {lam:g} | {ex6['logit_std_plain'][i]:.2f} | "
            f"{ex6['entropy_plain'][i]:.2f} | {ex6['logit_std_qk'][i]:.2f} | "
            f"{ex6['entropy_qk'][i]:.2f} |"
        )
    return "\n".join(lines) + f"\n\nlog 64 = {math.log(64):.2f} (uniform attention)."


def exercise_3c(pre: SignalStats) -> dict[str, np.ndarray]:
    """RMS a tied head reads atop a depth-D pre-LN stack without a final norm."""
    return head_input_rms(pre.stream_rms)


def exercise_3c_table(ex3: dict[str, np.ndarray]) -> str:
    lines = [
        "| depth D | head input RMS, no final norm | min-max over seeds "
        "| with a final RMSNorm |",
        "|---|---|---|---|",
    ]
    rows = zip(ex3["depth"], ex3["rms"], ex3["rms_min"], ex3["rms_max"], strict=True)
    for d, r, lo, hi in rows:
        lines.append(f"| {d} | {r:.2f} | {lo:.2f}-{hi:.2f} | 1.00 |")
    return "\n".join(lines)


def _exercises(names, args, main: dict) -> tuple[dict, list[str]]:
    """Run the requested exercises; returns (JSON-able results, Markdown blocks)."""
    results, blocks = {}, []
    opts = dict(num_hiddens=args.num_hiddens, num_heads=4)
    pre = (
        main.get("pre")
        if not (args.qk_norm or args.no_ffn or args.alpha != 1.0)
        else None
    )
    if ({"3c", "4"} & set(names)) and pre is None:
        pre = run_placements(["pre"], args.seeds, num_blks=args.blocks, **opts)["pre"]
    if "3c" in names:
        ex = exercise_3c(pre)
        results["3c"] = {k: v.tolist() for k, v in ex.items()}
        blocks.append(
            "Exercise 3c: what a tied head reads (pre-LN)\n\n" + exercise_3c_table(ex)
        )
    if "4" in names:
        ex = exercise_4(pre)
        results["4"] = {
            k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in ex.items()
        }
        blocks.append("Exercise 4: variance budget (pre-LN)\n\n" + exercise_4_table(ex))
    if "5" in names:
        ex = exercise_5(args.seeds, args.blocks, **opts)
        results["5"] = {k: v.tolist() for k, v in ex.items()}
        blocks.append(
            "Exercise 5: rate of token collapse (post-LN)\n\n"
            + exercise_5_table(ex, args.blocks)
        )
    if "6c" in names:
        ex = exercise_6c(args.num_hiddens, args.seeds)
        results["6c"] = {k: v.tolist() for k, v in ex.items()}
        blocks.append(
            "Exercise 6c: inflated query/key weights\n\n" + exercise_6c_table(ex)
        )
    if "7" in names:
        ex = exercise_7(args.seeds, args.blocks, **opts)
        results["7"] = ex
        blocks.append(
            "Exercise 7: four placements, with and without QK-norm\n\n"
            + exercise_7_table(ex, args.blocks)
        )
    return results, blocks


def run(args: argparse.Namespace) -> int:
    _check(args)
    results = run_placements(args.placements, args.seeds, **_options(args))
    plot(Path(args.out), results)
    ex_results, ex_blocks = _exercises(args.exercises, args, results)
    if args.json:
        out = {
            p: {
                **{f: getattr(r, f).mean(0).tolist() for f in FIELDS},
                "grad_norms": {n: g.mean(0).tolist() for n, g in r.grad_norms.items()},
            }
            for p, r in results.items()
        }
        if ex_results:
            out["exercises"] = ex_results
        print(json.dumps(out))
        return 0
    print(
        f"{args.blocks} blocks, d={args.num_hiddens}, 4 heads, alpha={args.alpha:g}"
        f"{', QK-norm' if args.qk_norm else ''}{', no FFN' if args.no_ffn else ''}; "
        f"mean [min, max] over {args.seeds} seed(s)"
    )
    print(table(results))
    for block in ex_blocks:
        print()
        print(block)
    print(f"\nfigures in {args.out}/")
    return 0


OUTPUT_FAILURE = (
    "In the output (OLMo 2) placement the branches read the raw stream, whose mean "
    "square grows like 1 + 2k because each block adds two unit-RMS branch outputs. "
    "The attention logits grow with the stream's mean square, so the softmax "
    "saturates: "
    "the upper blocks' attention entropy falls towards 0 (near one-hot attention, "
    "largest logits in the hundreds) instead of staying near log 64. This entropy "
    "collapse takes the place of post-LN's token collapse; QK-norm bounds the logits "
    "by sqrt(p) and restores near-uniform attention, while it cannot stop post-LN's "
    "collapse, which comes from uniform attention averaging the tokens."
)


def report_section(out_dir: Path, *, quick: bool) -> str:
    seeds, n = (1, 32) if quick else (4, 32)
    opts = dict(num_hiddens=256, num_heads=4)
    results = run_placements(PLACEMENTS, seeds, num_blks=n, **opts)
    figures = plot(Path(out_dir), results)
    pre = results["pre"]
    deep = pre if quick else run_placements(["pre"], seeds, num_blks=128, **opts)["pre"]
    ex3 = exercise_3c(deep)
    ex4 = exercise_4(pre)
    ex5 = exercise_5(seeds, n, **opts)
    ex6 = exercise_6c(256, seeds)
    ex7 = exercise_7(seeds, n, **opts)
    chapter = "\n".join(
        f"| {p} (chapter, JAX) | {rms:.2f} | "
        + " | ".join(f"{s:.1e}" for s in spreads)
        + " | "
        + " | ".join(f"{g:.1e}" for g in grads)
        + " |"
        for p, (rms, spreads, grads) in CHAPTER_JAX.items()
    )
    images = "\n".join(f"![{p.stem}]({p.name})" for p in figures)
    return (
        "## Signal propagation at initialization\n\n"
        f"{n} MiniBlocks (d = 256, 4 heads, LayerNorm, tanh-GELU MLP 4d with bias, "
        "attention without bias), every weight Xavier-uniform, input (2, 64, 256) "
        "standard normal, readout loss mean(R * H_N); "
        f"mean [min, max] over {seeds} seed(s), vmapped.\n\n"
        f"{table(results)}\n{chapter}\n\n{images}\n\n"
        f"### Exercise 7: off-stream normalization and QK-norm\n\n"
        f"{exercise_7_table(ex7, n)}\n\n{OUTPUT_FAILURE}\n\n"
        f"### Exercise 4: variance budget (pre-LN)\n\n{exercise_4_table(ex4)}\n\n"
        f"### Exercise 5: rate of token collapse (post-LN)\n\n"
        f"{exercise_5_table(ex5, n)}\n\n"
        f"### Exercise 6c: inflated query/key weights\n\n{exercise_6c_table(ex6)}\n\n"
        f"### Exercise 3c: what a tied head reads without the final norm (pre-LN)\n\n"
        f"{exercise_3c_table(ex3)}\n"
    )
