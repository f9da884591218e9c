r"""Signal propagation at initialization (chapter 11.1.2.2) and exercises 3c-7.

The chapter's experiment: $N$ MiniBlocks (LayerNorm, tanh-GELU MLP of width
$4d$ with bias, attention without bias, every weight Xavier-uniform) read a
standard-normal input of shape $(2, 64, d)$; `blocklab.signal_sweep` records
per block the stream RMS, the token spread, the branch mean squares, the
attention entropy, the largest logit and the gradient norms of
$W_q, W_k, W_v, W_o$ under the readout loss $\mathrm{mean}(R \odot H_N)$,
vmapped over seeds. `signal_propagation` runs it per placement; the exercises:

- 3c `exercise_3c`: the RMS a tied head reads atop a depth-$D$ pre-LN stack
  without a final norm;
- 4 `exercise_4`: the variance budget $1 + \sum_{i\le k}(c^\text{attn}_i +
  c^\text{ffn}_i)$ against the measured mean square, and power-law fits;
- 5 `exercise_5`: post-LN token spread for weight scales $\alpha$, with and
  without the FFN, against `blocklab.diagnostics.theory.collapse_spread`;
- 6c `exercise_6c`: attention logit std and entropy as $W_q, W_k$ grow by
  $\lambda$, with and without QK-norm;
- 7 `exercise_7`: the four placements with and without QK-norm.

`signal_arch` runs the same statistics on the `stack` of a real decoder
configuration (`blocklab.DecoderConfig` presets), when that module is present.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .._validate import ConfigError, check_bool, check_float, check_int
from ..diagnostics.propagation import (
    PROJECTIONS,
    SignalStats,
    fit_power_law,
    head_input_rms,
    logit_growth,
    signal_stats,
    signal_sweep,
    variance_budget,
)
from ..diagnostics.theory import c_attn_1, c_ffn_1, collapse_spread
from ..nn.block import PLACEMENTS
from ._render import figure_links, json_floats, markdown_table
from .plotting import line_plot
from .protocol import report_estimate_hook, report_section_hook

__all__ = [
    "ARCHS",
    "CHAPTER_JAX",
    "FIELDS",
    "HeadInputRMS",
    "LogitGrowth",
    "PlacementComparison",
    "SignalPropagation",
    "TokenCollapse",
    "VarianceBudget",
    "checkpoints",
    "exercise_3c",
    "exercise_4",
    "exercise_5",
    "exercise_6c",
    "exercise_7",
    "signal_arch",
    "signal_propagation",
]

#: The chapter's figures (Flax NNX, one seed): RMS@32, spread@8/16/32, grads@32.
CHAPTER_JAX = {
    "post": (1.00, (3.5e-1, 2.5e-2, 2.0e-4), (5.6e-9, 4.9e-9, 6.5e-2, 6.6e-2)),
    "pre": (5.22, (7.2e-1, 5.3e-1, 3.7e-1), (2.3e-3, 2.3e-3, 8.2e-2, 8.4e-2)),
}
#: Per-block fields of `SignalStats` besides the gradient norms.
FIELDS = ("stream_rms", "token_spread", "c_attn", "c_ffn", "attn_entropy", "max_logit")
#: Architectures `signal_arch` can build: the chapter's stack and the presets.
ARCHS = ("chapter", "llama", "olmo2", "gemma3", "gpt2")
SEQ_LEN = 64


def checkpoints(num_blks: int) -> list[int]:
    """Blocks where the table reads the spread: N/4, N/2, N (8, 16, 32 at N = 32)."""
    return sorted({max(1, num_blks // 4), max(1, num_blks // 2), num_blks})


def _cell(values: np.ndarray, fmt: str) -> str:
    """Mean over seeds, with the min-max range when there is more than one seed."""
    mean = format(float(values.mean()), fmt)
    if values.size == 1:
        return mean
    lo, hi = format(float(values.min()), fmt), format(float(values.max()), fmt)
    return f"{mean} [{lo}, {hi}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The study's Markdown tables: `markdown_table` with plain `|---|` rules."""
    return markdown_table(header, rows, align="l" * len(header))


def _numpy(stats: SignalStats) -> SignalStats:
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), stats)


