"""Normalization layers as Equinox modules: `RMSNorm` and `LayerNorm`."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .functional import layer_norm, rms_norm

__all__ = ["RMSNorm", "LayerNorm", "make_norm", "NORMS"]


def _check_width(x: Array, num_hiddens: int, owner: str) -> None:
    if x.ndim == 0 or x.shape[-1] != num_hiddens:
        raise ValueError(
            f"{owner} was built with num_hiddens={num_hiddens}, but its input x "
            f"has shape {tuple(x.shape)}; the last axis must have size {num_hiddens}."
        )


def _check_size(num_hiddens: int, owner: str) -> None:
    if not isinstance(num_hiddens, int) or num_hiddens < 1:
        raise ValueError(
            f"{owner}: num_hiddens must be a positive int, got {num_hiddens!r}."
        )


class RMSNorm(eqx.Module):
    r"""RMSNorm over the last axis (Zhang & Sennrich, 2019).

    $$y = \frac{x}{\sqrt{\tfrac1d\sum_i x_i^2 + \epsilon}} \odot \gamma,$$
    with a learned gain $\gamma$ (`weight`, initialized to ones). Statistics in
    float32; the output has the input's dtype.
    """

    weight: Float[Array, " d"]
    num_hiddens: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, num_hiddens: int, eps: float = 1e-6):
        _check_size(num_hiddens, "RMSNorm")
        self.num_hiddens = num_hiddens
        self.eps = eps
        self.weight = jnp.ones(num_hiddens, jnp.float32)

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
        """Normalize `x` of shape `(..., num_hiddens)`; same shape and dtype out."""
        _check_width(x, self.num_hiddens, "RMSNorm")
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(eqx.Module):
    r"""LayerNorm over the last axis (Ba et al., 2016).

    $$y = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \odot \gamma + \beta,$$
    with learned `weight` $\gamma$ (ones) and `bias` $\beta$ (zeros).
    Statistics in float32; the output has the input's dtype.
    """

    weight: Float[Array, " d"]
    bias: Float[Array, " d"]
    num_hiddens: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, num_hiddens: int, eps: float = 1e-6):
        _check_size(num_hiddens, "LayerNorm")
        self.num_hiddens = num_hiddens
        self.eps = eps
        self.weight = jnp.ones(num_hiddens, jnp.float32)
        self.bias = jnp.zeros(num_hiddens, jnp.float32)

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
        """Normalize `x` of shape `(..., num_hiddens)`; same shape and dtype out."""
        _check_width(x, self.num_hiddens, "LayerNorm")
        return layer_norm(x, self.weight, self.bias, self.eps)


#: The valid values of the `norm` option.
NORMS = {"rms": RMSNorm, "layer": LayerNorm}


def make_norm(norm: str, num_hiddens: int, eps: float = 1e-6) -> RMSNorm | LayerNorm:
    """Build the norm named by `norm` (`"rms"` or `"layer"`) with epsilon `eps`."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {sorted(NORMS)}, got norm={norm!r}.")
    return NORMS[norm](num_hiddens, eps)
