r"""Signal propagation at initialization: what a fresh deep stack does to its input.

A freshly initialized stack is a fixed random function, so without training we
can measure how it treats a random input $X$ and how much gradient each block
receives from a generic loss at the top. For a stack
$h_k = B_k(h_{k-1})$, $h_0 = X$, `signal_stats` records per block $k = 1..N$:

- the stream RMS $\sqrt{\overline{h_k^2}}$ and the cross-token spread
  $\|H_k - \bar H_k\| / \|H_k\|$ (`blocklab.nn.functional.token_spread`);
- the mean squares $c^\text{attn}_k, c^\text{ffn}_k$ of what each branch adds
  to the stream (the terms of the pre-LN variance budget
  $\overline{h_k^2} \approx 1 + \sum_{i\le k} (c^\text{attn}_i + c^\text{ffn}_i)$);
- the mean attention entropy and the largest scaled attention logit;
- the Frobenius norm of the gradient of the readout loss
  $\ell = \mathrm{mean}(R \odot H_N)$, $R \sim \mathcal N(0, 1)$ fixed, with
  respect to $W_q, W_k, W_v, W_o$ of every block.

A linear readout is used because after a final normalization $\|H\|^2$ is
constant and its gradient vanishes by construction.

`chapter_stack` builds the chapter's MiniBlock stack (LayerNorm, tanh-GELU MLP
of width $4d$ with bias, attention without bias, every weight Xavier-uniform)
for any of the four placements; `signal_run` / `signal_sweep` draw the input
and readout from a key and vmap the whole experiment over seeds in one
compiled program. The exercise helpers below (`variance_budget`,
`fit_power_law`, `logit_growth`, `head_input_rms`) turn the measurements
into the quantities of a variance budget, a depth power law, logit growth
under QK-norm and the input RMS of each head (the studies in
`blocklab.experiments.signal` report them).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._validate import ConfigError, check_int
from ..nn import init
from ..nn.attention import MultiHeadAttention
from ..nn.block import PLACEMENTS, TransformerBlock
from ..nn.ffn import FeedForward
from ..nn.functional import attention_entropy, token_spread
from ..nn.moe import MoETrace
from ..nn.stack import Stack
from ..training.member_axis import sharded_map

__all__ = [
    "SignalStats",
    "signal_stats",
    "chapter_stack",
    "signal_run",
    "signal_sweep",
    "variance_budget",
    "fit_power_law",
    "logit_growth",
    "head_input_rms",
    "PROJECTIONS",
]

#: The attention projections whose gradient norms `signal_stats` records.
PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")


class SignalStats(eqx.Module):
    """Per-block statistics of one forward and one backward pass (arrays over k = 1..N).

    Under `jax.vmap` / `signal_sweep` every field gains leading seed axes.

    Attributes:
        stream_rms: RMS of the residual stream after block k (over the whole batch).
        token_spread: $\\|H_k - \\bar H_k\\| / \\|H_k\\|$, $\\bar H_k$ the mean token
            of each sequence (1: unrelated tokens, 0: collapsed).
        c_attn: mean square of what the attention branch adds to the stream.
        c_ffn: likewise for the FFN branch.
        attn_entropy: attention entropy in nats, mean over batch, heads and
            queries ($\\log T$ is uniform attention).
        max_logit: largest $|q^\\top k| / \\sqrt p$ over batch, heads, queries, keys.
        grad_norms: `"W_q"`, `"W_k"`, `"W_v"`, `"W_o"` -> Frobenius norm of the
            gradient of $\\mathrm{mean}(R \\odot H_N)$ with respect to that
            projection's weight in block k.
        router_entropy: for a stack of mixture-of-experts blocks (FFN a
            `blocklab.MoEFeedForward`), the mean router entropy in nats over
            the batch's tokens ($\\log E$ is uniform routing); `None` otherwise.
        expert_load: `(..., N, E)` for MoE blocks: the fraction of the token
            slots routed to each expert (sums to 1 over E); `None` otherwise.
    """

    stream_rms: Float[Array | np.ndarray, "*seeds N"]
    token_spread: Float[Array | np.ndarray, "*seeds N"]
    c_attn: Float[Array | np.ndarray, "*seeds N"]
    c_ffn: Float[Array | np.ndarray, "*seeds N"]
    attn_entropy: Float[Array | np.ndarray, "*seeds N"]
    max_logit: Float[Array | np.ndarray, "*seeds N"]
    grad_norms: dict[str, Float[Array | np.ndarray, "*seeds N"]]
    router_entropy: Float[Array | np.ndarray, "*seeds N"] | None = None
    expert_load: Float[Array | np.ndarray, "*seeds N E"] | None = None

    def as_dict(self) -> dict[str, Array | np.ndarray]:
        """The fields as a flat dict (`grad_norms` entries as `grad_W_q`, ...).

        Fields may hold NumPy arrays once converted for printing or plotting.
        """
        out = {
            name: getattr(self, name)
            for name in (
                "stream_rms",
                "token_spread",
                "c_attn",
                "c_ffn",
                "attn_entropy",
                "max_logit",
            )
        }
        out.update({f"grad_{n}": g for n, g in self.grad_norms.items()})
        if self.router_entropy is not None:  # MoE stacks (expert_load: per expert)
            out["router_entropy"] = self.router_entropy
        return out


def _mean_square(x: Array) -> Array:
    return jnp.mean(jnp.square(x.astype(jnp.promote_types(x.dtype, jnp.float32))))


def _readout_array(readout, shape, dtype) -> Array:
    """R from an array, a PRNG key, or `None` (the fixed key 0)."""
    if readout is None:
        readout = jax.random.key(0)
    if jnp.issubdtype(readout.dtype, jax.dtypes.prng_key) or jnp.issubdtype(
        readout.dtype, jnp.integer
    ):
        return jax.random.normal(readout, shape, dtype)
    if readout.shape != shape:
        raise ConfigError(
            f"signal_stats: readout must be a PRNG key or an array of the shape of "
            f"X {shape}, got readout.shape={tuple(readout.shape)}."
        )
    return readout.astype(dtype)


def _collect(block, h, key):
    """One block inside the scan: its output and its statistics over the batch."""
    tr = block.trace(h, key=key)
    if tr.attention is None:
        raise ConfigError(
            "signal_stats needs attention with a `trace` method (weights and "
            "logits); the block's attention module has none."
        )
    stats = dict(
        h=tr.output,
        c_attn=_mean_square(tr.attn_out),
        c_ffn=_mean_square(tr.ffn_out),
        attn_entropy=jnp.mean(attention_entropy(tr.attention.weights)),
        max_logit=jnp.max(jnp.abs(tr.attention.logits)),
    )
    if isinstance(tr.ffn_trace, MoETrace):
        stats.update(router_entropy=tr.ffn_trace.entropy, expert_load=tr.ffn_trace.load)
    return tr.output, stats


def signal_stats(
    stack: Stack,
    X: Float[Array, "B T d"],
    readout: Float[Array, "..."] | PRNGKeyArray | None = None,
) -> SignalStats:
    r"""Per-block signal statistics of `stack` on `X`: one forward, one backward pass.

    The stack acts on the batch `X` in one batched call; the per-block values
    are collected out of its `lax.scan`
    (`Stack.scan(..., collect=...)`, through `TransformerBlock.trace`, the same
    code path as the forward pass). Stream RMS, spread and branch mean squares
    are taken over the whole batch. The gradients are those
    of the readout loss $\ell(\theta) = \mathrm{mean}(R \odot H_N(\theta))$.

    Jitted (`eqx.filter_jit`) and unchanged under `jax.vmap` over stacks,
    inputs and readouts (seeds).

    Args:
        stack: a `Stack` of `TransformerBlock`s whose attention has `W_q`,
            `W_k`, `W_v`, `W_o` and a `trace` method (the default attention).
        X: `(B, T, d)` input batch.
        readout: the readout array $R$ of the shape of `X`, or a PRNG key from
            which $R \sim \mathcal N(0, 1)$ is drawn; `None` uses `jax.random.key(0)`.

    Returns:
        A `SignalStats` with arrays of length N = `stack.num_blks`.

    Raises:
        ConfigError: a concrete `X` holding NaN or inf (named by position).
            A traced one (under `jit` or `vmap`) cannot be refused: every
            statistic of it is then NaN, the gradient norms included (the
            attention's guard against non-finite keys would otherwise keep
            those finite).
    """
    if not isinstance(X, jax.core.Tracer) and hasattr(X, "dtype"):
        bad = ~np.isfinite(np.asarray(X))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ConfigError(
                f"signal_stats: X must be finite, got X{list(where)}="
                f"{np.asarray(X)[where]} ({int(bad.sum())} non-finite entries)."
            )
    return _signal_stats(stack, X, readout)


@eqx.filter_jit
def _signal_stats(stack, X, readout) -> SignalStats:
    """`signal_stats`, jitted, without the concrete input check."""
    R = _readout_array(readout, X.shape, X.dtype)
    # Differentiate only the four projection weights, so that no other weight
    # gradient is ever formed (the input gradients are needed anyway).
    wrt = eqx.tree_at(
        lambda s: [getattr(s.blocks.attention, n).weight for n in PROJECTIONS],
        jax.tree_util.tree_map(lambda _: False, stack),
        replace=[True] * len(PROJECTIONS),
    )
    params, static = eqx.partition(stack, wrt)

    def loss(params):
        model = eqx.combine(params, static)
        H, stats = model.scan(X, collect=_collect)
        return jnp.mean(R * H), stats

    (_, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    H = stats["h"]  # (N, B, T, d)
    attn_grads = grads.blocks.attention
    finite = jnp.all(jnp.isfinite(X))
    grad_norms = {
        name: jnp.where(
            finite,
            jnp.sqrt(jnp.sum(jnp.square(getattr(attn_grads, name).weight), (-2, -1))),
            jnp.nan,
        )
        for name in PROJECTIONS
    }
    return SignalStats(
        stream_rms=jnp.sqrt(jax.vmap(_mean_square)(H)),
        token_spread=jax.vmap(token_spread)(H),
        c_attn=stats["c_attn"],
        c_ffn=stats["c_ffn"],
        attn_entropy=stats["attn_entropy"],
        max_logit=stats["max_logit"],
        grad_norms=grad_norms,
        router_entropy=stats.get("router_entropy"),
        expert_load=stats.get("expert_load"),
    )


class _ZeroFFN(eqx.Module):
    """An FFN sublayer that writes nothing: $\\mathrm{FFN}(x) = 0$ (exercise 5)."""

    def __call__(self, x, *, key=None):
        del key
        return jnp.zeros_like(x)


@eqx.filter_jit
def chapter_stack(
    placement: str = "pre",
    *,
    num_blks: int = 32,
    num_hiddens: int = 256,
    num_heads: int = 4,
    qk_norm: bool = False,
    alpha: float = 1.0,
    ffn: bool = True,
    key: PRNGKeyArray,
) -> Stack:
    r"""A signal stack: N MiniBlocks, Xavier-uniform, scaled by `alpha`.

    Each block is `TransformerBlock(num_hiddens, num_heads, norm="layer",
    act="gelu", placement=placement, bias=False, qk_norm=qk_norm)` with its FFN
    replaced (through `ffn_factory`) by the MiniBlock MLP
    $W_2\,\mathrm{GELU}_\tanh(W_1 x + b_1) + b_2$ of width $4d$ *with* biases,
    while the attention has none. Every weight matrix is then re-drawn
    Xavier-uniform (`blocklab.nn.init.xavier_uniform`) and multiplied by `alpha`
    (`blocklab.nn.init.scale`); biases stay zero and norm gains one.

    Args:
        placement: `"post"`, `"pre"`, `"output"` or `"sandwich"`.
        num_blks, num_hiddens, num_heads: depth N, width d, heads h.
        qk_norm: RMS-normalize queries and keys per head.
        alpha: scale of every weight matrix after the Xavier draw.
        ffn: `False` replaces the FFN by a sublayer that returns zeros.
        key: PRNG key (split into a build key and an initialization key).

    Jitted (`eqx.filter_jit`; the options are static), so building a deep
    stack eagerly costs one compilation rather than thousands of small ops.
    """
    if placement not in PLACEMENTS:
        raise ConfigError(
            f"chapter_stack: placement must be one of {list(PLACEMENTS)}, "
            f"got placement={placement!r}."
        )
    build_key, init_key = jax.random.split(key)
    if ffn:

        def ffn_factory(*, key):
            return FeedForward(num_hiddens, "gelu", bias=True, key=key)
    else:

        def ffn_factory(*, key):
            del key
            return _ZeroFFN()

    def make_block(k):
        return TransformerBlock(
            num_hiddens,
            num_heads,
            norm="layer",
            act="gelu",
            placement=placement,
            bias=False,
            qk_norm=qk_norm,
            ffn_factory=ffn_factory,
            key=k,
        )

    stack = Stack(make_block, num_blks, key=build_key)
    stack = init.xavier_uniform(stack, key=init_key)
    return stack if alpha == 1.0 else init.scale(stack, alpha)


@functools.partial(
    jax.jit,
    static_argnames=(
        "placement",
        "batch_size",
        "seq_len",
        "num_blks",
        "num_hiddens",
        "num_heads",
        "qk_norm",
        "alpha",
        "ffn",
    ),
)
def signal_run(
    key: PRNGKeyArray,
    placement: str = "pre",
    *,
    batch_size: int = 2,
    seq_len: int = 64,
    num_blks: int = 32,
    num_hiddens: int = 256,
    num_heads: int = 4,
    qk_norm: bool = False,
    alpha: float = 1.0,
    ffn: bool = True,
) -> SignalStats:
    """One seed of the signal experiment: stack, input and readout drawn from `key`.

    Jitted (the options are static), so a warm call builds nothing eagerly.

    `key` is split into the stack's key (`chapter_stack`), the key of the
    standard-normal input `X` of shape `(batch_size, seq_len, num_hiddens)`
    and the key of the readout $R$; returns `signal_stats(stack, X, readout)`.
    """
    stack_key, x_key, r_key = jax.random.split(key, 3)
    stack = chapter_stack(
        placement,
        num_blks=num_blks,
        num_hiddens=num_hiddens,
        num_heads=num_heads,
        qk_norm=qk_norm,
        alpha=alpha,
        ffn=ffn,
        key=stack_key,
    )
    X = jax.random.normal(x_key, (batch_size, seq_len, num_hiddens), jnp.float32)
    return signal_stats(stack, X, r_key)


@functools.lru_cache(maxsize=64)
def _seed_fn(placement, options):
    return functools.partial(signal_run, placement=placement, **dict(options))


def signal_sweep(
    placement: str,
    seeds: Sequence[int] | PRNGKeyArray | None = None,
    *,
    num_seeds: int | None = None,
    chunk: int | None = None,
    **options,
) -> SignalStats:
    """`signal_run` over many seeds as one compiled, vmapped program.

    The seed axis goes through `blocklab.training.sweep.sharded_map`: vmapped, and
    sharded over every visible device (padded to a multiple of their number).

    Args:
        placement: as for `chapter_stack`.
        seeds: a sequence of int seeds, or an array of PRNG keys; seed s uses
            `jax.random.key(s)`.
        num_seeds: instead of `seeds`, a count S: seeds 0..S-1.
        chunk: seeds per compiled call, to bound memory on deep or wide
            stacks (each seed holds its stack, gradients and activations);
            `None`: all at once. The values do not depend on it.
        **options: keyword options of `signal_run` (`num_blks`, `alpha`, ...).

    Returns:
        `SignalStats` whose fields have shape `(S, N)`.
    """
    if isinstance(seeds, numbers.Number):
        raise ConfigError(
            "signal_sweep: seeds must be a sequence of int seeds or an array of "
            f"PRNG keys, got the number {seeds!r}; a count S of seeds (0..S-1) "
            "is num_seeds=S."
        )
    if (seeds is None) == (num_seeds is None):
        raise ConfigError(
            "signal_sweep: give the seeds as seeds=[...] (a sequence or PRNG keys) "
            f"or a count as num_seeds=S, exactly one; got seeds={seeds!r} and "
            f"num_seeds={num_seeds!r}."
        )
    if num_seeds is not None:
        seeds = range(check_int("signal_sweep", "num_seeds", num_seeds, min=1))
    is_keys = hasattr(seeds, "dtype") and jnp.issubdtype(
        seeds.dtype, jax.dtypes.prng_key
    )
    if not is_keys:
        seeds = jax.vmap(jax.random.key)(jnp.asarray(list(seeds), jnp.uint32))
    fn = _seed_fn(placement, tuple(sorted(options.items())))
    return sharded_map(fn, seeds, chunk=chunk)


def variance_budget(stats: SignalStats) -> tuple[Array, Array]:
    r"""Exercise 4: the pre-LN variance budget against the measured stream mean square.

    The budget after block k is
    $1 + \sum_{i \le k} (c^\text{attn}_i + c^\text{ffn}_i)$.

    Returns `(budget, measured)`, both over blocks (with any leading seed
    axes): the prediction for the stream mean square after block k if every
    branch output is uncorrelated with the stream it joins (and the input has
    unit mean square), and the measured mean square `stream_rms**2`.
    """
    budget = 1.0 + jnp.cumsum(stats.c_attn + stats.c_ffn, axis=-1)
    return budget, jnp.square(stats.stream_rms)


def fit_power_law(
    y: Float[Array | np.ndarray, " K"] | Sequence[float],
    first: int = 1,
    last: int | None = None,
) -> tuple[float, float]:
    r"""Least-squares fit $y_k \approx a\,k^b$ over blocks `first..last` (1-based).

    Fits $\log y_k = \log a + b \log k$; returns `(b, a)`. Used on the stream
    RMS (exercise 4): square-root growth is $b = 1/2$.
    """
    y = np.asarray(y, np.float64)
    last = len(y) if last is None else last
    if not 1 <= first < last <= len(y):
        raise ConfigError(
            f"fit_power_law: need 1 <= first < last <= {len(y)}, got first={first}, "
            f"last={last}."
        )
    k = np.arange(first, last + 1, dtype=np.float64)
    b, log_a = np.polyfit(np.log(k), np.log(y[first - 1 : last]), 1)
    return float(b), float(math.exp(log_a))


@functools.partial(
    jax.jit, static_argnames=("qk_norm", "num_hiddens", "num_heads", "seq_len")
)
def logit_growth(
    lambdas: Float[Array, " L"],
    *,
    qk_norm: bool,
    num_hiddens: int = 256,
    num_heads: int = 4,
    seq_len: int = 64,
    key: PRNGKeyArray,
) -> dict[str, Array]:
    r"""Exercise 6c: attention logits and entropy as $W_q, W_k$ grow by $\lambda$.

    A freshly initialized `MultiHeadAttention` (no bias, Xavier-uniform
    weights) gets $W_q, W_k \mapsto \lambda W_q, \lambda W_k$ and reads
    `seq_len` standard-normal tokens. Without QK-norm the logits scale as
    $\lambda^2$ (std about $\lambda^2$ at initialization) and the softmax
    saturates; with QK-norm they do not move (up to the norm's $\epsilon$).

    Returns:
        `{"logit_std": (L,), "entropy": (L,)}`: standard deviation of the scaled
        logits over heads, queries and keys, and the mean attention entropy in
        nats (uniform attention: $\log$ `seq_len`).
    """
    layer_key, x_key = jax.random.split(key)
    attn = MultiHeadAttention(num_hiddens, num_heads, qk_norm=qk_norm, key=layer_key)
    attn = init.xavier_uniform(attn, key=layer_key)
    x = jax.random.normal(x_key, (seq_len, num_hiddens), jnp.float32)

    def one(lam):
        scaled = eqx.tree_at(
            lambda a: (a.W_q.weight, a.W_k.weight),
            attn,
            (lam * attn.W_q.weight, lam * attn.W_k.weight),
        )
        tr = scaled.trace(x)
        return jnp.std(tr.logits), jnp.mean(attention_entropy(tr.weights))

    std, entropy = jax.vmap(one)(jnp.asarray(lambdas, jnp.float32))
    return {"logit_std": std, "entropy": entropy}


def head_input_rms(
    stream_rms: Float[Array | np.ndarray, "*seeds N"],
    depths: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
    r"""Exercise 3c: what a tied output head would read without a final norm (pre-LN).

    The top of a depth-D stack is its stream after block D, so the `stream_rms`
    of one run of depth N (from `signal_stats` / `signal_sweep`, any leading
    seed axes) gives the RMS of the head's input at every depth D <= N. A final
    RMSNorm would hand the head unit RMS whatever D; without it the head's
    logits grow with the stream, roughly as $\sqrt{D}$ for pre-LN.

    Args:
        stream_rms: `(..., N)` stream RMS per block.
        depths: the depths D to read (1-based); default the powers of two <= N.

    Returns:
        `{"depth": (D,), "rms": (D,), "rms_min": (D,), "rms_max": (D,)}`: the
        mean and min/max over the leading (seed) axes.
    """
    rms = np.asarray(stream_rms, np.float64)
    n = rms.shape[-1]
    if depths is None:
        depths = [2**i for i in range(n.bit_length()) if 2**i <= n]
    depths = np.asarray(sorted({int(d) for d in depths}))
    if depths.size == 0 or depths[0] < 1 or depths[-1] > n:
        raise ConfigError(
            f"head_input_rms: depths must lie in 1..{n}, got {depths.tolist()}."
        )
    at = rms.reshape(-1, n)[:, depths - 1]
    return {
        "depth": depths,
        "rms": at.mean(0),
        "rms_min": at.min(0),
        "rms_max": at.max(0),
    }
