"""Pure array functions: the arithmetic of the transformer block.

Everything here is a plain function of arrays, so it composes with `jax.jit`,
`jax.vmap`, `jax.grad` and `jax.jacfwd` without any module machinery. Norms,
softmax and their statistics are computed in float32 (or float64 when the
input already is) and returned in the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

__all__ = [
    "linear",
    "rms_norm",
    "layer_norm",
    "relu",
    "gelu",
    "gelu_exact",
    "silu",
    "ACTIVATIONS",
    "dropout",
    "valid_mask",
    "masked_softmax",
    "attention_entropy",
    "token_spread",
    "MASK_VALUE",
]

#: The score given to masked keys before the softmax (the chapter's value). A
#: query whose keys are all masked therefore attends uniformly instead of
#: producing NaN, exactly like the chapter's `masked_softmax`.
MASK_VALUE = -1e6


def _stat_dtype(dtype) -> jnp.dtype:
    """float32, or the input dtype when that is already wider."""
    return jnp.promote_types(dtype, jnp.float32)


def linear(
    x: Float[Array, "*batch n"],
    weight: Float[Array, "m n"],
    bias: Float[Array, " m"] | None = None,
) -> Float[Array, "*batch m"]:
    r"""$y = x W^\top + b$ on every row of `x` (PyTorch's `(out, in)` layout).

    All leading axes of `x` are flattened into one before the product, so
    that the weight gradient $\partial L / \partial W = G^\top X$ is a
    matrix product over a single row axis. A batch of sequences `(B, T, n)`
    left unflattened (as `jax.vmap` leaves it) contracts over two axes, and
    XLA:CPU then copies the activations into a transposed layout first,
    fusing the activation's backward into that copy: that made the chapter's
    GELU training step 1.7x slower than its SwiGLU one on CPU (333 against
    192 ms; both take about 115 ms flattened). Computes in the wider of the
    two dtypes.
    """
    dtype = jnp.result_type(x.dtype, weight.dtype)
    y = x.reshape(-1, x.shape[-1]) @ weight.T.astype(dtype)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


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
        are computed in float32 (float64 for float64 input).
    """
    xf = x.astype(_stat_dtype(x.dtype))
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
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
    xf = x.astype(_stat_dtype(x.dtype))
    centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + eps)
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
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def valid_mask(
    valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, " Tq"] | None,
    num_queries: int,
    num_keys: int,
) -> Bool[Array, "Tq Tk"] | None:
    """Boolean `(Tq, Tk)` mask from the chapter's valid lengths.

    `valid_lens` is either a scalar (every query sees keys `0 .. L-1`) or one
    length per query, shape `(Tq,)`; `jnp.arange(1, T + 1)` is causal. `None`
    means no mask. A wrong shape raises `ValueError` at trace time.
    """
    if valid_lens is None:
        return None
    lens = jnp.asarray(valid_lens)
    if lens.ndim == 0:
        lens = jnp.broadcast_to(lens, (num_queries,))
    elif lens.shape != (num_queries,):
        raise ValueError(
            f"valid_lens must be a scalar or have shape (T,) = ({num_queries},) "
            f"(one length per query), got shape {tuple(lens.shape)}."
        )
    return jnp.arange(num_keys)[None, :] < lens[:, None]


def masked_softmax(
    scores: Float[Array, "*heads Tq Tk"],
    valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, " Tq"] | None = None,
) -> Float[Array, "*heads Tq Tk"]:
    r"""Softmax over the keys, with keys beyond each query's valid length masked.

    $$p_{ij} = \frac{\exp(s_{ij})\,[j < L_i]}{\sum_{j'} \exp(s_{ij'})\,[j' < L_i]}$$

    Masked scores are replaced by `MASK_VALUE` (-1e6) before a float32
    softmax, the chapter's semantics: a query with every key masked gets
    uniform weights, never NaN.

    Args:
        scores: `(..., Tq, Tk)` attention scores; leading axes (heads) broadcast.
        valid_lens: `None`, a scalar, or a `(Tq,)` array of per-query lengths.

    Returns:
        Float32 weights of the shape of `scores`, each row summing to one.
    """
    s = scores.astype(_stat_dtype(scores.dtype))
    mask = valid_mask(valid_lens, s.shape[-2], s.shape[-1])
    if mask is not None:
        s = jnp.where(mask, s, MASK_VALUE)
    return jax.nn.softmax(s, axis=-1)


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
    batch, as in the chapter). It is 1 when the mean token is zero (unrelated
    tokens give nearly 1) and 0 when all tokens have collapsed onto one vector.
    """
    hf = h.astype(_stat_dtype(h.dtype))
    centred = hf - jnp.mean(hf, axis=-2, keepdims=True)
    return jnp.linalg.norm(centred.ravel()) / jnp.linalg.norm(hf.ravel())
