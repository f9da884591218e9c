r"""Closed-form predictions for the block (exact integers where exact).

Every function here is pure arithmetic (Python integers, NumPy float64): it
never builds a module or draws a weight. `blocklab check` (and the tests)
compare each prediction with a measurement of the library itself:
`count_params` for the parameter counts,
`blocklab.diagnostics.propagation.signal_stats` for the variance budget and
the token collapse, `MultiHeadAttention` for the
QK-norm bounds and a timed `rms_norm` for the cost of a norm.

Contents, by exercise:

- 8a/8b: `ffn_param_count`, `block_param_count`, `block_deviation_from_12d2`,
  `ffn_deviation_bound`, `llama_ffn_width`, `llama_ffn_excess`.
- 6b: `qk_logit_bound`, `max_weight_ratio`.
- 4a/4b: `gelu_mean`, `gelu_second_moment`, `c_ffn_1`, `c_attn_1`,
  `softmax_collision`.
- 5a/5c: `collapse_rho0`, `collapse_spread`, `init_alpha`.
- 3b: `post_ln_identity_factor`.
- 9a/9c: `norm_cost`, `achieved_bandwidth`, `passes_over_x`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jaxtyping import ArrayLike, Float

from .._validate import ConfigError
from ..nn.config import GATED_ACTS, BlockConfig, check_act

__all__ = [
    "ffn_param_count",
    "block_param_count",
    "block_deviation_from_12d2",
    "ffn_deviation_bound",
    "llama_ffn_width",
    "llama_ffn_excess",
    "qk_logit_bound",
    "max_weight_ratio",
    "gelu_mean",
    "gelu_second_moment",
    "c_ffn_1",
    "c_attn_1",
    "softmax_collision",
    "collapse_rho0",
    "collapse_spread",
    "init_alpha",
    "post_ln_identity_factor",
    "NormCost",
    "norm_cost",
    "achieved_bandwidth",
    "passes_over_x",
]


# ------------------------------------------------------------ parameter counts
def _check_positive_int(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{owner}: {name} must be a positive int, got {value!r}.")


def _matched_width(num_hiddens: int, gated: bool) -> int:
    r"""$4d$, or $\mathrm{round}(8d/3)$ in integer arithmetic.

    $8d/3$ has fractional part 0, 1/3 or 2/3, so rounding never meets a tie
    and equals $\lfloor (8d + 1)/3 \rfloor$.
    """
    return (8 * num_hiddens + 1) // 3 if gated else 4 * num_hiddens


def ffn_param_count(
    num_hiddens: int,
    act: str = "swiglu",
    *,
    bias: bool = False,
    width: int | None = None,
) -> int:
    r"""Exact parameter count of `FeedForward(num_hiddens, act, bias=, width=)`.

    With width $w$ (default $4d$ ungated, $\mathrm{round}(8d/3)$ gated):
    ungated $2dw$ (+ $w + d$ biases), gated $3dw$ (+ $2w + d$ biases).
    """
    _check_positive_int("ffn_param_count", num_hiddens=num_hiddens)
    check_act("ffn_param_count", act)
    gated = act in GATED_ACTS
    w = _matched_width(num_hiddens, gated) if width is None else width
    _check_positive_int("ffn_param_count", width=w)
    matrices = 3 if gated else 2
    biases = (2 * w if gated else w) + num_hiddens if bias else 0
    return matrices * num_hiddens * w + biases


def block_param_count(
    num_hiddens: int | BlockConfig, num_heads: int | None = None, **options: Any
) -> int:
    r"""Exact parameter count of the `TransformerBlock` of a `BlockConfig`.

    Exercise 8a, generalized to the real-architecture options. Takes a
    `BlockConfig` alone, or `(num_hiddens, num_heads, **options)`, the
    arguments of `BlockConfig` (validated there). With $H$ query heads, $K$
    key/value heads, head width $p$ and FFN width $w$ (the config's resolved
    values):

    $$\underbrace{2dHp + 2dKp + (Hp + 2Kp + d)\,[\text{attn\_bias}]
    + n_{qk}}_{\text{attention}}
    + \underbrace{\text{FFN}(d, w)}_{\texttt{ffn\_param\_count}}
    + \underbrace{k \cdot d \cdot (1 + [\text{layer}])}_{\text{norms}}$$
    with $n_{qk} = 2p$ for per-head QK-norm (`True` / `"head"`), $(H + K)p$
    for `"full"`, 0 without; $k = 4$ norms for `"sandwich"`, else 2. For
    $K = H$, $Hp = d$ the attention is $4d^2 + 4d\,[\text{bias}]$
    and the default block has $4d^2 + 3d\,\mathrm{round}(8d/3) + 2d$.
    The options without parameters (`dropout`, `norm_eps`, `attn_scale`,
    `rope_theta`, `window`) do not change it.
    """
    if isinstance(num_hiddens, BlockConfig):
        if num_heads is not None or options:
            raise ConfigError(
                "block_param_count: give a BlockConfig alone or (num_hiddens, "
                f"num_heads, **options), got a BlockConfig and num_heads={num_heads!r}"
                f", options {sorted(options)}."
            )
        cfg = num_hiddens
    else:
        cfg = BlockConfig(num_hiddens, num_heads, **options)
    d, H, K, p = cfg.num_hiddens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention = 2 * d * H * p + 2 * d * K * p
    if cfg.attn_bias:
        attention += H * p + 2 * K * p + d
    if cfg.qk_norm == "full":
        attention += (H + K) * p
    elif cfg.qk_norm == "head":
        attention += 2 * p
    num_norms = 4 if cfg.placement == "sandwich" else 2
    norms = num_norms * d * (2 if cfg.norm == "layer" else 1)
    ffn = ffn_param_count(d, cfg.act, bias=cfg.ffn_bias, width=cfg.ffn_width)
    return attention + ffn + norms


def block_deviation_from_12d2(num_hiddens: int, num_heads: int, **options) -> float:
    r"""Relative deviation of the block's parameter count from $12d^2$: $n/(12d^2) - 1$.

    For the default block it is $(3d\,\delta + 2d)/(12 d^2)$ with
    $\delta = 3\,\mathrm{round}(8d/3) - 8d \in \{-1, 0, 1\}$, so between
    $1/(12d)$ and $5/(12d)$: $3/(12d) = 0.00098$ at $d = 256$
    ($12.01\,d^2$).
    """
    n = block_param_count(num_hiddens, num_heads, **options)
    return n / (12 * num_hiddens**2) - 1.0


def ffn_deviation_bound(num_hiddens: int) -> float:
    r"""Bound on $|\text{FFN}/(8d^2) - 1|$ for the default widths: $1/(8d)$.

    Ungated FFNs hold exactly $8d^2$. A gated one holds $3dw$ with
    $w = \mathrm{round}(8d/3)$ and $|3w - 8d| \le 1$, so it differs from $8d^2$
    by $0$ or $\pm d$: relative deviation 0 when $3 \mid d$, else exactly
    $1/(8d)$ (up when $d \equiv 1 \bmod 3$, down when $d \equiv 2$).
    """
    _check_positive_int("ffn_deviation_bound", num_hiddens=num_hiddens)
    return 1.0 / (8 * num_hiddens)


def llama_ffn_width(num_hiddens: int, multiple_of: int = 256) -> int:
    r"""Llama's SwiGLU width: the least multiple of $m$ not below $\lfloor 8d/3\rfloor$.

    Exercise 8b:

    $$w = m \left\lceil \lfloor 8d/3 \rfloor / m \right\rceil;$$
    $d = 4096$, $m = 256$ gives $\lfloor 32768/3 \rfloor = 10922 \to
    43 \cdot 256 = 11008$.
    """
    _check_positive_int(
        "llama_ffn_width", num_hiddens=num_hiddens, multiple_of=multiple_of
    )
    floor_width = (8 * num_hiddens) // 3
    return multiple_of * ((floor_width + multiple_of - 1) // multiple_of)


def llama_ffn_excess(num_hiddens: int, multiple_of: int = 256) -> float:
    r"""Relative excess of a Llama-rounded SwiGLU FFN over $8d^2$: $3w/(8d) - 1$.

    Exercise 8b:

    0.0078 at $d = 4096$ (11008), 0.125 at $d = 256$ (768) and 0.5 at
    $d = 128$ (512): at small widths the rounding, not the gate, sets the
    parameter budget, so a "parameter-matched" comparison must not use it.
    """
    w = llama_ffn_width(num_hiddens, multiple_of)
    return 3 * w / (8 * num_hiddens) - 1.0


# ------------------------------------------------------------------- QK-norm
def _gain_product_max(head_dim, gain_q, gain_k) -> float:
    _check_positive_int("qk_logit_bound", head_dim=head_dim)
    gq = np.ones(head_dim) if gain_q is None else np.asarray(gain_q, np.float64)
    gk = np.ones(head_dim) if gain_k is None else np.asarray(gain_k, np.float64)
    for name, g in (("gain_q", gq), ("gain_k", gk)):
        if g.shape != (head_dim,):
            raise ConfigError(
                f"qk_logit_bound: {name} must have shape (head_dim,) = ({head_dim},), "
                f"got {g.shape}."
            )
    return float(np.max(np.abs(gq * gk)))


def qk_logit_bound(
    head_dim: int,
    gain_q: Float[ArrayLike, " p"] | None = None,
    gain_k: Float[ArrayLike, " p"] | None = None,
) -> float:
    r"""Largest possible $|\hat q^\top \hat k| / \sqrt p$ under QK-norm, $\epsilon = 0$.

    Exercise 6b.

    RMS normalization gives $\|n_q\| = \|n_k\| = \sqrt p$, and the gains act
    after it: $\hat q = \gamma_q \odot n_q$, $\hat k = \gamma_k \odot n_k$. So
    $$\frac{|\hat q^\top \hat k|}{\sqrt p}
    = \frac{|n_q^\top \mathrm{diag}(\gamma_q \odot \gamma_k)\, n_k|}{\sqrt p}
    \le \sqrt p\, \max_i |\gamma_{q,i}\gamma_{k,i}|,$$
    attained by $n_q = \pm n_k = \sqrt p\, e_{i^*}$. Unit gains: $\sqrt p$.
    """
    return math.sqrt(head_dim) * _gain_product_max(head_dim, gain_q, gain_k)


def max_weight_ratio(
    head_dim: int,
    gain_q: Float[ArrayLike, " p"] | None = None,
    gain_k: Float[ArrayLike, " p"] | None = None,
) -> float:
    r"""Largest ratio of two attention weights of one query under QK-norm (ex. 6b).

    The weights of one query are $\propto e^{s_j}$, and the logits of one
    query over its keys span at most $[-B, B]$ with $B$ = `qk_logit_bound`
    (keys along $\pm e_{i^*}$ attain both ends), so the ratio is at most
    $e^{2B}$: $e^{16} \approx 8.9 \times 10^6$ for $p = 64$ and unit gains.
    """
    return math.exp(2.0 * qk_logit_bound(head_dim, gain_q, gain_k))


# ------------------------------------------------------------ variance budget
#: Probabilists' Gauss-Hermite nodes and weights for $\mathbb E f(z)$, $z \sim N(0, 1)$.
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(160)
_WEIGHTS = _WEIGHTS / math.sqrt(2.0 * math.pi)


def _gaussian_expectation(
    f: Callable[[np.ndarray], np.ndarray], variance: float
) -> float:
    if not variance >= 0:
        raise ConfigError(f"variance must be >= 0, got variance={variance!r}.")
    return float(np.sum(_WEIGHTS * f(math.sqrt(variance) * _NODES)))


def _gelu_tanh(z: np.ndarray) -> np.ndarray:
    """The tanh-GELU in float64 NumPy (`blocklab.nn.functional.gelu`'s)."""
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def gelu_mean(variance: float) -> float:
    r"""$\mathbb E[\mathrm{GELU}_\tanh(z)]$ for $z \sim \mathcal N(0, v)$.

    160-point Gauss-Hermite quadrature in float64.

    Positive for every $v > 0$: the part of an FFN's output that is the same
    for every token (exercise 5's "remaining gap").
    """
    return _gaussian_expectation(_gelu_tanh, variance)


def gelu_second_moment(variance: float) -> float:
    r"""$\mathbb E[\mathrm{GELU}_\tanh(z)^2]$ for $z \sim \mathcal N(0, v)$ (ex. 4a).

    Computed by 160-point Gauss-Hermite quadrature of the tanh-GELU in float64
    (the integrand is smooth, so the rule is exact to rounding for moderate
    $v$). Limits: $v/4 + 3v^2/(2\pi) + O(v^3)$ as $v \to 0$; $v/2$ (ReLU's)
    as $v \to \infty$.
    """
    return _gaussian_expectation(lambda z: _gelu_tanh(z) ** 2, variance)


def c_ffn_1(num_hiddens: int = 256, width: int | None = None) -> float:
    r"""Predicted mean square of block 1's FFN output in the MiniBlock stack (ex. 4a).

    Assumptions (each holds in `blocklab.diagnostics.propagation.chapter_stack`):

    1. the FFN reads a LayerNorm output, so every token has $\|x\|^2 = d$ (up to
       the norm's $\epsilon$; true for pre-LN's `norm2` and post-LN's `norm1`);
    2. $W_1 \in \mathbb R^{w\times d}$ and $W_2 \in \mathbb R^{d\times w}$ are
       Xavier: entries of variance $2/(d + w)$; biases are zero;
    3. the pre-activations $a = W_1 x$ are Gaussian (a sum of $d$ independent
       terms) with variance $v = d \cdot 2/(d + w)$, independent of $W_2$.

    Then $\mathbb E[\mathrm{FFN}(x)_i^2] = w \cdot \tfrac{2}{d + w}
    \cdot \mathbb E[\mathrm{GELU}(a)^2]$: with $w = 4d$, $v = 2/5$ and
    $c^\text{ffn}_1 = \tfrac85\,$`gelu_second_moment(0.4)` $= 0.2328$, for every $d$.
    """
    _check_positive_int("c_ffn_1", num_hiddens=num_hiddens)
    w = 4 * num_hiddens if width is None else width
    xavier_var = 2.0 / (num_hiddens + w)
    return w * xavier_var * gelu_second_moment(num_hiddens * xavier_var)


def softmax_collision(
    num_tokens: int,
    logit_variance: float = 1.0,
    *,
    num_samples: int = 1 << 18,
    seed: int = 0,
) -> float:
    r"""$\mathbb E[\sum_j a_j^2]$ for $a = \mathrm{softmax}(s)$, i.i.d. Gaussian logits.

    $s_j \sim \mathcal N(0, \sigma^2)$, $j = 1..n$.

    Monte Carlo in float64 with a fixed seed (deterministic; standard error
    about $10^{-4}$ relative at the default `num_samples`). For large $n$ it
    tends to $e^{\sigma^2}/n$; at $n = 64$, $\sigma^2 = 1$ it is 0.0388, 9 %
    below $e/64 = 0.0425$.
    """
    _check_positive_int(
        "softmax_collision", num_tokens=num_tokens, num_samples=num_samples
    )
    rng = np.random.default_rng(seed)
    total, done, chunk = 0.0, 0, 1 << 14
    while done < num_samples:
        m = min(chunk, num_samples - done)
        s = math.sqrt(logit_variance) * rng.standard_normal((m, num_tokens))
        e = np.exp(s - s.max(axis=1, keepdims=True))
        a = e / e.sum(axis=1, keepdims=True)
        total += float(np.sum(a * a))
        done += m
    return total / num_samples


def c_attn_1(
    num_tokens: int = 64,
    *,
    num_hiddens: int | None = None,
    finite_n: bool = False,
    logit_variance: float = 1.0,
) -> float:
    r"""Predicted mean square of block 1's attention output (MiniBlock stack, ex. 4b).

    Assumptions:

    1. the $n$ tokens the attention reads are independent with unit mean square
       (the standard-normal input, or its LayerNorm under pre-LN);
    2. $W_q, W_k, W_v, W_o$ are Xavier for a square matrix: variance $1/d$; so
       queries, keys and values have unit-variance coordinates, and a scaled
       logit $q^\top k/\sqrt p$ has variance $\sigma^2 = 1$;
    3. the logits of one query are independent $\mathcal N(0, \sigma^2)$ and
       independent of the values.

    Then the output of one head is $\sum_j a_j v_j$ with mean square
    $\mathbb E \sum_j a_j^2$, which $W_o$ preserves:
    $c^\text{attn}_1 = \mathbb E\sum_j a_j^2 \approx e^{\sigma^2}/n$ (large $n$;
    0.0425 at $n = 64$). `finite_n=True` returns the exact expectation under
    assumption 3 at this $n$ (`softmax_collision`, 0.0388).

    Assumption 3 drops one effect: the softmax picks keys whose tokens point
    along $w = W_k^\top q/\sqrt p$, so the weighted mean token has a component
    $\big(\sum_j a_j s_j/\sigma^2\big)\, w \approx w$, of squared norm $\sigma^2$,
    which adds $\sigma^2/d$ to the mean square. Pass `num_hiddens=d` to add it:
    $\mathbb E\sum_j a_j^2 + \sigma^2/d$ (0.0427 at $n = 64$, $d = 256$). The
    large-$n$ formula agrees with the measurement only because the finite-$n$
    deficit (-0.0037) and this term (+0.0039) nearly cancel.
    """
    _check_positive_int("c_attn_1", num_tokens=num_tokens)
    if finite_n or num_hiddens is not None:
        base = softmax_collision(num_tokens, logit_variance)
    else:
        base = math.exp(logit_variance) / num_tokens
    if num_hiddens is not None:
        _check_positive_int("c_attn_1", num_hiddens=num_hiddens)
        base += logit_variance / num_hiddens
    return base


# ------------------------------------------------------------- token collapse
def collapse_rho0(num_tokens: int) -> float:
    r"""Common-to-deviation energy $\rho_0$ of $n$ independent random tokens (ex. 5a).

    For i.i.d. zero-mean tokens, $\mathbb E\, n\|\mu\|^2 = d$ and
    $\mathbb E \sum_i \|\delta_i\|^2 = (n - 1)\,d$, so $\rho_0 = 1/(n - 1)$ and
    the initial spread is $(1 + \rho_0)^{-1/2} = \sqrt{(n-1)/n}$.
    """
    _check_positive_int("collapse_rho0", num_tokens=num_tokens)
    if num_tokens < 2:
        raise ConfigError(f"collapse_rho0: num_tokens must be >= 2, got {num_tokens}.")
    return 1.0 / (num_tokens - 1)


def collapse_spread(num_blks: int, alpha: float, num_tokens: int) -> float:
    r"""Predicted token spread after $k$ post-LN blocks, FFN sublayers ignored (ex. 5a).

    Write the tokens as $x_i = \mu + \delta_i$ and $\rho = n\|\mu\|^2 /
    \sum_i\|\delta_i\|^2$; the spread is $(1 + \rho)^{-1/2}$. With (nearly)
    uniform attention a sublayer adds $M\mu$, $M = W_o W_v$, to every token;
    with entries of variance $\alpha^2/d$, $\|M\mu\|^2 \approx \alpha^4\|\mu\|^2$
    and $\langle \mu, M\mu\rangle \approx 0$, so the common energy grows by
    $1 + \alpha^4$ while the deviations are untouched; a norm common to all
    tokens does not change $\rho$. Hence
    $$\rho_k = \rho_0 (1 + \alpha^4)^k,\qquad
    \text{spread}_k = \big(1 + (1 + \alpha^4)^k/(n - 1)\big)^{-1/2}.$$

    Measured with `blocklab.diagnostics.propagation`, a post-LN stack whose
    FFN writes zero follows this at k = 8, 16, 32 and for GPT-1's
    initialization; the full MiniBlock collapses faster, because the
    tanh-GELU has a positive mean (`gelu_mean(0.4)` = 0.135) and every FFN
    adds the same vector $W_2\,\mathbb E[\mathrm{GELU}]$ (mean square
    $1.6 \cdot 0.135^2 = 0.029$) to every token: an additive common component
    the formula leaves out.

    `num_blks` is $k$.
    """
    if not isinstance(num_blks, int) or num_blks < 0:
        raise ConfigError(
            f"collapse_spread: num_blks must be a non-negative int, got {num_blks!r}."
        )
    if alpha is None or not alpha >= 0:
        raise ConfigError(f"collapse_spread: alpha must be >= 0, got alpha={alpha!r}.")
    rho = collapse_rho0(num_tokens) * (1.0 + alpha**4) ** num_blks
    return (1.0 + rho) ** -0.5


def init_alpha(num_hiddens: int, std: float) -> float:
    r"""$\alpha = \mathrm{std}\sqrt d$ of a $d\times d$ matrix with entry std `std`.

    Exercise 5 writes the entry variance as $\alpha^2/d$ ($\alpha = 1$ is
    Xavier for a square matrix). GPT-1 ($d = 768$, std 0.02) has
    $\alpha = 0.02\sqrt{768} = 0.554$.
    """
    _check_positive_int("init_alpha", num_hiddens=num_hiddens)
    return std * math.sqrt(num_hiddens)


def post_ln_identity_factor(
    c: float | Sequence[float] | Float[ArrayLike, " n"],
    num_blks: int | None = None,
) -> float:
    r"""Post-LN's stand-in for pre-LN's identity term: $\prod_j (1 + c_j)^{-1/2}$.

    Exercise 3b.

    With unit-RMS input, RMSNorm ($\gamma = 1$, $\epsilon = 0$) and branch
    outputs uncorrelated with the stream, $r(u_j)^2 = 1 + c_j$, and the
    product of the $2N$ norm Jacobians scales every vector orthogonal to all
    $u_j$ by $\prod_j r(u_j)^{-1} = \prod_j (1 + c_j)^{-1/2}$. Pass a sequence
    of the $2N$ mean squares $c_j$, or a common $c$ and `num_blks` $N$:
    $(1 + c)^{-N}$, exponentially small in depth, where pre-LN's identity
    term is 1 at every depth.
    """
    if num_blks is None:
        cs = np.asarray(c, np.float64)
        return float(np.prod((1.0 + cs) ** -0.5))
    if not isinstance(num_blks, int) or num_blks < 0:
        raise ConfigError(
            f"post_ln_identity_factor: num_blks must be a non-negative int, "
            f"got {num_blks!r}."
        )
    return float((1.0 + float(c)) ** (-num_blks))


# ------------------------------------------------------------- norm cost (ex 9)
@dataclass(frozen=True)
class NormCost:
    """Minimal memory traffic and arithmetic of one normalizer call (ex. 9a).

    Attributes:
        bytes_read: the input once, plus the parameters.
        bytes_written: the output once.
        flops_per_element: floating-point operations per element of X.
        flops: total floating-point operations.
    """

    bytes_read: int
    bytes_written: int
    flops_per_element: int
    flops: int

    @property
    def bytes_moved(self) -> int:
        """Read plus written."""
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP per byte (far below any machine's balance)."""
        return self.flops / self.bytes_moved


#: Per-element operation counts: RMSNorm squares and sums (2), scales by the
#: reciprocal RMS and by the gain (2); LayerNorm also sums for the mean,
#: subtracts it and adds the shift (3 more). Per-row work (a division by d,
#: the epsilon, a reciprocal square root) is O(1/d) per element and dropped.
_FLOPS_PER_ELEMENT = {"rms": 4, "layer": 7}


def norm_cost(shape: Sequence[int], norm: str = "rms", itemsize: int = 4) -> NormCost:
    r"""Minimal bytes and flops of RMSNorm / LayerNorm over the last axis of X (ex. 9a).

    A normalizer must read X once and write Y once: $2\,|X|$ bytes, plus its
    $d$ gains (and $d$ shifts for LayerNorm). For X of shape (64, 512, 1024)
    in float32 that is 268 435 456 bytes (256 MiB) plus 4 or 8 KiB, against
    4 (RMSNorm) or 7 (LayerNorm) flops per element: about 0.5-0.9 flop per
    byte, so both are memory-bound everywhere.
    """
    if norm not in _FLOPS_PER_ELEMENT:
        raise ConfigError(
            f"norm_cost: norm must be one of {sorted(_FLOPS_PER_ELEMENT)}, "
            f"got norm={norm!r}."
        )
    size = math.prod(int(s) for s in shape)
    d = int(shape[-1])
    params = d * (2 if norm == "layer" else 1)
    per = _FLOPS_PER_ELEMENT[norm]
    return NormCost(
        bytes_read=(size + params) * itemsize,
        bytes_written=size * itemsize,
        flops_per_element=per,
        flops=per * size,
    )


def achieved_bandwidth(bytes_moved: int, seconds: float) -> float:
    """Bytes per second: `bytes_moved / seconds` (ex. 9b)."""
    if not seconds > 0:
        raise ConfigError(f"achieved_bandwidth: seconds must be > 0, got {seconds!r}.")
    return bytes_moved / seconds


def passes_over_x(seconds: float, bandwidth: float, nbytes_x: int) -> float:
    r"""How many times a kernel of this duration could have streamed X (ex. 9c).

    $\text{passes} = t \cdot B / |X|$ with $B$ the bandwidth achieved by a
    reference map such as $X \mapsto 2X$ (which itself makes 2 passes: one
    read, one write). A normalizer that reads X once and writes Y once makes
    2; each extra pass (a second read for the statistics, a temporary)
    adds one.
    """
    if not seconds > 0 or not bandwidth > 0 or nbytes_x <= 0:
        raise ConfigError(
            "passes_over_x: seconds, bandwidth and nbytes_x must be positive, got "
            f"seconds={seconds!r}, bandwidth={bandwidth!r}, nbytes_x={nbytes_x!r}."
        )
    return seconds * bandwidth / nbytes_x
