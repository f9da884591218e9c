r"""The block's identities, both sides computed numerically in float64.

Each function evaluates the two sides of one identity of the block, the left
one by differentiating or running the library's own code
(`jax.grad`, `jax.jacfwd`, `MultiHeadAttention`, `TransformerBlock`) and the
right one from the closed form, and returns an `Identity`: the claim, both
sides as NumPy float64 arrays and their discrepancy. In float64 every identity
here holds to about 1e-13; `Identity.holds()` tests against 1e-10.

**Precision.** Every function runs inside `jax.enable_x64(True)` and casts its
inputs (arrays and every floating-point leaf of a module) to float64, so it is
exact whatever the global `jax_enable_x64` setting and whatever dtype the
caller's model has; the global setting is restored on return, and the
results are NumPy arrays, which keep their float64 dtype afterwards.

**Fibres of the normalizers (exercise 1a).** With unit gain and $\epsilon = 0$,
$\mathrm{RMSNorm}(x) = \sqrt d\, x/\|x\|$ depends only on the direction of
$x$: the inputs mapped to an output $y$ (which has $\|y\| = \sqrt d$) are the
open ray $\{\alpha y : \alpha > 0\}$. $\mathrm{LayerNorm}(x) = \sqrt d\,
Px/\|Px\|$ with $P = I - \mathbf 1\mathbf 1^\top/d$ forgets the mean as well:
the inputs mapped to $y$ (which has mean 0 and $\|y\| = \sqrt d$) form the open
half-plane $\{\alpha y + \beta \mathbf 1 : \alpha > 0, \beta \in \mathbb R\}$.
RMSNorm's fibres are one-dimensional, LayerNorm's two-dimensional; inputs with
$x = 0$ (RMSNorm) or constant $x$ (LayerNorm) are mapped nowhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float, PRNGKeyArray

from .._validate import ConfigError
from ..nn.attention import MultiHeadAttention, holds_attention, with_attention_impl
from ..nn.block import TransformerBlock
from ..nn.functional import layer_norm, rms_norm
from ..nn.stack import Stack

__all__ = [
    "Identity",
    "rms_norm_scale_invariance",
    "layer_norm_shift_invariance",
    "rms_norm_jacobian",
    "layer_norm_jacobian",
    "rms_norm_gradient_orthogonality",
    "qk_norm_scale_invariance",
    "qk_norm_weight_orthogonality",
    "qk_norm_gradient_scaling",
    "qk_norm_step_growth",
    "qk_norm_step_angle",
    "pre_ln_stream_sum",
    "pre_ln_jacobian_expansion",
    "post_ln_norm_product",
    "post_ln_norm_factors",
    "TOLERANCE",
]

#: The tolerance of `Identity.holds`: float64 identities hold to about 1e-13.
TOLERANCE = 1e-10

_float64 = functools.partial(jax.enable_x64, True)


@dataclass(frozen=True)
class Identity:
    """Both sides of one identity, evaluated numerically.

    Attributes:
        claim: the identity in words and symbols.
        lhs: the side computed by differentiating / running the library.
        rhs: the closed form.
        discrepancy: $\\max|\\text{lhs} - \\text{rhs}| / \\max|\\text{rhs}|$, or the
            absolute $\\max|\\text{lhs} - \\text{rhs}|$ when the right side is
            zero (orthogonality claims, stated as cosines).
    """

    claim: str
    lhs: np.ndarray
    rhs: np.ndarray
    discrepancy: float

    def holds(self, tol: float = TOLERANCE) -> bool:
        """Whether the discrepancy is at most `tol` (default 1e-10)."""
        return bool(self.discrepancy <= tol)


def _identity(claim: str, lhs, rhs) -> Identity:
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    scale = float(np.max(np.abs(rhs))) if rhs.size else 0.0
    diff = float(np.max(np.abs(lhs - rhs))) if rhs.size else 0.0
    return Identity(claim, lhs, rhs, diff / scale if scale > 0 else diff)


def _f64(tree):
    """Every floating-point array (or array-like) of `tree` as float64, and
    every attention layer on its reference path (the identities are about the
    reference maths, whatever `attention_impl` the model was given)."""

    def cast(a):
        if isinstance(a, (np.ndarray, jax.Array, float)) and jnp.issubdtype(
            jnp.result_type(a), jnp.inexact
        ):
            return jnp.asarray(a, jnp.float64)
        return a

    if holds_attention(tree):
        tree = with_attention_impl(tree, "reference")
    return jax.tree_util.tree_map(cast, tree)


def _check_positive(owner: str, name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{owner}: {name} must be > 0, got {name}={value!r}.")


def _cosine(a, b):
    a, b = jnp.ravel(a), jnp.ravel(b)
    return jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))


# Each side is computed by one jitted program per shape: one XLA compilation
# instead of dozens of eagerly compiled small ops.
@eqx.filter_jit
def _rms_scaled(x, weight, alpha):
    return rms_norm(alpha * x, weight, eps=0.0), rms_norm(x, weight, eps=0.0)


@eqx.filter_jit
def _ln_shifted(x, weight, bias, shift):
    return layer_norm(x + shift, weight, bias, eps=0.0), layer_norm(
        x, weight, bias, eps=0.0
    )


@eqx.filter_jit
def _rms_jacobians(x, weight, eps):
    d = x.shape[-1]
    lhs = jax.jacfwd(lambda z: rms_norm(z, weight, eps))(x)
    s = jnp.sqrt(jnp.mean(x * x) + eps)
    gain = jnp.ones(d, x.dtype) if weight is None else weight
    return lhs, gain[:, None] / s * (jnp.eye(d) - jnp.outer(x, x) / (d * s * s))


@eqx.filter_jit
def _ln_jacobians(x, weight, eps):
    d = x.shape[-1]
    lhs = jax.jacfwd(lambda z: layer_norm(z, weight, None, eps))(x)
    centred = x - jnp.mean(x)
    s = jnp.sqrt(jnp.mean(centred * centred) + eps)
    z = centred / s
    gain = jnp.ones(d, x.dtype) if weight is None else weight
    proj = jnp.eye(d) - jnp.ones((d, d)) / d
    return lhs, gain[:, None] / s * (proj - jnp.outer(z, z) / d)


@eqx.filter_jit
def _rms_grad_cosine(x, weight, loss):
    return _cosine(x, jax.grad(lambda z: loss(rms_norm(z, weight, eps=0.0)))(x))


# ------------------------------------------------------------- norms (ex. 1)
def rms_norm_scale_invariance(
    x: Float[ArrayLike, "*batch d"],
    alpha: float,
    weight: Float[ArrayLike, " d"] | None = None,
) -> Identity:
    r"""RMSNorm is scale invariant: $\mathrm{RMSNorm}(\alpha x) = \mathrm{RMSNorm}(x)$.

    Exercise 1a: for every $\alpha > 0$, with $\epsilon = 0$.

    $r(\alpha x) = \alpha\, r(x)$, so the ratio $x / r(x)$ is unchanged (for
    any gain $\gamma$, which acts afterwards). lhs: `rms_norm(alpha * x)`,
    rhs: `rms_norm(x)`, row by row.
    """
    _check_positive("rms_norm_scale_invariance", "alpha", alpha)
    with _float64():
        x, weight = _f64((jnp.asarray(x), weight))
        return _identity(
            "RMSNorm(alpha x) = RMSNorm(x), alpha > 0 (ex. 1a)",
            *_rms_scaled(x, weight, alpha),
        )


def layer_norm_shift_invariance(
    x: Float[ArrayLike, "*batch d"],
    shift: float,
    weight: Float[ArrayLike, " d"] | None = None,
    bias: Float[ArrayLike, " d"] | None = None,
) -> Identity:
    r"""LayerNorm ignores a shift: $\mathrm{LN}(x + \beta\mathbf 1) = \mathrm{LN}(x)$.

    Exercise 1a: for every $\beta$, with $\epsilon = 0$.

    Centring removes the constant: $(x + \beta\mathbf 1) - \mu(x + \beta\mathbf 1)
    = x - \mu(x)$, and the variance is computed from the centred vector.
    """
    with _float64():
        x, weight, bias = _f64((jnp.asarray(x), weight, bias))
        return _identity(
            "LayerNorm(x + beta 1) = LayerNorm(x) (ex. 1a)",
            *_ln_shifted(x, weight, bias, shift),
        )


def rms_norm_jacobian(
    x: Float[ArrayLike, " d"],
    weight: Float[ArrayLike, " d"] | None = None,
    eps: float = 0.0,
) -> Identity:
    r"""`jax.jacfwd` of RMSNorm against its closed form (ex. 1b).

    With $s = \sqrt{\|x\|^2/d + \epsilon}$,
    $$\frac{\partial\,\mathrm{RMSNorm}(x)}{\partial x}
    = \mathrm{diag}(\gamma)\, s^{-1}\Big(I - \frac{x x^\top}{d\, s^2}\Big),$$
    which at $\epsilon = 0$ is $\mathrm{diag}(\gamma)\, r(x)^{-1}(I - \hat x
    \hat x^\top)$, $\hat x = x/\|x\|$ (rows are outputs: the gain multiplies
    from the left).
    """
    with _float64():
        x, weight = _f64((jnp.asarray(x), weight))
        lhs, rhs = _rms_jacobians(x, weight, eps)
        return _identity(
            "jacfwd RMSNorm(x) = diag(gamma) r(x)^-1 (I - x_hat x_hat^T) (ex. 1b)",
            lhs,
            rhs,
        )


def layer_norm_jacobian(
    x: Float[ArrayLike, " d"],
    weight: Float[ArrayLike, " d"] | None = None,
    eps: float = 0.0,
) -> Identity:
    r"""`jax.jacfwd` of LayerNorm against its closed form (ex. 1b).

    With $P = I - \mathbf 1\mathbf 1^\top/d$, $s = \sqrt{\|Px\|^2/d + \epsilon}$
    and $z = Px/s$ (the normalized output before the gain),
    $$\frac{\partial\,\mathrm{LayerNorm}(x)}{\partial x}
    = \mathrm{diag}(\gamma)\, s^{-1}\Big(P - \frac{z z^\top}{d}\Big).$$
    The shift $\beta$ is a constant and drops out.
    """
    with _float64():
        x, weight = _f64((jnp.asarray(x), weight))
        lhs, rhs = _ln_jacobians(x, weight, eps)
        return _identity(
            "jacfwd LayerNorm(x) = diag(gamma) s^-1 (I - 11^T/d - z z^T/d) (ex. 1b)",
            lhs,
            rhs,
        )


def _default_loss(y):
    """A generic nonlinear scalar of the normalized vector(s)."""
    freq = jnp.arange(1, y.shape[-1] + 1, dtype=y.dtype)
    return jnp.sum(jnp.sin(freq * y))


def rms_norm_gradient_orthogonality(
    x: Float[ArrayLike, " d"],
    loss: Callable[[Any], Any] | None = None,
    weight: Float[ArrayLike, " d"] | None = None,
) -> Identity:
    r"""$\langle x, \nabla_x \ell\rangle = 0$ for any loss of $\mathrm{RMSNorm}(x)$.

    Exercise 1b, with $\epsilon = 0$ and any gain.

    $\nabla_x \ell = J^\top \nabla_y \ell$ and $J x = 0$ (the closed form of
    `rms_norm_jacobian` annihilates $x$), so $\langle x, \nabla_x\ell\rangle =
    \langle J x, \nabla_y \ell\rangle = 0$; equivalently, differentiate
    $\ell(\alpha x) = \ell(x)$ at $\alpha = 1$. lhs: the cosine between $x$
    and `jax.grad` of the loss (default a
    generic $\sum_i \sin(i\, y_i)$); rhs: 0.
    """
    with _float64():
        x, weight = _f64((jnp.asarray(x), weight))
        cosine = _rms_grad_cosine(x, weight, _default_loss if loss is None else loss)
        return _identity(
            "<x, grad_x l(RMSNorm(x))> = 0 (cosine; ex. 1b)", [cosine], [0.0]
        )


# --------------------------------------------------- QK-norm weights (ex. 2)
_QK_PROJECTIONS = ("W_q", "W_k")


def _head_loss(attn, x, projection, head, readout, owner):
    """`(loss(W_h), W_h)`: the readout loss as a function of one head's rows."""
    if not isinstance(attn, MultiHeadAttention):
        raise ConfigError(
            f"{owner}: attn must be a MultiHeadAttention, got {type(attn)}."
        )
    if attn.q_norm is None or attn.q_norm.eps != 0 or attn.k_norm.eps != 0:
        raise ConfigError(
            f"{owner}: the identity needs QK-norm with eps = 0; build the layer as "
            "MultiHeadAttention(..., qk_norm=True, norm_eps=0.0)."
        )
    if projection not in _QK_PROJECTIONS:
        raise ConfigError(
            f"{owner}: projection must be one of {list(_QK_PROJECTIONS)}, "
            f"got projection={projection!r}."
        )
    if getattr(attn, projection).bias is not None:
        raise ConfigError(
            f"{owner}: {projection} has a bias, which breaks scale invariance; "
            "build the layer with bias=False."
        )
    if not 0 <= head < attn.num_heads:
        raise ConfigError(
            f"{owner}: head must be in [0, {attn.num_heads}), got head={head!r}."
        )
    p = attn.head_dim
    attn, x = _f64((attn, jnp.asarray(x)))
    R = (
        jax.random.normal(jax.random.key(0), x.shape, jnp.float64)
        if readout is None
        else _f64(jnp.asarray(readout))
    )
    W = getattr(attn, projection).weight[head * p : (head + 1) * p]
    grad = functools.partial(_head_grad, attn, x, R, projection, head)
    output = functools.partial(_head_output, attn, x, projection, head)
    return grad, output, W