@dataclasses.dataclass(frozen=True)
class SignalPropagation:
    """What `signal_propagation` returns.

    Attributes:
        options: the protocol (num_seeds, num_blks, num_hiddens, num_heads, qk_norm,
            alpha, ffn, and `arch` when a real architecture was measured).
        stats: placement (or architecture) -> `SignalStats` of float64 NumPy
            arrays of shape `(num_seeds, N)`.
    """

    options: dict[str, Any]
    stats: dict[str, SignalStats]

    @property
    def num_blks(self) -> int:
        return next(iter(self.stats.values())).stream_rms.shape[-1]

    def table(self) -> str:
        """The chapter's table: mean [min, max] over seeds per placement."""
        n = self.num_blks
        ks = checkpoints(n)
        header = [
            "placement",
            f"stream RMS k={n}",
            *(f"spread k={k}" for k in ks),
            *(f"grad {p} k={n}" for p in PROJECTIONS),
        ]
        rows = []
        for placement, stats in self.stats.items():
            r = stats.as_dict()
            cells = [placement, _cell(r["stream_rms"][:, -1], ".2f")]
            cells += [_cell(r["token_spread"][:, k - 1], ".1e") for k in ks]
            cells += [_cell(r[f"grad_{p}"][:, -1], ".1e") for p in PROJECTIONS]
            rows.append(cells)
        return _table(header, rows)

    def to_json(self) -> dict[str, Any]:
        """Seed means per block, per placement; non-finite values are `None`.

        `nonfinite` lists the placements whose statistics hold a non-finite
        value (an overflowing stack, e.g. at a large `alpha`).
        """
        out: dict[str, Any] = {"options": dict(self.options), "placements": {}}
        bad = []
        for p, r in self.stats.items():
            out["placements"][p] = {
                **{f: json_floats(getattr(r, f).mean(0)) for f in FIELDS},
                "grad_norms": {
                    n: json_floats(g.mean(0)) for n, g in r.grad_norms.items()
                },
            }
            if not all(np.all(np.isfinite(v)) for v in r.as_dict().values()):
                bad.append(p)
        out["nonfinite"] = bad
        return out

    def figures(self, out_dir: str | Path) -> list[Path]:
        """The four figures (one line per placement, min-max band over seeds)."""
        return self.plot(out_dir)

    def plot(self, out_dir: str | Path) -> list[Path]:
        """The four figures (one line per placement, min-max band over seeds)."""
        k = [float(i) for i in range(1, self.num_blks + 1)]
        specs = [
            ("grad_W_q", "query-projection gradient norm", True, "signal_grad_wq",
             None),
            ("token_spread", "token spread", True, "signal_spread", None),
            ("stream_rms", "stream RMS", False, "signal_rms", None),
            ("attn_entropy", "attention entropy (nats)", False, "signal_entropy",
             {"log 64 (uniform)": math.log(SEQ_LEN)}),
        ]  # fmt: skip
        paths = []
        for field, ylabel, logy, stem, hlines in specs:
            values = {p: r.as_dict()[field] for p, r in self.stats.items()}
            ys = {p: v.mean(0).tolist() for p, v in values.items()}
            bands = {
                p: (v.min(0).tolist(), v.max(0).tolist()) for p, v in values.items()
            }
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
                )  # fmt: skip
            )
        return paths


def _check_protocol(owner, num_seeds, num_blks, num_hiddens, num_heads, alpha):
    num_seeds = check_int(owner, "num_seeds", num_seeds, min=1)
    num_blks = check_int(owner, "num_blks", num_blks, min=1)
    num_hiddens = check_int(owner, "num_hiddens", num_hiddens, min=1)
    num_heads = check_int(owner, "num_heads", num_heads, min=1)
    if num_hiddens % num_heads:
        raise ConfigError(
            f"{owner}: num_hiddens must be a multiple of num_heads, got "
            f"num_hiddens={num_hiddens}, num_heads={num_heads}."
        )
    alpha = check_float(owner, "alpha", alpha, min=0.0, min_open=True)
    return num_seeds, num_blks, num_hiddens, num_heads, alpha


def run_placements(
    placements: Sequence[str], num_seeds: int, *, chunk: int | None = None, **options
) -> dict[str, SignalStats]:
    """`signal_sweep` per placement over seeds 0..num_seeds-1, as float64 NumPy
    arrays `(num_seeds, N)` per field.

    `chunk`: seeds per compiled call (bounds memory; see `signal_sweep`)."""
    return {
        p: _numpy(signal_sweep(p, num_seeds=num_seeds, chunk=chunk, **options))
        for p in placements
    }


