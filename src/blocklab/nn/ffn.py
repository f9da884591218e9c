"""The position-wise feed-forward family: GELU MLP and the gated variants."""

from __future__ import annotations

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_int, check_key
from . import init
from .attention import dense
from .config import (
    ACTS,
    GATED_ACTS,
    BlockConfig,
    check_act,
    ffn_width,
    reject_options_beside_config,
)
from .functional import ACTIVATIONS
from .normalization import check_float_input

__all__ = ["FeedForward", "ACTS", "GATED_ACTS", "ffn_width"]

#: act -> its elementwise function in `ACTIVATIONS` (`None`: the identity,
#: bilinear); the gated ones are `GATED_ACTS`.
_PHI = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_exact": "gelu_exact",
    "swiglu": "silu",
    "geglu": "gelu",
    "reglu": "relu",
    "bilinear": None,
}


class FeedForward(eqx.Module):
    r"""Position-wise FFN, applied to every row of $X$ independently.

    Ungated (`relu`, `gelu` = tanh GELU, `gelu_exact`):
    $$\mathrm{FFN}(x) = W_2\, \phi(W_1 x).$$
    Gated (Shazeer, 2020): `swiglu` ($\phi$ = SiLU), `geglu` (the tanh GELU,
    `transformers`' `gelu_pytorch_tanh`, which Gemma 3 uses), `reglu` (ReLU)
    and `bilinear` (no activation):
    $$\mathrm{FFN}(x) = W_2\, \big(\phi(W_g x) \odot W_1 x\big).$$
    Widths follow `ffn_width`, so all seven settings hold about $8d^2$
    weights (all gated ones exactly the same number); any explicit `width`
    (Llama's `intermediate_size`) may be given instead. `W_g` is Llama's
    `gate_proj`, `W_1` its `up_proj`, `W_2` its `down_proj`.
    """

    W_1: eqx.nn.Linear
    W_2: eqx.nn.Linear
    W_g: eqx.nn.Linear | None
    num_hiddens: int = eqx.field(static=True)
    act: str = eqx.field(static=True)
    width: int = eqx.field(static=True)

    def __init__(
        self,
        num_hiddens: int | BlockConfig,
        act: str = "swiglu",
        *,
        bias: bool = False,
        width: int | None = None,
        multiple_of: int | None = None,
        key: PRNGKeyArray,
    ):
        """Args:
        num_hiddens: model width $d$; or a `BlockConfig`, alone (with `key`):
            the block's FFN (`act`, `ffn_bias`, `ffn_width`), built from the
            config without checking it again.
        act: one of `ACTS`.
        bias: give the linear layers biases.
        width: hidden width; default `ffn_width(num_hiddens, act, multiple_of)`.
        multiple_of: round the default width up with the Llama rule.
        key: PRNG key for the weights.
        """
        owner = "FeedForward"
        if isinstance(num_hiddens, BlockConfig):
            reject_options_beside_config(
                owner,
                FeedForward.__init__,
                dict(act=act, bias=bias, width=width, multiple_of=multiple_of),
            )
            cfg = num_hiddens  # validated when it was built
            num_hiddens, act, bias, width = (
                cfg.num_hiddens, cfg.act, cfg.ffn_bias, cfg.ffn_width
            )  # fmt: skip
        else:
            check_act(owner, act)
            num_hiddens = check_int(owner, "num_hiddens", num_hiddens)
            if num_hiddens < 1:
                raise ConfigError(
                    f"{owner}: num_hiddens must be a positive int, got {num_hiddens!r}."
                )
            width = check_int(owner, "width", width, optional=True)
            multiple_of = check_int(owner, "multiple_of", multiple_of, optional=True)
            bias = check_bool(owner, "bias", bias)
            if width is not None and multiple_of is not None:
                raise ConfigError(
                    f"{owner}: give width or multiple_of, not both "
                    f"(got width={width}, multiple_of={multiple_of})."
                )
            if width is None:
                width = ffn_width(num_hiddens, act, multiple_of)
            elif width < 1:
                raise ConfigError(
                    f"{owner}: width must be a positive int, got {width!r}."
                )
        key = check_key(owner, "key", key)
        self.num_hiddens, self.act, self.width = num_hiddens, act, width
        k1, k2, kg = jax.random.split(key, 3)
        self.W_1 = init.linear(num_hiddens, width, bias=bias, key=k1)
        self.W_2 = init.linear(width, num_hiddens, bias=bias, key=k2)
        gated = act in GATED_ACTS
        self.W_g = init.linear(num_hiddens, width, bias=bias, key=kg) if gated else None

    def __call__(
        self, x: Float[Array, "*batch d"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch d"]:
        """Apply the FFN to each row of `x` (`(T, d)` or any `(..., d)`).

        `key` is accepted for the sublayer call signature and unused (the FFN
        is deterministic). Returns the dtype of `x`; integer input is refused.
        """
        del key
        if x.ndim == 0 or x.shape[-1] != self.num_hiddens:
            raise ConfigError(
                f"FeedForward was built with num_hiddens={self.num_hiddens}, but "
                f"its input x has shape {tuple(x.shape)}."
            )
        check_float_input(x, "FeedForward")
        name, gated = _PHI[self.act], self.act in GATED_ACTS
        phi = (lambda z: z) if name is None else ACTIVATIONS[name]
        hidden = dense(self.W_1, x)
        hidden = phi(dense(self.W_g, x)) * hidden if gated else phi(hidden)
        return dense(self.W_2, hidden).astype(x.dtype)