def _with_head(attn, projection, head, W_h):
    """`attn` with the rows of head `head` of `projection` replaced by `W_h`."""
    p = attn.head_dim

    def weight_of(a):
        return getattr(a, projection).weight

    full = weight_of(attn)
    return eqx.tree_at(weight_of, attn, full.at[head * p : (head + 1) * p].set(W_h))


@eqx.filter_jit
def _head_output(attn, x, projection, head, W_h):
    return _with_head(attn, projection, head, W_h)(x)


@eqx.filter_jit
def _head_grad(attn, x, R, projection, head, W_h):
    def loss(w):
        return jnp.mean(R * _with_head(attn, projection, head, w)(x))

    return jax.grad(loss)(W_h)


_HEAD_DOC = """
    Args:
        attn: `MultiHeadAttention(d, h, qk_norm=True, norm_eps=0.0)`
            without bias (any dtype; evaluated in float64).
        x: `(T, d)` input sequence.
        projection: `"W_q"` or `"W_k"`.
        head: which head's $p = d/h$ rows of the projection form $W$.
        readout: the $R$ of the loss $\\ell = \\mathrm{mean}(R \\odot
            \\mathrm{attn}(x))$, shape `(T, d)`; default standard normal from
            `jax.random.key(0)`.
"""


def qk_norm_scale_invariance(
    attn: MultiHeadAttention,
    x: Float[ArrayLike, "T d"],
    alpha: float,
    *,
    projection: str = "W_q",
    head: int = 0,
    readout: Float[ArrayLike, "T d"] | None = None,
) -> Identity:
    r"""Under QK-norm, scaling one head's query rows by $\alpha > 0$ changes nothing.

    The rows $W$ of $W_q$ that produce head $h$'s queries enter only through
    $\mathrm{RMSNorm}(W x)$ with $\epsilon = 0$, which is scale invariant;
    likewise for $W_k$. lhs: the output with $\alpha W$; rhs: with $W$.
    """
    _check_positive("qk_norm_scale_invariance", "alpha", alpha)
    with _float64():
        _, output, W = _head_loss(
            attn, x, projection, head, readout, "qk_norm_scale_invariance"
        )
        return _identity(
            f"attn(x) with alpha {projection}[head] = attn(x) "
            "(QK-norm, eps = 0; ex. 2)",
            output(alpha * W),
            output(W),
        )


