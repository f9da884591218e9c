"""Normalization layers as Equinox modules: `RMSNorm` (plain, Gemma), `LayerNorm`."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._validate import ConfigError, check_bool, check_choice, check_float, check_int
from .functional import layer_norm, rms_norm
from .hooks import Hooks

__all__ = ["RMSNorm", "LayerNorm", "make_norm", "NORMS"]


def _check_input(x: Array, num_hiddens: int, owner: str) -> None:
    if x.ndim == 0 or x.shape[-1] != num_hiddens:
        raise ConfigError(
            f"{owner} was built with num_hiddens={num_hiddens}, but its input x "
            f"has shape {tuple(x.shape)}; the last axis must have size {num_hiddens}."
        )
    check_float_input(x, owner)


def check_float_input(x: object, owner: str) -> None:
    """Refuse a non-floating input: integer activations would come back
    truncated in the input dtype, so they are an error, not a silent cast.
    A Python list (nested or not) is refused with the fix."""
    if not hasattr(x, "dtype") or not hasattr(x, "ndim"):
        raise ConfigError(
            f"{owner}: the input x must be an array, got a {type(x).__name__}; "
            "convert it first, e.g. jnp.asarray(x, jnp.float32)."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ConfigError(
            f"{owner}: the input x must have a floating dtype, got {x.dtype}; "
            f"convert it first, e.g. x.astype(jnp.float32)."
        )


def _check_size(num_hiddens: int, owner: str) -> int:
    num_hiddens = check_int(owner, "num_hiddens", num_hiddens)
    if num_hiddens < 1:
        raise ConfigError(
            f"{owner}: num_hiddens must be a positive int, got {num_hiddens!r}."
        )
    return num_hiddens


def _check_eps(eps: float, owner: str) -> float:
    return check_float(owner, "eps", eps, min=0.0)


class RMSNorm(eqx.Module):
    r"""RMSNorm over the last axis (Zhang & Sennrich, 2019).

    $$y = \frac{x}{\sqrt{\tfrac1d\sum_i x_i^2 + \epsilon}} \odot \gamma,$$
    with a learned gain. Plain (`unit_offset=False`): $\gamma$ = `weight`,
    initialized to ones. Gemma (`unit_offset=True`): $\gamma = 1 + w$ with
    $w$ = `weight` initialized to zeros, and $1 + w$ computed in float32 as
    `transformers`' `Gemma3RMSNorm` does (`output * (1.0 + weight.float())`),
    so Gemma weights load unchanged. Statistics in float32; the output has the
    input's dtype.
    """

    weight: Float[Array, " d"]
    num_hiddens: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    unit_offset: bool = eqx.field(static=True, default=False)

    def __init__(
        self, num_hiddens: int, eps: float = 1e-6, *, unit_offset: bool = False
    ):
        """Args:
        num_hiddens: the width $d$ of the normalized axis.
        eps: added to the mean square; finite and >= 0 (0 maps an all-zero row
            to zero).
        unit_offset: the Gemma parametrization $\\gamma = 1 + w$.
        """
        self.num_hiddens = _check_size(num_hiddens, "RMSNorm")
        self.eps = _check_eps(eps, "RMSNorm")
        self.unit_offset = check_bool("RMSNorm", "unit_offset", unit_offset)
        init = jnp.zeros if self.unit_offset else jnp.ones
        self.weight = init(num_hiddens, jnp.float32)

    @property
    def gain(self) -> Float[Array, " d"]:
        """The effective gain $\\gamma$ (`1 + weight` in the Gemma form), float32+."""
        w = self.weight.astype(jnp.promote_types(self.weight.dtype, jnp.float32))
        return 1.0 + w if self.unit_offset else w

    def __call__(
        self, x: Float[Array, "*batch d"], *, hooks: Hooks | None = None
    ) -> Float[Array, "*batch d"]:
        r"""Normalize `x` of shape `(..., num_hiddens)`; same shape and dtype out.

        Integer inputs are refused (`ValueError`). Site (`hooks`, in the
        norm's scope): `hook_normalized`, $x / \mathrm{rms}(x)$ before the
        gain, in float32 (as TransformerLens defines it).
        """
        _check_input(x, self.num_hiddens, "RMSNorm")
        weight = self.gain if self.unit_offset else self.weight
        if hooks is None or not hooks.wants("hook_normalized"):
            return rms_norm(x, weight, self.eps)
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        y = hooks("hook_normalized", rms_norm(xf, None, self.eps))
        return (y * weight.astype(y.dtype)).astype(x.dtype)


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
        """Args:
        num_hiddens: the width $d$ of the normalized axis.
        eps: added to the variance; finite and >= 0 (PyTorch's default is 1e-5).
        """
        self.num_hiddens = _check_size(num_hiddens, "LayerNorm")
        self.eps = _check_eps(eps, "LayerNorm")
        self.weight = jnp.ones(num_hiddens, jnp.float32)
        self.bias = jnp.zeros(num_hiddens, jnp.float32)

    def __call__(
        self, x: Float[Array, "*batch d"], *, hooks: Hooks | None = None
    ) -> Float[Array, "*batch d"]:
        r"""Normalize `x` of shape `(..., num_hiddens)`; same shape and dtype out.

        Integer inputs are refused (`ValueError`). Site (`hooks`, in the
        norm's scope): `hook_normalized`, $(x - \mu)/\sigma$ before the gain
        and bias, in float32 (as TransformerLens defines it).
        """
        _check_input(x, self.num_hiddens, "LayerNorm")
        if hooks is None or not hooks.wants("hook_normalized"):
            return layer_norm(x, self.weight, self.bias, self.eps)
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        y = hooks("hook_normalized", layer_norm(xf, None, None, self.eps))
        y = y * self.weight.astype(y.dtype) + self.bias.astype(y.dtype)
        return y.astype(x.dtype)


#: The valid values of the `norm` option: name -> the module class it builds
#: (`"gemma_rms"` is `RMSNorm(..., unit_offset=True)`).
NORMS = {"rms": RMSNorm, "layer": LayerNorm, "gemma_rms": RMSNorm}


def make_norm(norm: str, num_hiddens: int, eps: float = 1e-6) -> RMSNorm | LayerNorm:
    """Build the norm named `norm` ("rms", "layer", "gemma_rms") with epsilon `eps`."""
    check_choice("make_norm", "norm", norm, sorted(NORMS))
    if norm == "gemma_rms":
        return RMSNorm(num_hiddens, eps, unit_offset=True)
    return NORMS[norm](num_hiddens, eps)