def signal_propagation(
    placements: Sequence[str] = PLACEMENTS,
    *,
    num_seeds: int = 3,
    num_blks: int = 32,
    num_hiddens: int = 256,
    num_heads: int = 4,
    qk_norm: bool = False,
    alpha: float = 1.0,
    ffn: bool = True,
) -> SignalPropagation:
    """The chapter's signal experiment for each placement, vmapped over seeds.

    Args:
        placements: any of `blocklab.nn.PLACEMENTS` (distinct).
        num_seeds: number of seeds S >= 1 (seeds 0..S-1, one compiled program).
        num_blks: depth N (the chapter: 32).
        num_hiddens, num_heads: width d (256) and heads (4).
        qk_norm: RMS-normalize queries and keys in every block.
        alpha: scale of every weight matrix after the Xavier draw (> 0).
        ffn: `False` replaces every FFN by a zero sublayer.

    Returns:
        A `SignalPropagation`.
    """
    owner = "signal_propagation"
    placements = tuple(placements)
    if not placements or len(set(placements)) != len(placements):
        raise ConfigError(f"{owner}: placements must be distinct and non-empty.")
    for p in placements:
        if p not in PLACEMENTS:
            raise ConfigError(
                f"{owner}: placements must be among {list(PLACEMENTS)}, got {p!r}."
            )
    num_seeds, num_blks, num_hiddens, num_heads, alpha = _check_protocol(
        owner, num_seeds, num_blks, num_hiddens, num_heads, alpha
    )
    qk_norm = check_bool(owner, "qk_norm", qk_norm)
    ffn = check_bool(owner, "ffn", ffn)
    opts = dict(
        num_blks=num_blks, num_hiddens=num_hiddens, num_heads=num_heads,
        qk_norm=qk_norm, alpha=alpha, ffn=ffn,
    )  # fmt: skip
    stats = run_placements(placements, num_seeds, **opts)
    return SignalPropagation({"num_seeds": num_seeds, **opts}, stats)


# --------------------------------------------------------------- architectures
def _preset(arch: str, num_blks: int, num_hiddens: int, num_heads: int):
    from ..models import decoder  # a later layer: imported only when asked for

    make = getattr(decoder.DecoderConfig, arch)
    extra = {"head_dim": num_hiddens // num_heads} if arch == "gemma3" else {}
    return make(
        num_blks=num_blks, num_hiddens=num_hiddens, num_heads=num_heads, **extra
    )


def signal_arch(
    arch: str,
    *,
    num_seeds: int = 3,
    num_blks: int = 32,
    num_hiddens: int = 256,
    num_heads: int = 4,
) -> SignalPropagation:
    """`signal_stats` on the `stack` of a real architecture's decoder, over seeds.

    `arch` is `"chapter"` (the pre-LN MiniBlock stack, as `signal_propagation`)
    or a `blocklab.DecoderConfig` preset (`"llama"`, `"olmo2"`, `"gemma3"`,
    `"gpt2"`) at the given depth, width and heads. Each seed s builds
    `DecoderLM(config, key=key(s))` with its own initialization and reads a
    standard-normal input `(2, 64, d)` and readout drawn from the same key,
    as the chapter's experiment does (the stack is measured, not the
    embeddings). Seeds 0..num_seeds-1.
    Raises `ConfigError` when the decoder module is unavailable.
    """
    owner = "signal_arch"
    if arch not in ARCHS:
        raise ConfigError(f"{owner}: arch must be one of {list(ARCHS)}, got {arch!r}.")
    num_seeds, num_blks, num_hiddens, num_heads, _ = _check_protocol(
        owner, num_seeds, num_blks, num_hiddens, num_heads, 1.0
    )
    if arch == "chapter":
        res = signal_propagation(
            ("pre",), num_seeds=num_seeds, num_blks=num_blks, num_hiddens=num_hiddens,
            num_heads=num_heads,
        )  # fmt: skip
        return SignalPropagation(
            {**res.options, "arch": arch}, {"chapter": res.stats["pre"]}
        )
    try:
        config = _preset(arch, num_blks, num_hiddens, num_heads)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"{owner}: arch={arch!r} needs blocklab.DecoderConfig.{arch}(), which "
            f"is not available here ({e})."
        ) from None
    return signal_config(config, arch, num_seeds=num_seeds)