def qk_norm_weight_orthogonality(
    attn: MultiHeadAttention,
    x: Float[ArrayLike, "T d"],
    *,
    projection: str = "W_q",
    head: int = 0,
    readout: Float[ArrayLike, "T d"] | None = None,
) -> Identity:
    r"""$\langle W, \nabla_W \ell\rangle = 0$ for a scale-invariant weight (ex. 2a).

    Differentiate $\ell(\alpha W) = \ell(W)$ in $\alpha$ at 1. lhs: the cosine
    between $W$ and `jax.grad` of the loss; rhs: 0.
    """
    with _float64():
        grad, _, W = _head_loss(
            attn, x, projection, head, readout, "qk_norm_weight_orthogonality"
        )
        g = grad(W)
        return _identity(
            f"<W, grad_W l> = 0 for W = {projection}[head] (cosine; ex. 2a)",
            [_cosine(W, g)],
            [0.0],
        )


def qk_norm_gradient_scaling(
    attn: MultiHeadAttention,
    x: Float[ArrayLike, "T d"],
    alpha: float,
    *,
    projection: str = "W_q",
    head: int = 0,
    readout: Float[ArrayLike, "T d"] | None = None,
) -> Identity:
    r"""$\nabla \ell(\alpha W) = \alpha^{-1} \nabla \ell(W)$ (ex. 2b).

    Differentiate $\ell(\alpha W) = \ell(W)$ in $W$: $\alpha \nabla\ell(\alpha W)
    = \nabla \ell(W)$. lhs: the gradient at $\alpha W$; rhs: the gradient at
    $W$ divided by $\alpha$.
    """
    _check_positive("qk_norm_gradient_scaling", "alpha", alpha)
    with _float64():
        grad, _, W = _head_loss(
            attn, x, projection, head, readout, "qk_norm_gradient_scaling"
        )
        return _identity(
            f"grad l(alpha W) = grad l(W) / alpha for W = {projection}[head] (ex. 2b)",
            grad(alpha * W),
            grad(W) / alpha,
        )


