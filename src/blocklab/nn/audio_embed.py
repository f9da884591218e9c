r"""Whisper's audio input: two 1-D convolutions over a log-mel spectrogram and
fixed sinusoidal positions.

Whisper (Radford et al., 2022) reads $x \in \mathbb R^{M \times 2S}$, $M$ mel
bins over $2S$ frames (channels first, as `transformers`' `input_features`),
and turns it into $S$ vectors of width $d$:
$$h = \mathrm{gelu}\big(\mathrm{conv}_1(x)\big),\qquad
e = \mathrm{gelu}\big(\mathrm{conv}_2(h)\big)^\top + P,$$
where $\mathrm{conv}_1$ has kernel 3, stride 1, padding 1 ($M \to d$),
$\mathrm{conv}_2$ kernel 3, stride 2, padding 1 ($d \to d$, halving the
frames), GELU is the exact (erf) one, and $P \in \mathbb R^{S \times d}$ is
the sinusoid table `sinusoids(S, d)`. A stride-$s$ convolution of kernel
$k$ and padding $(k-1)/2$ is
$$\mathrm{conv}(x)_t = b + \sum_{j=0}^{k-1} W_{:,:,j}\; \bar x_{:,\, s t + j},
\qquad t = 0, \ldots, \lfloor (L - 1)/s \rfloor,$$
with $\bar x$ the input zero-padded by $(k-1)/2$ frames on each side; it is
computed here as one matrix product over the $k$ stacked shifted copies of
the input. The weights keep PyTorch's `Conv1d` layout `(out, in, k)`, so a
state dict ports by copying.

The checkpoints store $P$; `transformers` freezes it (`requires_grad=False`),
and so does `AudioEmbedding` (a `stop_gradient`): training leaves it as
loaded.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._validate import ConfigError, check_int, check_key
from .functional import gelu_exact, linear

__all__ = ["AudioEmbedding", "conv1d", "sinusoids"]

_lecun = jax.nn.initializers.lecun_normal(in_axis=-1, out_axis=-2)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> Array:
    r"""Whisper's fixed position table `(length, channels)`: row $t$ is
    $[\sin(t\,\omega_0), \ldots, \sin(t\,\omega_{c-1}),\ \cos(t\,\omega_0),
    \ldots, \cos(t\,\omega_{c-1})]$ with $c$ = `channels`/2 and
    $\omega_i = \exp(-i \ln(\text{max\_timescale}) / (c - 1))$ (sines first,
    then cosines, not interleaved). Computed in float64, rounded once to
    float32 (`transformers` computes in float32: its table differs by up to
    about $t \cdot 2^{-24}$ at row $t$; checkpoints store theirs).

    Raises:
        ConfigError: `channels` odd or below 4 ($c - 1 = 0$ has no step).
    """
    length = check_int("sinusoids", "length", length, min=1)
    channels = check_int("sinusoids", "channels", channels, min=1)
    if channels % 2 or channels < 4:
        raise ConfigError(
            "sinusoids: channels must be even and at least 4 (half of them are "
            f"sines, half cosines, with c - 1 > 0 steps), got channels={channels}."
        )
    half = channels // 2
    step = math.log(max_timescale) / (half - 1)
    inv = np.exp(-step * np.arange(half, dtype=np.float64))
    t = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    table = np.concatenate([np.sin(t), np.cos(t)], axis=1)
    return jnp.asarray(table.astype(np.float32))


def conv1d(
    x: Float[Array, "*batch L cin"],
    weight: Float[Array, "cout cin k"],
    bias: Float[Array, " cout"] | None = None,
    *,
    stride: int = 1,
) -> Float[Array, "*batch Lout cout"]:
    r"""A 1-D convolution over the time axis of `x` `(..., L, C_in)` (time
    first, channels last), kernel $k$ odd, padding $(k-1)/2$ zeros each side:
    $y_t = b + \sum_j W_{:,:,j}\, \bar x_{s t + j}$, $t < \lfloor (L-1)/s
    \rfloor + 1$. `weight` has PyTorch's `Conv1d` layout `(C_out, C_in, k)`.
    One matrix product over the $k$ stacked shifted inputs (`linear`).
    """
    C_out, C_in, k = weight.shape
    L = x.shape[-2]
    pad = (k - 1) // 2
    L_out = (L + 2 * pad - k) // stride + 1
    widths = [(0, 0)] * (x.ndim - 2) + [(pad, pad), (0, 0)]
    xp = jnp.pad(x, widths)
    stop = stride * (L_out - 1) + 1
    cols = jnp.concatenate(
        [xp[..., j : j + stop : stride, :] for j in range(k)], axis=-1
    )  # (..., L_out, k C_in), tap j's channels in block j
    w = jnp.transpose(weight, (0, 2, 1)).reshape(C_out, k * C_in)
    y = linear(cols, w.astype(x.dtype))
    return y if bias is None else y + bias.astype(y.dtype)


class AudioEmbedding(eqx.Module):
    r"""Whisper's encoder input: $e = \mathrm{gelu}(\mathrm{conv}_2(
    \mathrm{gelu}(\mathrm{conv}_1(x))))^\top + P$ (see the module).

    Attributes:
        conv1_weight: `(d, M, 3)`, conv1_bias: `(d,)`.
        conv2_weight: `(d, d, 3)` (stride 2), conv2_bias: `(d,)`.
        pos_emb: `(S, d)` the position table $P$ (`sinusoids(S, d)` at init;
            frozen: no gradient flows into it).
        num_mel_bins: $M$; num_hiddens: $d$; max_source_len: $S$ (static).
    """

    conv1_weight: Float[Array, "d M 3"]
    conv1_bias: Float[Array, " d"]
    conv2_weight: Float[Array, "d d 3"]
    conv2_bias: Float[Array, " d"]
    pos_emb: Float[Array, "S d"]
    num_mel_bins: int = eqx.field(static=True)
    num_hiddens: int = eqx.field(static=True)
    max_source_len: int = eqx.field(static=True)

    def __init__(
        self,
        num_mel_bins: int,
        num_hiddens: int,
        max_source_len: int,
        *,
        key: PRNGKeyArray,
    ):
        """Args:
        num_mel_bins: mel channels $M$ of the input.
        num_hiddens: model width $d$ (even, >= 4: the sinusoid table).
        max_source_len: $S$, the encoder's length; the input has $2S$ frames.
        key: PRNG key for the convolution weights (LeCun normal, fan-in
            $3 \\cdot$ channels; zero biases).
        """
        owner = "AudioEmbedding"
        M = self.num_mel_bins = check_int(owner, "num_mel_bins", num_mel_bins, min=1)
        d = self.num_hiddens = check_int(owner, "num_hiddens", num_hiddens, min=1)
        S = self.max_source_len = check_int(
            owner, "max_source_len", max_source_len, min=1
        )
        k1, k2 = jax.random.split(check_key(owner, "key", key))
        self.conv1_weight = _lecun(k1, (d, 3 * M), jnp.float32).reshape(d, M, 3)
        self.conv2_weight = _lecun(k2, (d, 3 * d), jnp.float32).reshape(d, d, 3)
        self.conv1_bias = jnp.zeros(d, jnp.float32)
        self.conv2_bias = jnp.zeros(d, jnp.float32)
        self.pos_emb = sinusoids(S, d)

    def __call__(
        self, features: Float[Array, "*batch M L"]
    ) -> Float[Array, "*batch S d"]:
        """The encoder's input `(..., S, d)` for log-mel `features`
        `(..., M, 2S)` (exactly $2S$ frames, as `transformers` requires);
        the output has the features' dtype."""
        x = jnp.asarray(features)
        M, S = self.num_mel_bins, self.max_source_len
        if x.ndim < 2 or tuple(x.shape[-2:]) != (M, 2 * S):
            raise ConfigError(
                f"AudioEmbedding was built for {M} mel bins and {2 * S} frames "
                f"(2 x max_source_len={S}): features must have shape (..., {M}, "
                f"{2 * S}), got {tuple(x.shape)}."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ConfigError(
                f"AudioEmbedding: features must be floating point, got dtype {x.dtype}."
            )
        h = jnp.swapaxes(x, -1, -2)  # (..., 2S, M): time first
        h = gelu_exact(conv1d(h, self.conv1_weight, self.conv1_bias))
        h = gelu_exact(conv1d(h, self.conv2_weight, self.conv2_bias, stride=2))
        pos = jax.lax.stop_gradient(self.pos_emb)
        return (h + pos.astype(h.dtype)).astype(x.dtype)
