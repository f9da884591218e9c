"""The position-wise feed-forward family: GELU MLP and the gated variants."""

from __future__ import annotations

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from .._validate import check_bool, check_int, check_key
from . import init
from .attention import dense
from .functional import ACTIVATIONS
from .normalization import check_float_input

__all__ = ["FeedForward", "ACTS", "GATED_ACTS", "ffn_width"]

#: act -> (elementwise function, gated?). `None` is the identity (bilinear).
_ACTS = {
    "relu": ("relu", False),
    "gelu": ("gelu", False),
    "gelu_exact": ("gelu_exact", False),
    "swiglu": ("silu", True),
    "geglu": ("gelu", True),
    "reglu": ("relu", True),
    "bilinear": (None, True),
}
#: The valid values of the `act` option, in the chapter's order.
ACTS = tuple(_ACTS)
#: The gated settings (three matrices).
GATED_ACTS = tuple(a for a, (_, gated) in _ACTS.items() if gated)


def _check_act(act: str, owner: str) -> None:
    if not isinstance(act, str) or act not in _ACTS:
        raise ValueError(f"{owner}: act must be one of {list(ACTS)}, got act={act!r}.")


def ffn_width(num_hiddens: int, act: str, multiple_of: int | None = None) -> int:
    r"""Hidden width of the FFN for `act`.

    Ungated: $4d$. Gated (three matrices): $\mathrm{round}(8d/3)$, which
    matches the $8d^2$ budget of the ungated MLP. With `multiple_of=m` the
    Llama rule applies: the smallest multiple of $m$ not below $\lfloor 8d/3
    \rfloor$ (gated) or $4d$ (ungated); $d = 4096, m = 256$ gives 11008.
    """
    _check_act(act, "ffn_width")
    num_hiddens = check_int("ffn_width", "num_hiddens", num_hiddens, min=1)
    gated = _ACTS[act][1]
    if multiple_of is None:
        return round(8 * num_hiddens / 3) if gated else 4 * num_hiddens
    multiple_of = check_int("ffn_width", "multiple_of", multiple_of)
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}.")
    base = (8 * num_hiddens) // 3 if gated else 4 * num_hiddens
    return -(-base // multiple_of) * multiple_of


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
        num_hiddens: int,
        act: str = "swiglu",
        *,
        bias: bool = False,
        width: int | None = None,
        multiple_of: int | None = None,
        key: PRNGKeyArray,
    ):
        """Args:
        num_hiddens: model width $d$.
        act: one of `ACTS`.
        bias: give the linear layers biases.
        width: hidden width; default `ffn_width(num_hiddens, act, multiple_of)`.
        multiple_of: round the default width up with the Llama rule.
        key: PRNG key for the weights.
        """
        owner = "FeedForward"
        _check_act(act, owner)
        num_hiddens = check_int(owner, "num_hiddens", num_hiddens)
        if num_hiddens < 1:
            raise ValueError(
                f"FeedForward: num_hiddens must be a positive int, got {num_hiddens!r}."
            )
        width = check_int(owner, "width", width, optional=True)
        multiple_of = check_int(owner, "multiple_of", multiple_of, optional=True)
        bias = check_bool(owner, "bias", bias)
        key = check_key(owner, "key", key)
        if width is not None and multiple_of is not None:
            raise ValueError(
                "FeedForward: give width or multiple_of, not both "
                f"(got width={width}, multiple_of={multiple_of})."
            )
        if width is None:
            width = ffn_width(num_hiddens, act, multiple_of)
        elif width < 1:
            raise ValueError(
                f"FeedForward: width must be a positive int, got {width!r}."
            )
        self.num_hiddens, self.act, self.width = num_hiddens, act, width
        k1, k2, kg = jax.random.split(key, 3)
        self.W_1 = init.linear(num_hiddens, width, bias=bias, key=k1)
        self.W_2 = init.linear(width, num_hiddens, bias=bias, key=k2)
        gated = _ACTS[act][1]
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
            raise ValueError(
                f"FeedForward was built with num_hiddens={self.num_hiddens}, but "
                f"its input x has shape {tuple(x.shape)}."
            )
        check_float_input(x, "FeedForward")
        name, gated = _ACTS[self.act]
        phi = (lambda z: z) if name is None else ACTIVATIONS[name]
        hidden = dense(self.W_1, x)
        hidden = phi(dense(self.W_g, x)) * hidden if gated else phi(hidden)
        return dense(self.W_2, hidden).astype(x.dtype)