def qk_norm_step_growth(
    attn: MultiHeadAttention,
    x: Float[ArrayLike, "T d"],
    lr: float | None = None,
    *,
    projection: str = "W_q",
    head: int = 0,
    readout: Float[ArrayLike, "T d"] | None = None,
) -> Identity:
    r"""A gradient step grows $\|W\|_F^2$ by exactly $\eta^2\|g\|^2$ (ex. 2a).

    $\|W - \eta g\|^2 = \|W\|^2 - 2\eta\langle W, g\rangle + \eta^2\|g\|^2$ and
    $\langle W, g \rangle = 0$, so the norm never decreases. lhs:
    $\|W - \eta g\|^2 - \|W\|^2$; rhs: $\eta^2\|g\|^2$. The default `lr`
    makes the step as long as $W$ ($\eta\|g\| = \|W\|$), so that the float64
    subtraction on the left loses no digits.
    """
    with _float64():
        grad, _, W = _head_loss(
            attn, x, projection, head, readout, "qk_norm_step_growth"
        )
        g = grad(W)
        eta = jnp.linalg.norm(W) / jnp.linalg.norm(g) if lr is None else lr
        stepped = W - eta * g
        return _identity(
            f"||W - eta g||^2 - ||W||^2 = eta^2 ||g||^2 for W = {projection}[head] "
            "(ex. 2a)",
            [jnp.sum(stepped**2) - jnp.sum(W**2)],
            [eta**2 * jnp.sum(g**2)],
        )