def signal_config(config: Any, label: str, *, num_seeds: int = 3) -> SignalPropagation:
    """`signal_stats` on the `stack` of `DecoderLM(config)`, over seeds.

    Each seed s draws a fresh initialization of the architecture `config` (a
    `blocklab.DecoderConfig`, e.g. the one of a checkpoint folder,
    `blocklab.interop.pretrained_config(path)`) from `key(s)`, and a
    standard-normal input `(2, 64, d)` and readout from the same key, as
    `signal_arch` does; the result's row is named `label`. Only the stack is
    built (the vocabulary does not enter it), so a large vocabulary costs
    nothing here.
    """
    from ..models import DecoderConfig, DecoderLM  # a later layer

    owner = "signal_config"
    if not isinstance(config, DecoderConfig):
        raise ConfigError(
            f"{owner}: config must be a blocklab.DecoderConfig, got "
            f"{type(config).__name__}."
        )
    num_seeds = check_int(owner, "num_seeds", num_seeds, min=1)
    d = config.num_hiddens
    small = dataclasses.replace(config, vocab_size=2)  # the stack is the same

    def one(key):
        model_key, x_key, r_key = jax.random.split(key, 3)
        stack = DecoderLM(small, key=model_key).stack
        X = jax.random.normal(x_key, (2, SEQ_LEN, d), jnp.float32)
        return signal_stats(stack, X, r_key)

    keys = jax.vmap(jax.random.key)(jnp.arange(num_seeds, dtype=jnp.uint32))
    stacked = _numpy(eqx.filter_jit(jax.vmap(one))(keys))
    opts = dict(num_seeds=num_seeds, num_blks=config.num_blks, num_hiddens=d,
                num_heads=config.num_heads, arch=label)  # fmt: skip
    return SignalPropagation(opts, {label: stacked})


def signal_pretrained(path: str | Path, *, num_seeds: int = 3) -> SignalPropagation:
    """`signal_config` on the architecture of a checkpoint folder.

    The folder's `config.json` gives the `DecoderConfig`
    (`blocklab.interop.pretrained_config`: the same mapping and refusals as
    `blocklab.load_pretrained`; no weight is read). Each seed draws a fresh
    initialization of that architecture: these are the init-time diagnostics
    of the checkpoint's design, not of its trained weights. The row is named
    after the model class (`architectures[0]`).
    """
    from ..interop.pretrained import pretrained_config, read_config  # a later layer

    config = pretrained_config(path)
    archs = read_config(path).get("architectures") or [type(config).__name__]
    result = signal_config(config, str(archs[0]), num_seeds=num_seeds)
    result.options["pretrained"] = str(path)
    return result


# ------------------------------------------------------------------ exercises
@dataclasses.dataclass(frozen=True)
class HeadInputRMS:
    """Exercise 3c: RMS of a tied head's input at depth D (pre-LN, no final norm)."""

    depth: np.ndarray
    rms: np.ndarray
    rms_min: np.ndarray
    rms_max: np.ndarray

    def table(self) -> str:
        header = (
            "depth D",
            "head input RMS, no final norm",
            "min-max over seeds",
            "with a final RMSNorm",
        )
        values = zip(self.depth, self.rms, self.rms_min, self.rms_max, strict=True)
        rows = [
            (d, f"{r:.2f}", f"{lo:.2f}-{hi:.2f}", "1.00") for d, r, lo, hi in values
        ]
        return _table(header, rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "depth": [int(d) for d in self.depth],
            **{f: json_floats(getattr(self, f)) for f in ("rms", "rms_min", "rms_max")},
        }


def exercise_3c(pre: SignalStats) -> HeadInputRMS:
    """RMS a tied head reads atop each depth D <= N of a pre-LN run (powers of 2)."""
    return HeadInputRMS(**head_input_rms(pre.stream_rms))


