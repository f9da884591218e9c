r"""ViT's input: image patches as tokens, a CLS token and learned positions.

A Vision Transformer (Dosovitskiy et al., 2021) reads an image
$x \in \mathbb R^{C \times H \times W}$ as the sequence of its
$N = (H/p)(W/p)$ non-overlapping $p \times p$ patches, in row-major order
(left to right, then top to bottom). Each patch is flattened in
(channel, row, column) order and projected linearly:
$$e_n = W\, \mathrm{vec}(x_{[:,\, p r_n : p r_n + p,\; p c_n : p c_n + p]}) + b,$$
which is a convolution with kernel size and stride $p$ (`transformers`'
`Conv2d` projection), computed here as a reshape and one matrix product. The
weight keeps the convolution's layout `(d, C, p, p)`, so a PyTorch state
dict ports by copying.

`ViTEmbedding` prepends a learned CLS token and adds learned absolute
positions, $h_0 = [c;\, e_1; \ldots; e_N] + P$ with $P \in \mathbb
R^{(N+1)\times d}$ (row 0 is the CLS token's).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_int, check_key
from .functional import linear

__all__ = ["PatchEmbed", "ViTEmbedding", "patchify"]

_lecun = jax.nn.initializers.lecun_normal(in_axis=-1, out_axis=-2)


def patchify(
    images: Float[Array, "*batch C H W"], patch_size: int
) -> Float[Array, "*batch N Cpp"]:
    r"""The non-overlapping `patch_size` patches of `images` `(..., C, H, W)`,
    row-major, each flattened in (channel, row, column) order:
    `(..., (H/p)(W/p), C p p)`.

    Raises:
        ConfigError: `H` or `W` not a multiple of `patch_size`, or fewer than
            3 axes.
    """
    p = check_int("patchify", "patch_size", patch_size, min=1)
    x = jnp.asarray(images)
    if x.ndim < 3 or x.shape[-1] % p or x.shape[-2] % p:
        raise ConfigError(
            "patchify: images must have shape (..., C, H, W) with H and W "
            f"multiples of patch_size={p}, got shape {tuple(x.shape)}."
        )
    *lead, C, H, W = x.shape
    x = x.reshape(*lead, C, H // p, p, W // p, p)
    n = len(lead)
    # (..., C, Hp, p, Wp, p) -> (..., Hp, Wp, C, p, p)
    x = jnp.transpose(x, (*range(n), n + 1, n + 3, n, n + 2, n + 4))
    return x.reshape(*lead, (H // p) * (W // p), C * p * p)


class PatchEmbed(eqx.Module):
    r"""Linear embedding of image patches (a stride-$p$, $p\times p$ convolution).

    `weight` is `(d, C, p, p)` (PyTorch's `Conv2d` layout, LeCun normal with
    fan-in $C p^2$), `bias` `(d,)` (zeros) or `None`. The output has the
    input's dtype; the product accumulates in float32 or wider.
    """

    weight: Float[Array, "d C p p"]
    bias: Float[Array, " d"] | None
    num_channels: int = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)
    num_hiddens: int = eqx.field(static=True)

    def __init__(
        self,
        num_channels: int,
        patch_size: int,
        num_hiddens: int,
        *,
        bias: bool = True,
        key: PRNGKeyArray,
    ):
        """Args:
        num_channels: image channels $C$.
        patch_size: patch side $p$ (also the stride).
        num_hiddens: embedding width $d$.
        bias: a bias on the projection.
        key: PRNG key for the weight.
        """
        owner = "PatchEmbed"
        self.num_channels = check_int(owner, "num_channels", num_channels, min=1)
        self.patch_size = check_int(owner, "patch_size", patch_size, min=1)
        self.num_hiddens = check_int(owner, "num_hiddens", num_hiddens, min=1)
        bias = check_bool(owner, "bias", bias)
        key = check_key(owner, "key", key)
        C, p, d = self.num_channels, self.patch_size, self.num_hiddens
        w = _lecun(key, (d, C * p * p), jnp.float32)
        self.weight = w.reshape(d, C, p, p)
        self.bias = jnp.zeros(d, jnp.float32) if bias else None

    def __call__(
        self, images: Float[Array, "*batch C H W"]
    ) -> Float[Array, "*batch N d"]:
        """The patch embeddings of `images` `(C, H, W)` or `(..., C, H, W)`:
        `(..., N, d)`, $N = (H/p)(W/p)$ in row-major patch order."""
        x = jnp.asarray(images)
        if x.ndim < 3 or x.shape[-3] != self.num_channels:
            raise ConfigError(
                f"PatchEmbed was built for {self.num_channels} channels: images "
                f"must have shape (..., {self.num_channels}, H, W), got "
                f"{tuple(x.shape)}."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ConfigError(
                f"PatchEmbed: images must be floating point, got dtype {x.dtype}."
            )
        patches = patchify(x, self.patch_size)
        w = self.weight.reshape(self.num_hiddens, -1)
        out = linear(patches, w.astype(x.dtype))
        if self.bias is not None:
            out = out + self.bias.astype(out.dtype)
        return out.astype(x.dtype)


class ViTEmbedding(eqx.Module):
    r"""ViT's input sequence: $h_0 = [c;\, \mathrm{PatchEmbed}(x)] + P$.

    Attributes:
        patch: the `PatchEmbed`.
        cls_token: `(d,)` the learned CLS token $c$, $\mathcal N(0, 0.02^2)$.
        pos_emb: `(N + 1, d)` learned positions $P$ (row 0: the CLS token),
            $\mathcal N(0, 0.02^2)$.
        image_size: the side of the square images the positions are for.
    """

    patch: PatchEmbed
    cls_token: Float[Array, " d"]
    pos_emb: Float[Array, "N1 d"]
    image_size: int = eqx.field(static=True)

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        num_channels: int,
        num_hiddens: int,
        *,
        bias: bool = True,
        key: PRNGKeyArray,
    ):
        """Args:
        image_size: the image side $S$ (a multiple of `patch_size`);
            $N = (S/p)^2$.
        patch_size, num_channels, num_hiddens, bias: as `PatchEmbed`.
        key: PRNG key.
        """
        owner = "ViTEmbedding"
        self.image_size = check_int(owner, "image_size", image_size, min=1)
        p = check_int(owner, "patch_size", patch_size, min=1)
        if self.image_size % p:
            raise ConfigError(
                f"{owner}: image_size must be a multiple of patch_size, got "
                f"image_size={self.image_size}, patch_size={p}."
            )
        key = check_key(owner, "key", key)
        patch_key, cls_key, pos_key = jax.random.split(key, 3)
        self.patch = PatchEmbed(num_channels, p, num_hiddens, bias=bias, key=patch_key)
        d = self.patch.num_hiddens
        n = (self.image_size // p) ** 2
        self.cls_token = 0.02 * jax.random.normal(cls_key, (d,), jnp.float32)
        self.pos_emb = 0.02 * jax.random.normal(pos_key, (n + 1, d), jnp.float32)

    @property
    def num_patches(self) -> int:
        """$N = (S/p)^2$."""
        return (self.image_size // self.patch.patch_size) ** 2

    def __call__(
        self, images: Float[Array, "*batch C H W"]
    ) -> Float[Array, "*batch N1 d"]:
        """`(..., N + 1, d)` for images `(..., C, S, S)` of the built size."""
        x = jnp.asarray(images)
        S = self.image_size
        C = self.patch.num_channels
        if x.ndim < 3 or tuple(x.shape[-3:]) != (C, S, S):
            raise ConfigError(
                f"ViTEmbedding was built for {S}x{S} images (its position table "
                f"has {self.num_patches + 1} rows): images must have shape "
                f"(..., {C}, {S}, {S}), got {tuple(x.shape)}."
            )
        e = self.patch(x)
        cls = jnp.broadcast_to(
            self.cls_token.astype(e.dtype), (*e.shape[:-2], 1, e.shape[-1])
        )
        return jnp.concatenate([cls, e], axis=-2) + self.pos_emb.astype(e.dtype)