def qk_norm_step_angle(
    attn: MultiHeadAttention,
    x: Float[ArrayLike, "T d"],
    alpha: float,
    lr: float = 1.0,
    *,
    projection: str = "W_q",
    head: int = 0,
    readout: Float[ArrayLike, "T d"] | None = None,
) -> Identity:
    r"""The angle of one step: $\tan\theta(\alpha W) = \tan\theta(W)/\alpha^2$ (ex. 2b).

    The step $-\eta g$ is orthogonal to $W$, so $\tan\theta = \eta\|g\|/\|W\|$;
    the gradient shrinks as $1/\alpha$ and the norm grows as $\alpha$, so the
    effective learning rate on the direction of $W$ falls as $1/\|W\|^2$ while
    the weights grow. lhs: $\tan\theta$ at $\alpha W$; rhs: $\tan\theta(W) /
    \alpha^2$, both with step size `lr`.
    """
    _check_positive("qk_norm_step_angle", "alpha", alpha)
    with _float64():
        grad, _, W = _head_loss(
            attn, x, projection, head, readout, "qk_norm_step_angle"
        )

        def tan_angle(w):
            return lr * jnp.linalg.norm(grad(w)) / jnp.linalg.norm(w)

        return _identity(
            f"tan(angle of one step) at alpha W = tan(angle at W) / alpha^2, "
            f"W = {projection}[head] (ex. 2b)",
            [tan_angle(alpha * W)],
            [tan_angle(W) / alpha**2],
        )