@dataclasses.dataclass(frozen=True)
class VarianceBudget:
    """Exercise 4: seed means per block; `fits`: blocks range -> (exponent b, a)."""

    budget: np.ndarray
    measured: np.ndarray
    c_attn: np.ndarray
    c_ffn: np.ndarray
    fits: dict[str, tuple[float, float]]

    def table(self) -> str:
        n = len(self.budget)
        header = ("k", "c_attn", "c_ffn", "budget 1 + sum c", "measured mean square")
        rows = [
            (
                k,
                f"{self.c_attn[k - 1]:.3f}",
                f"{self.c_ffn[k - 1]:.3f}",
                f"{self.budget[k - 1]:.2f}",
                f"{self.measured[k - 1]:.2f}",
            )
            for k in sorted({1, *checkpoints(n)})
        ]
        fits = "; ".join(
            f"blocks {r}: RMS ~ {a:.2f} k^{b:.3f}" for r, (b, a) in self.fits.items()
        )
        return (
            _table(header, rows)
            + "\n\nBlock 1 predicted by `blocklab.diagnostics.theory`: "
            f"c_attn = {c_attn_1(64):.4f}"
            f" (large-n limit e/64), c_ffn = {c_ffn_1():.4f}."
            + f"\n\nPower-law fits of the stream RMS: {fits}."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **{
                f: json_floats(getattr(self, f))
                for f in ("budget", "measured", "c_attn", "c_ffn")
            },  # fmt: skip
            "fits": {r: json_floats(v) for r, v in self.fits.items()},
        }


