"""Pure array functions: the arithmetic of the transformer block.

Everything here is a plain function of arrays, so it composes with `jax.jit`,
`jax.vmap`, `jax.grad` and `jax.jacfwd` without any module machinery. Norms,
softmax and their statistics are computed in float32 (or float64 when the
input already is) and returned in the input dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_float, check_int, check_key

__all__ = [
    "linear",
    "dense",
    "dense_weight_first",
    "rms_norm",
    "layer_norm",
    "relu",
    "gelu",
    "gelu_exact",
    "silu",
    "ACTIVATIONS",
    "dropout",
    "valid_mask",
    "causal_lengths",
    "masked_softmax",
    "rope",
    "rope_frequencies",
    "rope_theta_bits",
    "rotate_half",
    "segment_positions",
    "attention_entropy",
    "token_spread",
    "MASK_VALUE",
]

#: The score given to masked keys before the softmax (a finite value). A
#: query whose keys are all masked therefore attends uniformly instead of
#: producing NaN.
MASK_VALUE = -1e6


def _stat_dtype(dtype) -> jnp.dtype:
    """float32, or the input dtype when that is already wider."""
    return jnp.promote_types(dtype, jnp.float32)


def _safe_rsqrt(ms: Array, eps: Any) -> Array:
    r"""$1/\sqrt{m + \epsilon}$, with $m + \epsilon = 0$ (only reachable with
    `eps=0`) read as 1.

    The statistic's row is then exactly zero (all entries, or all deviations
    from the mean, are zero), so the output row is zero instead of
    $0 \cdot \infty = $ NaN. The `where` acts on the *input* of the rsqrt,
    so the untaken branch is finite and the gradient is too (a `where` on the
    output would still send $0 \cdot \infty$ back). With a positive Python
    `eps` the guard cannot trigger and is left out: it splits XLA's single
    fused pass over `x` into two (1.5x the bytes moved).
    """
    if isinstance(eps, (int, float)) and eps > 0:
        return jax.lax.rsqrt(ms + eps)
    ms = ms + eps
    return jax.lax.rsqrt(jnp.where(ms > 0, ms, jnp.ones_like(ms)))


def _wider(dtype: Any, out_dtype: Any) -> Any:
    """The wider of `dtype` and the floating dtype `out_dtype` (refused otherwise)."""
    try:
        wide = jnp.promote_types(dtype, out_dtype)
    except TypeError:
        wide = None
    if wide is None or not jnp.issubdtype(out_dtype, jnp.floating):
        raise ConfigError(
            f"linear: out_dtype must be a floating dtype (e.g. jnp.float32) or None, "
            f"got {out_dtype!r}."
        )
    return wide


def linear(
    x: Float[Array, "*batch n"],
    weight: Float[Array, "m n"],
    bias: Float[Array, " m"] | None = None,
    *,
    out_dtype: Any = None,
) -> Float[Array, "*batch m"]:
    r"""$y = x W^\top + b$ on every row of `x` (PyTorch's `(out, in)` layout).

    All leading axes of `x` are flattened into one before the product, so
    that the weight gradient $\partial L / \partial W = G^\top X$ is a
    matrix product over a single row axis. A batch of sequences `(B, T, n)`
    left unflattened (as `jax.vmap` leaves it) contracts over two axes, and
    XLA:CPU then copies the activations into a transposed layout first,
    fusing the activation's backward into that copy (measured cost:
    benchmarks/README.md). Computes in the wider of the two dtypes.

    `out_dtype` (e.g. `jnp.float32` for a language model's logits) makes the
    product accumulate in, and return, the wider of it and the operands'
    dtype (XLA's `preferred_element_type`): bfloat16 operands then give
    float32 sums of their exact products instead of a bfloat16-rounded result,
    at no extra memory traffic for the operands.
    """
    dtype = jnp.result_type(x.dtype, weight.dtype)
    rows = x.reshape(-1, x.shape[-1])
    if out_dtype is None:
        y = rows @ weight.T.astype(dtype)
    else:
        wide = _wider(dtype, out_dtype)
        y = jnp.matmul(rows, weight.T.astype(dtype), preferred_element_type=wide)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def dense(layer: Any, x: Float[Array, "*batch n"]) -> Float[Array, "*batch m"]:
    """Apply an `eqx.nn.Linear` to every row of `x`: $x W^\\top + b$ (`linear`).

    An adapted layer (`blocklab.nn.lora.LoRALinear`, recognized by its
    `add_delta` method) adds its low-rank term to its frozen base's product.
    """
    if hasattr(layer, "add_delta"):
        return layer.add_delta(x, dense(layer.frozen_base(), x))
    return linear(x, layer.weight, layer.bias)


def dense_weight_first(
    layer: Any, x: Float[Array, "*batch n"]
) -> Float[Array, "*batch m"]:
    """`dense(layer, x)` written as $(W x^\top)^\top + b$, the weight on the
    left: the same products. For the few rows of a decoding step, XLA:CPU
    fuses the attention's last sum into the product written `x @ W.T` and then
    reads $W$ transposed, one strided column per output, which is several
    times slower (`benchmarks/generate.py`). An adapted layer adds its
    low-rank term, as in `dense`."""
    if hasattr(layer, "add_delta"):
        return layer.add_delta(x, dense_weight_first(layer.frozen_base(), x))
    dtype = jnp.result_type(x.dtype, layer.weight.dtype)
    rows = x.reshape(-1, x.shape[-1])
    y = (layer.weight.astype(dtype) @ rows.T).T.reshape(*x.shape[:-1], -1)
    return y if layer.bias is None else y + layer.bias


def check_norm_args(owner: str, x: Any, **gains: Any) -> None:
    """Refuse a norm's non-floating `x` (it would be truncated) or a gain or
    bias whose shape is not `(d,)`, `d = x.shape[-1]` (checked at trace time)."""
    if np.ndim(x) < 1:
        raise ConfigError(f"{owner}: x must have a feature axis, got a scalar.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ConfigError(
            f"{owner}: x must be floating point, got dtype {x.dtype} (the result "
            "would be truncated to integers); cast it with .astype(jnp.float32)."
        )
    d = x.shape[-1]
    for name, g in gains.items():
        if g is not None and tuple(np.shape(g)) != (d,):
            raise ConfigError(
                f"{owner}: {name} must have shape (d,) = ({d},) for x of shape "
                f"{tuple(x.shape)}, got shape {tuple(np.shape(g))}."
            )


def rms_norm(
    x: Float[Array, "*batch d"],
    weight: Float[Array, " d"] | None = None,
    eps: float = 1e-6,
) -> Float[Array, "*batch d"]:
    r"""Root-mean-square normalization over the last axis (Zhang & Sennrich, 2019).

    $$\mathrm{RMSNorm}(x) = \frac{x}{\sqrt{\tfrac1d \sum_i x_i^2 + \epsilon}}
    \odot \gamma$$

    Args:
        x: any leading axes, features last.
        weight: the gain $\gamma$ of shape `(d,)`; `None` means $\gamma = 1$.
        eps: added to the mean square before the square root.

    Returns:
        An array of the shape and dtype of `x`. The statistic and the scaling
        are computed in float32 (float64 for float64 input). With `eps=0` an
        all-zero row (a zero padding token) maps to zero, not to NaN, and its
        gradient stays finite.
    """
    check_norm_args("rms_norm", x, weight=weight)
    xf = x.astype(_stat_dtype(x.dtype))
    y = xf * _safe_rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True), eps)
    if weight is not None:
        y = y * weight.astype(xf.dtype)
    return y.astype(x.dtype)


def layer_norm(
    x: Float[Array, "*batch d"],
    weight: Float[Array, " d"] | None = None,
    bias: Float[Array, " d"] | None = None,
    eps: float = 1e-6,
) -> Float[Array, "*batch d"]:
    r"""Layer normalization over the last axis (Ba et al., 2016).

    $$\mathrm{LayerNorm}(x) = \frac{x - \mu(x)}{\sqrt{\sigma^2(x) + \epsilon}}
    \odot \gamma + \beta, \quad \mu = \tfrac1d \sum_i x_i,\;
    \sigma^2 = \tfrac1d \sum_i (x_i - \mu)^2$$

    Args:
        x: any leading axes, features last.
        weight: the gain $\gamma$ of shape `(d,)`, or `None` for 1.
        bias: the shift $\beta$ of shape `(d,)`, or `None` for 0.
        eps: added to the (biased) variance before the square root.

    Returns:
        An array of the shape and dtype of `x`; statistics in float32 or wider.
    """
    check_norm_args("layer_norm", x, weight=weight, bias=bias)
    xf = x.astype(_stat_dtype(x.dtype))
    centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = centred * _safe_rsqrt(var, eps)
    if weight is not None:
        y = y * weight.astype(xf.dtype)
    if bias is not None:
        y = y + bias.astype(xf.dtype)
    return y.astype(x.dtype)


def relu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    r"""$\mathrm{ReLU}(z) = \max(z, 0)$."""
    return jax.nn.relu(x)


def gelu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    r"""GELU, tanh approximation (GPT-2's; Hendrycks & Gimpel, 2016).

    $$\tfrac12 z \big(1 + \tanh\big(\sqrt{2/\pi}\,(z + 0.044715 z^3)\big)\big)$$
    """
    return jax.nn.gelu(x, approximate=True)


def gelu_exact(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    r"""Exact GELU, $z\,\Phi(z) = \tfrac12 z\,(1 + \mathrm{erf}(z/\sqrt2))$."""
    return jax.nn.gelu(x, approximate=False)


def silu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    r"""SiLU (swish), $z \cdot \mathrm{sigmoid}(z)$."""
    return jax.nn.silu(x)


#: Name -> elementwise activation, as used by the FFN family.
ACTIVATIONS = {"relu": relu, "gelu": gelu, "gelu_exact": gelu_exact, "silu": silu}


def dropout(
    x: Float[Array, "*shape"], rate: float, key: PRNGKeyArray | None
) -> Float[Array, "*shape"]:
    r"""Inverted dropout: $x_i m_i / (1 - p)$, $m_i \sim \mathrm{Bernoulli}(1 - p)$.

    With `key=None` or `rate == 0` this is the identity (inference), so the
    same call serves training (pass a key) and evaluation (pass none).
    """
    if key is None or rate == 0:
        return x
    key = check_key("dropout", "key", key)
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _check_int_array(owner: str, name: str, value) -> Array:
    """`value` as an integer array; refuse bool and float dtypes and, when the
    values are concrete (not traced), negative entries."""
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(
            f"{owner}: {name} must be integers, got the bool {value!r}; pass "
            f"lengths or positions as ints."
        )
    concrete = not isinstance(value, jax.core.Tracer)
    arr = np.asarray(value) if concrete else value
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ConfigError(
            f"{owner}: {name} must have an integer dtype, got dtype {arr.dtype}; "
            f"convert it with .astype(int) (a float or bool {name} is refused "
            f"rather than truncated)."
        )
    if concrete and arr.size and np.any(arr < 0):
        raise ConfigError(f"{owner}: {name} must be non-negative, got {arr.tolist()}.")
    return jnp.asarray(value)


def _ambiguous_lengths(lens_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether lengths of `lens_shape` broadcast to `shape` = `(..., B, T)` both
    per query (aligned with the query axis) and per sequence (aligned with the
    axes before it, as `valid_lens[..., None]`), with different values."""
    if len(lens_shape) == 0 or lens_shape[-1] == 1 or len(shape) < 2:
        return False
    shape, lead = tuple(shape), tuple(shape[:-1])
    try:
        per_query = np.broadcast_shapes(tuple(lens_shape), shape) == shape
        per_sequence = np.broadcast_shapes(tuple(lens_shape), lead) == lead
    except ValueError:
        return False
    return per_query and per_sequence


def _lengths(
    valid_lens: Int[ArrayLike, "..."],
    shape: tuple[int, ...],
    owner: str = "valid_lens",
) -> Int[Array, "..."]:
    """Check `valid_lens` and broadcast it to `shape` = `x.shape[:-1]`, i.e. `(..., T)`.

    The rule shared by every module: lengths are integers, non-negative (when
    concrete), and broadcast to `(..., T)` with NumPy's rules: a scalar (the
    same length for every query), `(T,)` (one per query; `arange(1, T + 1)` is
    causal), `(B, 1)` (one per sequence of a batch), `(B, T)` (per sequence and
    query), `(1, T)` (one per query, shared by every sequence). Any other
    shape raises `ConfigError` naming the fix.

    A shape that a batch can read two ways is refused: on a batch
    `(..., B, T)` with `B == T`, a 1-D `(T,)` array would be read per query,
    yet a user of a `masked_softmax` in which 1-D means one length per
    sequence (the textbook's) may mean `(B,)`. In general: lengths whose last axis
    is not 1 and that broadcast both to `x.shape[:-1]` (read per query) and,
    as `valid_lens[..., None]`, to it (read per sequence). The message shows
    both unambiguous forms, `(1, T)` per query and `(B, 1)` per sequence.
    Lengths with as many axes as `x.shape[:-1]` are never ambiguous, and a
    single sequence `(T, d)` has no sequence axis to confuse.
    """
    lens = _check_int_array(owner, "valid_lens", valid_lens)
    shape = tuple(shape)
    try:
        ok = np.broadcast_shapes(lens.shape, shape) == shape
    except ValueError:
        ok = False
    T = shape[-1]
    if not ok:
        raise ConfigError(
            f"{owner}: valid_lens must be a scalar or have shape (T,) = ({T},) "
            f"(one length per query), got shape {tuple(lens.shape)}. For a batch "
            f"x.shape[:-1] = {shape} it may be any shape that broadcasts "
            f"to it: (B, 1) for one length per sequence, (1, T) or (B, T) for "
            f"one per query."
        )
    if _ambiguous_lengths(tuple(lens.shape), shape):
        per_query = (1,) * (len(shape) - lens.ndim) + tuple(lens.shape)
        per_seq = (*lens.shape, 1)
        raise ConfigError(
            f"{owner}: valid_lens of shape {tuple(lens.shape)} is ambiguous for "
            f"a batch (..., B, T) = {shape} (B = T = {T}): it could be one "
            f"length per query, shape (T,), or one per sequence, shape (B,). "
            f"Say which: per query, give shape {per_query} (e.g. "
            f"valid_lens[None], or jnp.arange(1, T + 1)[None] for causal "
            f"lengths); per sequence, give shape {per_seq} "
            f"(valid_lens[..., None])."
        )
    return jnp.broadcast_to(lens, shape)


def causal_lengths(shape: tuple[int, ...]) -> Int[Array, "..."]:
    r"""Causal valid lengths $L_i = i + 1$ (query $i$ sees keys $0 \ldots i$) for
    `x.shape[:-1] = shape = (..., T)`: `jnp.arange(1, T + 1)` with as many axes
    as `shape` (leading ones of size 1), so a batch never reads it as one
    length per sequence, whatever `B` and `T` are."""
    owner = "causal_lengths"
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ConfigError(
            f"{owner}: shape must be a tuple of sizes x.shape[:-1] = (..., T), got "
            f"{shape!r}; for one sequence of T tokens write (T,)."
        )
    shape = tuple(
        check_int(owner, f"shape[{i}]", n, min=0) for i, n in enumerate(shape)
    )
    if not shape:
        raise ConfigError(f"{owner}: shape must be x.shape[:-1] = (..., T), got ().")
    T = shape[-1]
    return jnp.arange(1, T + 1).reshape((1,) * (len(shape) - 1) + (T,))


def valid_mask(
    valid_lens: Int[ArrayLike, "..."] | None,
    num_queries: int,
    num_keys: int,
) -> Bool[Array, "... Tq Tk"] | None:
    """Boolean `(..., Tq, Tk)` mask from valid lengths: key `j` is visible from
    query `i` iff `j < L_i`.

    `valid_lens` broadcasts to `(..., Tq)`: a scalar (every query sees keys
    `0 .. L-1`), `(Tq,)` one length per query (`jnp.arange(1, T + 1)` is
    causal), `(B, 1)` one length per sequence, `(B, Tq)`. `None` means no
    mask. The mask has the lengths' own leading axes (it knows no batch), so
    a 1-D array is always per query here; the modules and `masked_softmax`,
    which see the batch, refuse a 1-D array on a batch with `B == T` (see
    `_lengths`). Lengths must be integers (float and bool are refused) and,
    when concrete, non-negative; a shape whose last axis is neither 1 nor
    `Tq` raises `ConfigError` at trace time.
    """
    if valid_lens is None:
        return None
    arr = jnp.asarray(valid_lens)
    lead = arr.shape[:-1] if arr.ndim else ()
    lens = _lengths(valid_lens, (*lead, num_queries), "valid_mask")
    return jnp.arange(num_keys) < lens[..., None]


def softmax_where(
    scores: Float[Array, "*rows Tk"], mask: Bool[Array, "*#rows #Tk"] | None
) -> Float[Array, "*rows Tk"]:
    """Float32 softmax over the last axis with masked scores set to `MASK_VALUE`.

    The masked scores are *replaced* (`jnp.where`), never added to, so a NaN
    or inf score at a masked position does not reach the output or the
    gradient. A row with every key masked gets uniform weights.
    """
    s = scores.astype(_stat_dtype(scores.dtype))
    if mask is not None:
        s = jnp.where(mask, s, MASK_VALUE)
    return jax.nn.softmax(s, axis=-1)


def _softmax_clamped(
    scores: Float[Array, "*rows Tk"], mask: Bool[Array, "*#rows #Tk"] | None
) -> Float[Array, "*rows Tk"]:
    """`softmax_where` for scores that are not NaN (the attention layers').

    Masked scores are clamped, $\\min(s, c)$ with $c = +\\infty$ where visible
    and `MASK_VALUE` where masked: the same weights and gradients as replacing
    them for every score $\\ge$ `MASK_VALUE` (and for $+\\infty$), but a
    minimum vectorises where XLA:CPU's select in the softmax fusion does not
    (`benchmarks/attention.py`). A NaN score
    would spread to its row: the attention layers zero non-finite input rows
    first, so none reaches here.
    """
    s = scores.astype(_stat_dtype(scores.dtype))
    if mask is not None:
        cap = jnp.where(mask, jnp.inf, MASK_VALUE).astype(s.dtype)
        s = jnp.minimum(s, cap)
    return jax.nn.softmax(s, axis=-1)


def masked_softmax(
    scores: Float[Array, "*heads Tq Tk"],
    valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, "*#heads #Tq"] | None = None,
) -> Float[Array, "*heads Tq Tk"]:
    r"""Softmax over the keys, with keys beyond each query's valid length masked.

    $$p_{ij} = \frac{\exp(s_{ij})\,[j < L_i]}{\sum_{j'} \exp(s_{ij'})\,[j' < L_i]}$$

    Masked scores are replaced by `MASK_VALUE` (-1e6) before a float32
    softmax: a query with every key masked gets
    uniform weights, never NaN.

    Args:
        scores: `(..., Tq, Tk)` attention scores; leading axes (heads) broadcast.
        valid_lens: `None`, or integer lengths broadcastable to
            `scores.shape[:-1]` = `(..., Tq)` (a scalar, `(Tq,)` per query, or
            with leading axes aligned to those of `scores`: `(B, 1)` one per
            sequence, `(1, Tq)` one per query). A 1-D array is per query, never
            per sequence; where it could be either (`scores` of shape `(B, Tq, Tk)` with
            `B == Tq`) it is refused with both forms (see `_lengths`).

    Returns:
        Float32 weights of the shape of `scores`, each row summing to one.
    """
    if valid_lens is None:
        return softmax_where(scores, None)
    lens = _lengths(valid_lens, scores.shape[:-1], "masked_softmax")
    return softmax_where(scores, jnp.arange(scores.shape[-1]) < lens[..., None])


def rope_frequencies(
    head_dim: int, theta: float | Float[ArrayLike, ""] = 10000.0
) -> Float[Array, " half"]:
    r"""RoPE inverse frequencies $\theta^{-2i/p}$, $i = 0, \ldots, p/2 - 1$, float32.

    Computed as `transformers` does (`1 / theta ** (arange(0, p, 2) / p)`, all
    float32), so converted models rotate by the same angles. `theta` may be a
    Python number or a (traced) scalar array; it must be finite and > 0
    (a concrete value is checked, raising `ConfigError`; a traced one was
    checked where it was built), and `head_dim` an even int >= 2.
    """
    head_dim = check_int("rope_frequencies", "head_dim", head_dim, min=2)
    if head_dim % 2:
        raise ConfigError(f"rope: the head dimension must be even, got {head_dim}.")
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / jnp.float32(head_dim)
    return 1.0 / (_check_theta(theta) ** exponents)


def _check_theta(theta: Any) -> Array:
    """The RoPE base as a float32 scalar; refuse 0, negative, NaN and inf."""
    if isinstance(theta, jax.core.Tracer):
        # A traced base (a layer's stored theta) was checked where it was
        # built (`check_rope`); no check in the hot path.
        return jnp.asarray(theta, jnp.float32)
    if np.ndim(theta) != 0:
        raise ConfigError(
            f"rope: theta must be a scalar, got shape {tuple(np.shape(theta))}."
        )
    value = np.asarray(theta)
    if value.dtype == bool or not np.issubdtype(value.dtype, np.number):
        raise ConfigError(f"rope: theta must be a real number, got {theta!r}.")
    check_float("rope", "theta", float(value), min=0.0, min_open=True)
    return jnp.asarray(theta, jnp.float32)


def rotate_half(x: Float[Array, "*batch p"]) -> Float[Array, "*batch p"]:
    r"""$[x_1, x_2] \mapsto [-x_2, x_1]$, $x_1, x_2$ the halves of the last axis."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def rope_theta_bits(theta: float) -> Int[Array, ""]:
    """A RoPE base stored as data: the int32 bit pattern of its float32 value.

    Attention layers keep their base as this integer leaf (so optimizers and
    parameter counts skip it, and the layers of one scanned stack may differ
    in it); `jax.lax.bitcast_convert_type(bits, jnp.float32)` decodes it.
    """
    return jnp.asarray(np.array(theta, np.float32).view(np.int32))


def rope(
    x: Float[Array, "*batch T p"],
    positions: Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
    *,
    theta: float | Float[ArrayLike, ""] = 10000.0,
) -> Float[Array, "*batch T p"]:
    r"""Rotary position embedding (Su et al., 2021), half-split convention.

    Feature $i < p/2$ pairs with $i + p/2$ (`rotate_half`, as Llama, OLMo 2
    and Gemma in `transformers`); at position $m$ the pair rotates by the
    angle $m\,\theta^{-2i/p}$:
    $$\mathrm{RoPE}(x)_m = x_m \odot \cos(m\omega) + \mathrm{rotate\_half}(x_m)
    \odot \sin(m\omega), \qquad \omega = [\omega_{0..p/2-1}, \omega_{0..p/2-1}].$$
    So $\langle \mathrm{RoPE}(q)_m, \mathrm{RoPE}(k)_n \rangle$ depends on
    $m - n$ only, and norms are preserved.

    Args:
        x: `(..., T, p)` with `p` even.
        positions: integer positions broadcastable to `x.shape[:-1]`; default
            `arange(T)`. Explicit positions serve packed sequences and
            generation offsets: `rope(x[k:], positions=arange(k, T))` equals
            `rope(x)[k:]`.
        theta: the base $\theta$, a Python number or a (traced) scalar.

    Returns:
        The shape and dtype of `x`. Frequencies and angles are float32 (as in
        `transformers`); the rotation is computed in float32, or float64 for
        float64 input.
    """
    if np.ndim(x) < 2:
        raise ConfigError(
            f"rope: x must have shape (..., T, p) (positions on the second to last "
            f"axis), got shape {tuple(np.shape(x))}; rotate one vector as x[None]."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ConfigError(
            f"rope: x must be floating point, got dtype {x.dtype} (an integer "
            "input would be truncated after the rotation); cast it with "
            ".astype(jnp.float32)."
        )
    T, p = x.shape[-2], x.shape[-1]
    inv_freq = rope_frequencies(p, theta)
    if positions is None:
        pos = jnp.arange(T)
    else:
        pos = _check_int_array("rope", "positions", positions)
        try:
            ok = np.broadcast_shapes(pos.shape, x.shape[:-1]) == x.shape[:-1]
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(
                f"rope: positions must broadcast to x.shape[:-1] = "
                f"{tuple(x.shape[:-1])} (e.g. shape (T,) = ({T},)), got shape "
                f"{tuple(pos.shape)}."
            )
    # The angles are formed at the positions' own shape (e.g. (T, p)), not
    # broadcast to every head first.
    angle = pos.astype(jnp.float32)[..., None] * inv_freq
    angle = jnp.concatenate([angle, angle], axis=-1)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(_stat_dtype(x.dtype))
    out = xf * cos + rotate_half(xf) * sin
    return out.astype(x.dtype)


def segment_positions(
    segment_ids: Int[ArrayLike, "*batch T"],
) -> Int[Array, "*batch T"]:
    r"""Each token's position within its segment (packed sequences).

    $$n_t = t - \min\{u \le t : \mathrm{seg}_{u..t} \text{ all equal}\}$$
    i.e. the count restarts at 0 wherever `segment_ids` changes along the last
    axis: `[0, 0, 0, 1, 1, 2] -> [0, 1, 2, 0, 1, 0]`. Used for RoPE angles and
    learned position rows, so a packed document gets the positions it would
    have alone.
    """
    seg = jnp.asarray(segment_ids)
    T = seg.shape[-1]
    t = jnp.broadcast_to(jnp.arange(T), seg.shape)
    new = jnp.concatenate(
        [jnp.ones((*seg.shape[:-1], 1), bool), seg[..., 1:] != seg[..., :-1]], axis=-1
    )
    first = jax.lax.cummax(jnp.where(new, t, 0), axis=seg.ndim - 1)
    return t - first


def attention_entropy(weights: Float[Array, "*rows Tk"]) -> Float[Array, "*rows"]:
    r"""Shannon entropy of each attention row, $-\sum_j p_j \log p_j$ (nats).

    Zero probabilities contribute zero ($0 \log 0 = 0$). A uniform row over
    $n$ keys gives $\log n$; a one-hot row gives 0.
    """
    p = weights.astype(_stat_dtype(weights.dtype))
    return -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)


def token_spread(h: Float[Array, "*batch T d"]) -> Float[Array, ""]:
    r"""Cross-token spread $\|H - \bar H\| / \|H\|$.

    $\bar H$ copies the mean over the token axis (the second to last) to every
    position, and both norms are Frobenius norms over all axes (the whole
    batch). It is 1 when the mean token is zero (unrelated
    tokens give nearly 1) and 0 when all tokens have collapsed onto one vector
    (also an all-zero $H$, where the ratio would be 0/0).
    """
    hf = h.astype(_stat_dtype(h.dtype))
    centred = hf - jnp.mean(hf, axis=-2, keepdims=True)
    # An all-zero H has collapsed (every token is the zero vector): 0, not 0/0.
    total = jnp.linalg.norm(hf.ravel())
    return jnp.where(
        total > 0,
        jnp.linalg.norm(centred.ravel()) / jnp.where(total > 0, total, 1),
        0.0,
    )