for _f in (
    qk_norm_scale_invariance,
    qk_norm_weight_orthogonality,
    qk_norm_gradient_scaling,
    qk_norm_step_growth,
    qk_norm_step_angle,
):
    _f.__doc__ = (_f.__doc__ or "").rstrip() + "\n" + _HEAD_DOC


# ---------------------------------------------- unrolled residual stream (ex. 3)
def _block_list(blocks, placement: str, owner: str) -> list[TransformerBlock]:
    blks = (
        [blocks.block(i) for i in range(len(blocks))]
        if isinstance(blocks, Stack)
        else list(blocks)
    )
    if not blks:
        raise ConfigError(f"{owner}: blocks is empty.")
    for b in blks:
        if not isinstance(b, TransformerBlock) or b.placement != placement:
            raise ConfigError(
                f"{owner}: needs TransformerBlocks with placement={placement!r}, got "
                f"{type(b).__name__} with placement={getattr(b, 'placement', None)!r}."
            )
    return blks


def _pre_branches(blks):
    """The 2N pre-LN branch maps $h \\mapsto F_j(\\mathrm{Norm}_j(h))$, in order."""
    out = []
    for b in blks:
        out.append(lambda h, b=b: b.attention(b.norm1(h)))
        out.append(lambda h, b=b: b.ffn(b.norm2(h)))
    return out


def pre_ln_stream_sum(
    blocks: Sequence[TransformerBlock] | Stack, x: Float[ArrayLike, "T d"]
) -> Identity:
    r"""Pre-LN stream: $x_{2N} = x_0 + \sum_{j=1}^{2N} F_j(\mathrm{Norm}_j(x_{j-1}))$.

    lhs: the library's blocks applied in order; rhs: the input plus the sum
    of the $2N$ branch outputs, each evaluated on the stream it reads.
    """
    blks = _block_list(blocks, "pre", "pre_ln_stream_sum")
    with _float64():
        out, total = _pre_stream(_f64(blks), _f64(jnp.asarray(x)))
        return _identity(
            "x_2N = x_0 + sum_j F_j(Norm_j(x_{j-1})) (pre-LN; ex. 3a)", out, total
        )