def exercise_4(pre: SignalStats) -> VarianceBudget:
    """Variance budget vs measured mean square; power-law fits of the RMS (pre-LN).

    Fits $\\mathrm{RMS}_k \\approx a k^b$ over blocks 1..N, and 8..N when N >= 10.
    """
    budget, measured = (np.asarray(a).mean(0) for a in variance_budget(pre))
    rms = np.asarray(pre.stream_rms).mean(0)
    n = len(rms)
    fits = {f"1-{n}": fit_power_law(rms)} if n >= 2 else {}
    if n >= 10:
        fits[f"8-{n}"] = fit_power_law(rms, first=8)
    return VarianceBudget(
        budget, measured, np.asarray(pre.c_attn).mean(0), np.asarray(pre.c_ffn).mean(0),
        fits,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TokenCollapse:
    """Exercise 5: post-LN spread at `ks` per (alpha, with/without FFN) row."""

    ks: list[int]
    alphas: tuple[float, ...]
    rows: dict[str, np.ndarray]

    def table(self) -> str:
        rows = {**self.rows}
        for alpha in self.alphas:
            rows[f"alpha={alpha:g}, formula (no FFN, n = 64)"] = [
                collapse_spread(k, alpha, SEQ_LEN) for k in self.ks
            ]
        return _table(
            ["post-LN", *(f"spread k={k}" for k in self.ks)],
            [[name, *(f"{x:.1e}" for x in v)] for name, v in rows.items()],
        )

    def to_json(self) -> dict[str, Any]:
        return {name: json_floats(v) for name, v in self.rows.items()}


def exercise_5(
    num_seeds: int,
    num_blks: int = 32,
    alphas: Sequence[float] = (1.0, 0.7, 0.5),
    **options,
) -> TokenCollapse:
    """Post-LN token spread at N/4, N/2, N for weight scales alpha, with/without FFN."""
    ks = checkpoints(num_blks)
    idx = np.asarray(ks) - 1
    rows = {}
    for alpha in alphas:
        for ffn in (True, False):
            stats = signal_sweep(
                "post",
                num_seeds=num_seeds,
                num_blks=num_blks,
                alpha=alpha,
                ffn=ffn,
                **options,
            )
            rows[f"alpha={alpha:g}, {'full block' if ffn else 'no FFN'}"] = np.asarray(
                stats.token_spread, np.float64
            )[:, idx].mean(0)
    return TokenCollapse(ks, tuple(alphas), rows)


@dataclasses.dataclass(frozen=True)
class LogitGrowth:
    """Exercise 6c: per lambda, logit std and mean entropy, without / with QK-norm."""

    lam: np.ndarray
    logit_std_plain: np.ndarray
    entropy_plain: np.ndarray
    logit_std_qk: np.ndarray
    entropy_qk: np.ndarray

    def table(self) -> str:
        header = (
            "lambda",
            "logit std",
            "entropy",
            "logit std (QK-norm)",
            "entropy (QK-norm)",
        )
        values = (
            self.logit_std_plain,
            self.entropy_plain,
            self.logit_std_qk,
            self.entropy_qk,
        )
        rows = [
            (f"{lam:g}", *(f"{v[i]:.2f}" for v in values))
            for i, lam in enumerate(self.lam)
        ]
        return (
            _table(header, rows)
            + f"\n\nlog 64 = {math.log(64):.2f} (uniform attention)."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "lambda": json_floats(self.lam),
            **{
                f: json_floats(getattr(self, f))
                for f in (
                    "logit_std_plain",
                    "entropy_plain",
                    "logit_std_qk",
                    "entropy_qk",
                )
            },  # fmt: skip
        }


def exercise_6c(
    num_hiddens: int = 256,
    num_seeds: int = 1,
    lambdas: Sequence[float] = (1.0, 2.0, 4.0, 8.0),
) -> LogitGrowth:
    """Logit std and mean entropy for W_q, W_k scaled by lambda, +/- QK-norm.

    Seed means of `blocklab.diagnostics.propagation.logit_growth` over seeds
    0..num_seeds-1.
    """
    lam = jnp.asarray(lambdas, jnp.float32)
    out = {}
    for qk in (False, True):
        runs = [
            logit_growth(
                lam, qk_norm=qk, num_hiddens=num_hiddens, key=jax.random.key(s)
            )
            for s in range(num_seeds)
        ]
        tag = "qk" if qk else "plain"
        for field in ("logit_std", "entropy"):
            out[f"{field}_{tag}"] = np.mean([np.asarray(r[field]) for r in runs], 0)
    return LogitGrowth(np.asarray(lam, np.float64), **out)


@dataclasses.dataclass(frozen=True)
class PlacementComparison:
    """Exercise 7: per placement (and `+qk`), seed means at the top block."""

    num_blks: int
    rows: dict[str, dict[str, float]]

    def table(self) -> str:
        n = self.num_blks
        header = (
            "placement", f"RMS k={n}", f"spread k={n}", f"grad W_q k={n}",
            f"entropy k={n}", "min entropy", f"max logit k={n}",
        )  # fmt: skip
        rows = [
            (
                name,
                f"{r['stream_rms']:.2f}",
                f"{r['token_spread']:.1e}",
                f"{r['grad_W_q']:.1e}",
                f"{r['entropy_top']:.2f}",
                f"{r['entropy_min']:.2f}",
                f"{r['max_logit_top']:.1f}",
            )
            for name, r in self.rows.items()
        ]
        return (
            _table(header, rows)
            + f"\n\nUniform attention over 64 keys: log 64 = {math.log(64):.2f}."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            k: {f: json_floats(v) for f, v in r.items()} for k, r in self.rows.items()
        }


def exercise_7(num_seeds: int, num_blks: int = 32, **options) -> PlacementComparison:
    """Four placements, with and without QK-norm: RMS, spread, W_q grads, entropy."""
    rows = {}
    for qk in (False, True):
        res = run_placements(
            PLACEMENTS, num_seeds, num_blks=num_blks, qk_norm=qk, **options
        )
        for placement, stats in res.items():
            r = stats.as_dict()
            rows[f"{placement}{' +qk' if qk else ''}"] = {
                "stream_rms": float(r["stream_rms"][:, -1].mean()),
                "token_spread": float(r["token_spread"][:, -1].mean()),
                "grad_W_q": float(r["grad_W_q"][:, -1].mean()),
                "entropy_top": float(r["attn_entropy"][:, -1].mean()),
                "entropy_min": float(r["attn_entropy"].mean(0).min()),
                "max_logit_top": float(r["max_logit"][:, -1].mean()),
            }
    return PlacementComparison(num_blks, rows)


#: The exercises `run_exercises` knows, in the order it runs them.
EXERCISES = ("3c", "4", "5", "6c", "7")
TITLES = {
    "3c": "Exercise 3c: what a tied head reads (pre-LN)",
    "4": "Exercise 4: variance budget (pre-LN)",
    "5": "Exercise 5: rate of token collapse (post-LN)",
    "6c": "Exercise 6c: inflated query/key weights",
    "7": "Exercise 7: four placements, with and without QK-norm",
}


def run_exercises(
    names: Sequence[str],
    *,
    num_seeds: int = 3,
    num_blks: int = 32,
    num_hiddens: int = 256,
    num_heads: int = 4,
    pre: SignalStats | None = None,
) -> dict[str, Any]:
    """Run the named exercises at one protocol; returns name -> typed result.

    `pre` reuses a pre-LN run of that protocol (plain: no QK-norm, alpha 1,
    full FFN) for exercises 3c and 4 instead of running one. Seeds
    0..num_seeds-1.
    """
    owner = "run_exercises"
    for n in names:
        if n not in EXERCISES:
            raise ConfigError(
                f"{owner}: exercises must be among {list(EXERCISES)}, got {n!r}."
            )
    num_seeds, num_blks, num_hiddens, num_heads, _ = _check_protocol(
        owner, num_seeds, num_blks, num_hiddens, num_heads, 1.0
    )
    opts = dict(num_hiddens=num_hiddens, num_heads=num_heads)
    if {"3c", "4"} & set(names) and pre is None:
        pre = run_placements(["pre"], num_seeds, num_blks=num_blks, **opts)["pre"]
    run = {
        "3c": lambda: exercise_3c(pre),
        "4": lambda: exercise_4(pre),
        "5": lambda: exercise_5(num_seeds, num_blks, **opts),
        "6c": lambda: exercise_6c(num_hiddens, num_seeds),
        "7": lambda: exercise_7(num_seeds, num_blks, **opts),
    }
    return {n: run[n]() for n in EXERCISES if n in names}


# --------------------------------------------------------------------- report
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


@report_estimate_hook("signal")
def report_estimate(*, quick: bool, full: bool) -> float:
    """Seconds on 2 idle CPU cores (calibration: benchmarks/README.md)."""
    return 20.0 if quick else 140.0


@report_section_hook("signal")
def report_section(out_dir: Path, *, quick: bool, full: bool, progress: bool) -> str:
    """Run the signal study and its exercises; write 4 PNGs; return the Markdown.

    Full: 4 seeds, 32 blocks, d = 256, exercise 3c on a 128-block pre-LN run.
    `quick`: 1 seed, exercise 3c on the 32-block run. `progress`: a tqdm bar
    over the study's five runs (stderr). The full protocol runs on a CPU too
    (`full` changes nothing).
    """
    num_seeds, n = (1, 32) if quick else (4, 32)
    opts = dict(num_hiddens=256, num_heads=4)
    bar = tqdm(total=5, desc="signal", unit="run", leave=False, disable=not progress)
    main = signal_propagation(PLACEMENTS, num_seeds=num_seeds, num_blks=n, **opts)
    bar.update()
    figures = main.figures(out_dir)
    pre = main.stats["pre"]
    # 128 blocks of d = 256 hold about 1.5 GB per seed: one seed at a time
    deep = (
        pre
        if quick
        else run_placements(["pre"], num_seeds, chunk=1, num_blks=128, **opts)["pre"]
    )
    bar.update()
    ex3 = exercise_3c(deep)
    ex4 = exercise_4(pre)
    ex5 = exercise_5(num_seeds, n, **opts)
    bar.update()
    ex6 = exercise_6c(256, num_seeds)
    bar.update()
    ex7 = exercise_7(num_seeds, n, **opts)
    bar.update()
    bar.close()
    chapter = "\n".join(
        f"| {p} (chapter, JAX) | {rms:.2f} | "
        + " | ".join(f"{s:.1e}" for s in spreads)
        + " | "
        + " | ".join(f"{g:.1e}" for g in grads)
        + " |"
        for p, (rms, spreads, grads) in CHAPTER_JAX.items()
    )
    images = figure_links(figures)
    return (
        "## Signal propagation at initialization\n\n"
        f"{n} MiniBlocks (d = 256, 4 heads, LayerNorm, tanh-GELU MLP 4d with bias, "
        "attention without bias), every weight Xavier-uniform, input (2, 64, 256) "
        "standard normal, readout loss mean(R * H_N); "
        f"mean [min, max] over {num_seeds} seed(s), vmapped.\n\n"
        f"{main.table()}\n{chapter}\n\n{images}\n\n"
        f"### Exercise 7: off-stream normalization and QK-norm\n\n"
        f"{ex7.table()}\n\n{OUTPUT_FAILURE}\n\n"
        f"### Exercise 4: variance budget (pre-LN)\n\n{ex4.table()}\n\n"
        f"### Exercise 5: rate of token collapse (post-LN)\n\n{ex5.table()}\n\n"
        f"### Exercise 6c: inflated query/key weights\n\n{ex6.table()}\n\n"
        f"### Exercise 3c: what a tied head reads without the final norm (pre-LN)\n\n"
        f"{ex3.table()}\n"
    )
