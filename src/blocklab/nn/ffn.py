"""The position-wise feed-forward family: GELU MLP and the gated variants."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from .._validate import ConfigError, check_key
from . import init
from .config import ACTS, GATED_ACTS, BlockConfig, as_config, ffn_width
from .functional import ACTIVATIONS, dense
from .hooks import Hooks, at
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
    "geglu_exact": "gelu_exact",
    "reglu": "relu",
    "bilinear": None,
}


class FeedForward(eqx.Module):
    r"""Position-wise FFN, applied to every row of $X$ independently.

    Ungated (`relu`, `gelu` = tanh GELU, `gelu_exact`):
    $$\mathrm{FFN}(x) = W_2\, \phi(W_1 x).$$
    Gated (Shazeer, 2020): `swiglu` ($\phi$ = SiLU), `geglu` (the tanh GELU,
    `transformers`' `gelu_pytorch_tanh`, which Gemma 3 uses), `reglu` (ReLU)
    `geglu_exact` (the erf GELU: ModernBERT) and `bilinear` (no activation):
    $$\mathrm{FFN}(x) = W_2\, \big(\phi(W_g x) \odot W_1 x\big).$$
    Widths follow `ffn_width`, so all eight settings hold about $8d^2$
    weights (all gated ones exactly the same number); any explicit `ffn_width`
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
        act: str | None = None,
        *,
        multiple_of: int | None = None,
        key: PRNGKeyArray,
        **options: Any,
    ):
        """Build the FFN of a `BlockConfig`, or of its options.

        `FeedForward(d, act, **options, key=key)` is the FFN of
        `BlockConfig(d, 1, act=act, **options)`: it reads `act`, `ffn_width`
        (default `ffn_width(d, act)`; Llama's rule is
        `ffn_width=ffn_width(d, act, multiple_of=m)`) and `ffn_bias` (default
        `bias`), declared, checked and documented in `BlockConfig`.

        Args:
            num_hiddens: model width $d$, or a `BlockConfig` (then alone).
            act: one of `ACTS` (default `"swiglu"`).
            multiple_of: size the width by Llama's rule instead,
                `ffn_width(d, act, multiple_of)` (not with `ffn_width`).
            key: PRNG key for the weights.
            **options: the other fields of `BlockConfig`.
        """
        owner = "FeedForward"
        if act is not None:
            options = {**options, "act": act}
        if multiple_of is not None:
            if "ffn_width" in options:
                raise ConfigError(
                    f"{owner}: give ffn_width or multiple_of, not both (got "
                    f"ffn_width={options['ffn_width']!r}, multiple_of={multiple_of!r})."
                )
            rule = options.get("act", "swiglu")
            options = {
                **options,
                "ffn_width": ffn_width(num_hiddens, rule, multiple_of),
            }
        cfg = as_config(owner, num_hiddens, None, options, default_heads=1)
        num_hiddens, act, bias, width = (
            cfg.num_hiddens, cfg.act, cfg.ffn_bias, cfg.ffn_width
        )  # fmt: skip
        key = check_key(owner, "key", key)
        self.num_hiddens, self.act, self.width = num_hiddens, act, width
        k1, k2, kg = jax.random.split(key, 3)
        self.W_1 = init.linear(num_hiddens, width, bias=bias, key=k1)
        self.W_2 = init.linear(width, num_hiddens, bias=bias, key=k2)
        gated = act in GATED_ACTS
        self.W_g = init.linear(num_hiddens, width, bias=bias, key=kg) if gated else None

    def __call__(
        self,
        x: Float[Array, "*batch d"],
        *,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
    ) -> Float[Array, "*batch d"]:
        """Apply the FFN to each row of `x` (`(T, d)` or any `(..., d)`).

        `key` is accepted for the sublayer call signature and unused (the FFN
        is deterministic). Returns the dtype of `x`; integer input is refused.

        Sites (`hooks`, in the FFN's scope; TransformerLens's names), each
        `(..., width)`: `hook_pre`, the pre-activation $x W_1^\top + b_1$,
        or for a gated FFN the gate's $x W_g^\top + b_g$; `hook_pre_linear`
        (gated only), the linear branch $x W_1^\top + b_1$; `hook_post`,
        what $W_2$ reads ($\\phi(\\cdot)$, or $\\phi(\text{gate}) \\odot
        \text{linear}$).
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
        if gated:
            hidden = at(hooks, "hook_pre_linear", hidden)
            hidden = phi(at(hooks, "hook_pre", dense(self.W_g, x))) * hidden
        else:
            hidden = phi(at(hooks, "hook_pre", hidden))
        hidden = at(hooks, "hook_post", hidden)
        return dense(self.W_2, hidden).astype(x.dtype)