@eqx.filter_jit
def _pre_stream(blks, x):
    out = x
    for b in blks:
        out = b(out)
    h, total = x, x
    for branch in _pre_branches(blks):
        f = branch(h)
        h, total = h + f, total + f
    return out, total


@eqx.filter_jit
def _pre_jacobians(blks, x):
    """Jacobian of the whole stack and of each branch at the stream it reads (flat)."""
    shape = x.shape

    def flat(f):
        return lambda v: f(v.reshape(shape)).ravel()

    def stack(h):
        for b in blks:
            h = b(h)
        return h

    jacs, h = [], x
    for branch in _pre_branches(blks):
        jacs.append(jax.jacfwd(flat(branch))(h.ravel()))
        h = h + branch(h)
    return jax.jacfwd(flat(stack))(x.ravel()), jacs


def pre_ln_jacobian_expansion(
    blocks: Sequence[TransformerBlock] | Stack, x: Float[ArrayLike, "T d"]
) -> Identity:
    r"""The pre-LN Jacobian $\prod_j (I + J_j)$, expanded into its $2^{2N}$ terms.

    $$\frac{\partial x_{2N}}{\partial x_0} = \prod_{j=2N}^{1} (I + J_j)
    = I + \sum_{S \ne \emptyset}\, \prod_{j \in S} J_j.$$

    $J_j$ is the Jacobian of branch $j$ (`jax.jacfwd` of
    $h \mapsto F_j(\mathrm{Norm}_j(h))$ on the flattened $(T d)$ stream) at
    the stream $x_{j-1}$ it reads. The expansion has $2^{2N}$ terms, one per
    subset $S$ of sublayers (factors in decreasing $j$); the empty subset is
    the identity, which passes a gradient from the output to the input
    unchanged whatever the branches do. lhs: `jax.jacfwd` of the whole
    stack; rhs: the explicit sum of all $2^{2N}$ terms. At most 5 blocks.
    """
    blks = _block_list(blocks, "pre", "pre_ln_jacobian_expansion")
    if len(blks) > 5:
        raise ConfigError(
            "pre_ln_jacobian_expansion: at most 5 blocks (2^10 terms), "
            f"got {len(blks)}."
        )
    with _float64():
        lhs, jacs = _pre_jacobians(_f64(blks), _f64(jnp.asarray(x)))
        terms = [np.eye(lhs.shape[0])]
        for J in map(np.asarray, jacs):
            terms = terms + [J @ t for t in terms]
        return _identity(
            "d x_2N / d x_0 = I + sum over nonempty S of prod_{j in S} J_j "
            "(pre-LN; ex. 3a)",
            lhs,
            np.sum(terms, axis=0),
        )


@jax.jit
def _rms_norm_jacobians(U):
    """`jax.jacfwd` of RMSNorm (unit gain, eps = 0) at every row of `U`."""
    return jax.vmap(jax.jacfwd(lambda u: rms_norm(u, eps=0.0)))(U)


@eqx.filter_jit
def _post_unroll(blks, x):
    """Streams $u_j = x_{j-1} + F_j(x_{j-1})$ and branch outputs of a post-LN stack."""
    us, branches, h = [], [], x
    for b in blks:
        tr = b.trace(h)
        u1 = h + tr.attn_out
        h1 = b.norm1(u1)
        u2 = h1 + tr.ffn_out
        us += [u1, u2]
        branches += [tr.attn_out, tr.ffn_out]
        h = b.norm2(u2)
    return jnp.stack(us), jnp.stack(branches)


def post_ln_norm_product(
    blocks: Sequence[TransformerBlock] | Stack,
    x: Float[ArrayLike, "T d"],
    *,
    token: int = 0,
    key: PRNGKeyArray | None = None,
) -> Identity:
    r"""Post-LN norm Jacobians scale $v \perp$ all $u_j$ by $\prod_j r(u_j)^{-1}$.

    In a post-LN stack $x_j = \mathrm{Norm}_j(u_j)$, $u_j = x_{j-1} +
    F_j(x_{j-1})$. Modelling every norm as RMSNorm with unit gain and
    $\epsilon = 0$, $J_\mathrm{N}(u) = r(u)^{-1}(I - \hat u\hat u^\top)$ maps a
    vector orthogonal to $u$ to itself divided by $r(u)$, so the product of
    the $2N$ norm Jacobians scales $v$ by $\prod_j r(u_j)^{-1}$. The $u_j$ are
    those of the library's blocks (their own norms must be RMSNorm) on the
    input `x`, for one `token` (norms act token by token); $v$ is a random
    vector (from `key`) projected orthogonal to all of them (needs $d > 2N$).
    lhs: the product of `jax.jacfwd` Jacobians applied to $v$; rhs:
    $\prod_j r(u_j)^{-1} v$.
    """
    blks = _block_list(blocks, "post", "post_ln_norm_product")
    if any(b.norm != "rms" for b in blks):
        raise ConfigError(
            "post_ln_norm_product: the blocks must be built with norm='rms'."
        )
    with _float64():
        blks = _f64(blks)
        x = _f64(jnp.asarray(x))
        d = x.shape[-1]
        if d <= 2 * len(blks):
            raise ConfigError(
                f"post_ln_norm_product: need d > 2N to find a vector orthogonal to all "
                f"u_j, got d={d}, N={len(blks)}."
            )
        us, _ = _post_unroll(blks, x)
        U = us[:, token, :]  # (2N, d)
        q, _ = jnp.linalg.qr(U.T)
        v0 = jax.random.normal(
            jax.random.key(0) if key is None else key, (d,), jnp.float64
        )
        v = v0 - q @ (q.T @ v0)
        v = v / jnp.linalg.norm(v)
        lhs = v
        for J in _rms_norm_jacobians(U):
            lhs = J @ lhs
        r = jnp.sqrt(jnp.mean(U * U, axis=-1))
        return _identity(
            "prod_j J_Norm(u_j) v = prod_j r(u_j)^-1 v for v orthogonal to every u_j "
            "(post-LN; ex. 3b)",
            lhs,
            jnp.prod(1.0 / r) * v,
        )


def post_ln_norm_factors(
    blocks: Sequence[TransformerBlock] | Stack, x: Float[ArrayLike, "T d"]
) -> dict[str, np.ndarray]:
    r"""The post-LN factor $\prod_j r(u_j)^{-1}$ per token, measured and from $c_j$.

    Exercise 3b.

    Returns float64 arrays: `"measured"` $\prod_j r(u_j)^{-1}$ and
    `"closed_form"` $\prod_j (1 + c_j)^{-1/2}$ of shape `(T,)`, with
    `"c"` of shape `(2N, T)` the mean square of branch $j$'s output for each
    token. The closed form assumes a unit-RMS stream and branch outputs
    uncorrelated with it; their cross terms $2\langle x_{j-1}, F_j\rangle/d$
    vanish on average over weight draws, so the two agree on average, not
    token by token (for one draw the cross terms keep a weight-dependent mean
    of order $1/d$ per sublayer).
    """
    blks = _block_list(blocks, "post", "post_ln_norm_factors")
    with _float64():
        us, branches = _post_unroll(_f64(blks), _f64(jnp.asarray(x)))
        r = jnp.sqrt(jnp.mean(us * us, axis=-1))
        c = jnp.mean(branches * branches, axis=-1)
        return {
            "measured": np.asarray(jnp.prod(1.0 / r, axis=0)),
            "closed_form": np.asarray(jnp.prod((1.0 + c) ** -0.5, axis=0)),
            "c": np.asarray(c),
        }
